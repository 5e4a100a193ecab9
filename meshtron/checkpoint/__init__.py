"""Surviving failures: sharded asynchronous checkpoints with an integrity manifest, exact resume
(also on another layout), automatic restarts through torchrun and SIGTERM preemption.

- `CheckpointConfig`: the flags (`--checkpoint-every N|auto`, `--keep`, `--resume`,
  `--max-restarts`, `--preempt-grace`, `--mtbf-hours`).
- `Checkpointer`: the training loop's hook (collective; one per rank).
- `load_full_state_dict(folder)`: a checkpoint as one unsharded state dict with meshtron's
  parameter names, without a process group (for export).
- `store`: the on-disk format, commit protocol and verification.
- `snapshot` / `snapshot_files`: in-memory snapshots (own shard + a peer node's copy in host
  memory) a restarted attempt restores before looking at disk; `phases`: a start-up's
  wall-clock marks, for the restart record.
"""

from meshtron.checkpoint.config import EXIT_PREEMPTED, EXIT_STORAGE, CheckpointConfig

__all__ = ["EXIT_PREEMPTED", "EXIT_STORAGE", "CheckpointConfig", "latest_checkpoint",
           "load_full_state_dict"]


def __getattr__(name: str):
    # `export` imports torch; the flags and exit code above must not (`meshtron plan` and
    # `--help` build every subcommand's parser, which reads CheckpointConfig).
    if name in ("latest_checkpoint", "load_full_state_dict"):
        from meshtron.checkpoint import export

        return getattr(export, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
