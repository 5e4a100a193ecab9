"""What a run leaves behind and shows: the run folder (checked before anything runs, never
silently reused), summary.json, curves.png, optional TensorBoard event files, and the console
lines for the plan and the result."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import threading
from pathlib import Path
from typing import Any, Iterator

from meshtron.argtypes import writable_target
from meshtron.config import RunConfig
from meshtron.errors import UserError

RUN_MARKERS = ("metrics.jsonl", "summary.json", "checkpoints")
"""Files that mean a folder holds a run (refused unless --overwrite)."""
STALE_OUTPUTS = ("metrics.jsonl", "summary.json", "memory.json", "curves.png")
"""Outputs of an earlier run removed when a run is started over it (--overwrite)."""
TENSORBOARD_DIR = "tensorboard"
RUN_FILES = ("run.toml", "plan.toml", "config.json", *STALE_OUTPUTS, ".meshtron.lock")
"""Files a run writes at the top of its folder (run_lock.LOCK_NAME the last)."""
RUN_FOLDERS = ("checkpoints", TENSORBOARD_DIR, "trace", "tokenizer", "attempts", "earlier")
"""Folders a run writes in its folder (checkpoint store, TensorBoard, doctor, tokenizer, the
ranks' failure notes of checkpoint/restart.py, the launches a --resume followed: earlier.py)."""


def check_run_dir(cfg: RunConfig, overwrite: bool) -> None:
    """Refuse a run folder that is a file, cannot be created or written, or already holds a
    run (unless `overwrite`). Writes nothing."""
    path = Path(cfg.train.run_dir)
    where = f"train.run_dir={cfg.train.run_dir!r}"
    if path.exists() and not path.is_dir():
        raise UserError(f"{where}: is a file; give a folder (created if missing)")
    held = [name for name in RUN_MARKERS if _holds(path / name)]
    if held and not overwrite:
        raise UserError(f"{where}: holds a run ({held[0]}); pass --overwrite to replace it "
                        "or choose another --run-dir")
    _refuse_wrong_kinds(path, where, overwrite)
    writable_target(path, "train.run_dir")
    if cfg.train.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError("train.tensorboard=true: the tensorboard package is not installed "
                        "(pip install tensorboard, or meshtron[tensorboard])")


def _holds(marker: Path) -> bool:
    """`marker` says the folder holds a run; an empty `checkpoints` folder does not (a link or
    mount point made ready for the run's checkpoints: store.holds_checkpoints)."""
    if marker.name == "checkpoints":
        from meshtron.checkpoint.store import holds_checkpoints

        return holds_checkpoints(marker)
    return marker.exists()


def _refuse_wrong_kinds(path: Path, where: str, overwrite: bool) -> None:
    """A folder where the run writes a file, or a file where it writes a folder: refused in one
    line before anything is written (--overwrite deletes a run's outputs, not a folder of
    unknown content under an output's name). One exception: with --overwrite a file where the
    checkpoints go is replaced (checkpoint/resume.py `prepare_start`)."""
    wrong = [(name, "a folder", "a file") for name in RUN_FILES if (path / name).is_dir()]
    wrong += [(name, "a file", "a folder") for name in RUN_FOLDERS
              if (path / name).exists() and not (path / name).is_dir()
              and not (overwrite and name == "checkpoints")]
    if wrong:
        name, found, want = wrong[0]
        raise UserError(f"{where}: {str(path / name)!r} is {found}, where the run writes "
                        f"{want}; move it away or choose another --run-dir")


def prepare_run_dir(cfg: RunConfig, main: bool = True, extra: dict[str, Any] | None = None,
                    resume: bool = False) -> Path:
    """Create the folder, remove an earlier run's outputs (allowed by `check_run_dir`; kept when
    `resume`-ing it) and write the resolved config.json (main rank)."""
    run_dir = Path(cfg.train.run_dir)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in STALE_OUTPUTS if not resume else ():
            (run_dir / name).unlink(missing_ok=True)
        tb = run_dir / TENSORBOARD_DIR
        if tb.is_dir() and not resume:
            for old in tb.glob("events.out.tfevents.*"):
                old.unlink()
        doc = {**cfg.to_dict(), **(extra or {})}
        (run_dir / "config.json").write_text(json.dumps(doc, indent=2, default=str))
    return run_dir


class _TensorBoard:
    """Scalars of each metrics record as TensorBoard events (train/*, eval/loss)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                tag = "eval/loss" if key == "eval_loss" else f"train/{key}"
                self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


@contextlib.contextmanager
def extra_writers(cfg: RunConfig, run_dir: Path, main: bool = True) -> Iterator[list[Any]]:
    """Record sinks beside metrics.jsonl: TensorBoard when `train.tensorboard` (main rank)."""
    writers: list[Any] = []
    if main and cfg.train.tensorboard:
        writers.append(_TensorBoard(run_dir / TENSORBOARD_DIR))
    try:
        yield writers
    finally:
        for w in writers:
            w.close()


def finish_run(run_dir: Path, summary: dict[str, Any], records: list[dict[str, Any]],
               curves: bool = True) -> None:
    """summary.json and curves.png (main rank, at the end of every run). `curves=False`: the
    launching parent draws curves.png once the ranks are gone (`draw_run_curves`)."""
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if curves:
        write_curves(run_dir / "curves.png", records)


def prefetch_curves() -> None:
    """Import what `write_curves` draws with on a daemon thread, while the launcher only waits
    for its ranks: `meshtron train --nproc N` draws curves.png in the launcher after the ranks
    exit (`draw_run_curves`), not on rank 0, whose peers waited at the exit barrier for
    matplotlib's import and drawing (0.45 s and 0.25 s of CPU, 1-2 s of wall time on the loaded
    2-core machine; on GPUs every device idles meanwhile). The import overlaps the agent's own
    `import torch`, which leaves the other cores idle; the drawing stays after the ranks."""
    threading.Thread(target=_import_matplotlib, name="meshtron-curves-import",
                     daemon=True).start()


def _import_matplotlib() -> None:
    import matplotlib.backends.backend_agg  # noqa: F401 - imported for write_curves
    import matplotlib.figure  # noqa: F401
    import matplotlib.ticker  # noqa: F401


def draw_run_curves(run_dir: Path) -> None:
    """curves.png from the step records of the run's metrics.jsonl: the records rank 0 held
    (the steps kept from earlier attempts and this attempt's, in order; event records left
    out), written as JSON, which round-trips every number."""
    from meshtron.checkpoint.history import step_records

    write_curves(run_dir / "curves.png", step_records(run_dir / "metrics.jsonl"))


def write_curves(path: Path, records: list[dict[str, Any]]) -> None:
    """Loss (train and eval), throughput and learning rate against step, as a PNG.

    matplotlib's object API with the Agg canvas: no pyplot, so no process-wide backend or
    figure state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    moe = [r for r in records if "moe_imbalance_max" in r]
    # fixed margins, not layout="constrained": its solver drew the figure once more to measure
    # every label, half the CPU of a draw (0.53 -> 0.27 s; every run ends with one, and each
    # test run of the suite too: session 56)
    fig = Figure(figsize=(20 if moe else 12, 3.6))
    fig.subplots_adjust(left=0.6 / (20 if moe else 12), right=0.99, bottom=0.14, top=0.91,
                        wspace=0.3)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 5 if moe else 3)
    ax_loss, ax_tps, ax_lr = axes[:3]
    steps = [r["step"] for r in records]
    ax_loss.plot(steps, [r["loss"] for r in records], label="train", linewidth=1.2)
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if evals:
        ax_loss.plot(*zip(*evals), "o-", label="eval", markersize=4)
    ax_loss.set(title="loss (nats/token)", xlabel="step")
    ax_loss.legend()
    tps = [(r["step"], r["tokens_per_s"]) for r in records if r.get("tokens_per_s")]
    if tps:
        ax_tps.plot(*zip(*tps), color="tab:green")
    ax_tps.set(title="throughput (steady tokens/s)", xlabel="step")
    ax_lr.plot(steps, [r["lr"] for r in records], color="tab:orange")
    ax_lr.set(title="learning rate", xlabel="step")
    if moe:
        _router_panels(axes[3], axes[4], moe)
    for ax in axes[:4] if moe else axes:
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.savefig(path, dpi=100)


def _router_panels(ax_imb, ax_load, moe: list[dict[str, Any]]) -> None:
    """Mixture-of-experts runs: the router's imbalance (max / mean tokens per expert; 1 is
    perfect balance) against step, and each expert's share of the routed slots at the last
    logged step (meshtron/train/router.py), with the dropped tokens (0: dropless)."""
    steps = [r["step"] for r in moe]
    ax_imb.plot(steps, [r["moe_imbalance_max"] for r in moe], label="max over layers",
                color="tab:red")
    ax_imb.plot(steps, [r["moe_imbalance_mean"] for r in moe], label="mean over layers",
                color="tab:purple")
    dropped = sum(r.get("moe_dropped", 0) for r in moe)
    ax_imb.set(title=f"router imbalance (dropped tokens: {dropped})", xlabel="step")
    ax_imb.legend()
    last = next((r for r in reversed(moe) if r.get("moe_load")), None)
    if last is not None:
        load = last["moe_load"]
        ax_load.bar(range(len(load)), load, color="tab:blue")
        ax_load.axhline(1.0 / len(load), color="black", linewidth=0.8, linestyle="--")
        ax_load.set(title=f"load per expert (step {last['step']})", xlabel="expert",
                    ylabel="share of routed slots")


def _rate(value: float | None) -> str:
    """Steady tokens/s, or why there is none (a one-step run has no step after the first)."""
    return "no steady tok/s (one step)" if value is None else f"{value:,.0f} tok/s"


def print_result(cfg: RunConfig, summary: dict[str, Any], run_dir: Path) -> None:
    """The run's closing line: losses, steady tokens/s, predicted vs measured step time."""
    from rich.console import Console

    ev = f", eval {summary['eval_loss']:.4f}" if summary.get("eval_loss") is not None else ""
    world = summary.get("world_size")
    ranks = f" on {world} rank{'s' if world != 1 else ''}" if world else ""
    pred = summary.get("predicted_step_time_s")
    meas = summary.get("measured_step_time_s", summary.get("step_time_s"))  # this attempt's
    vs = (f"; step time (median of steady steps) {meas:.3f} s vs planner {pred:.3f} s "
          f"(x{meas / pred:.2f})" if pred and meas else "")
    extra = f", memory in {run_dir}/memory.json" if summary.get("world_size") else ""
    compiled = (f" ({summary['compile_time_s']:.1f} s of it compiling)"
                if summary.get("compile_time_s") is not None else "")
    vs += _comm_words(summary)
    Console().print(
        f"[bold]done[/]: {cfg.model.name} ({summary['params']:,} params){ranks}, "
        f"{summary['steps']} step{'s' if summary['steps'] != 1 else ''}, loss "
        f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}{ev} nats/token, "
        f"{_rate(summary['tokens_per_s'])}, "
        f"{summary['wall_s']:.1f} s{compiled}{vs}; metrics in {run_dir}/metrics.jsonl, curves in "
        f"{run_dir}/curves.png{extra}", soft_wrap=True)


def _comm_words(summary: dict[str, Any]) -> str:
    """'; 1.2 MB/step on the wire per rank (compressed reduction), 7 DiLoCo syncs' when the
    run compressed its gradients or ran DiLoCo (ParallelEngine.comm_summary); '' otherwise."""
    sent = summary.get("wire_bytes_per_step")
    if sent is None:
        return ""
    syncs = summary.get("diloco_syncs")
    what = "DiLoCo's outer all-reduce" if syncs is not None else "compressed reduction"
    if syncs is None and summary.get("wire_codec") == "none":  # audit s55
        what = ("not compressed: compress_scope='inter_node' and the data-parallel group is "
                "inside one node")
    return (f"; {sent / 1e6:.3g} MB/step sent per rank ({what})"
            + (f", {syncs} DiLoCo syncs" if syncs is not None else ""))


def print_plan(plan, cluster, dtype_note: str = "", source: str = "") -> None:
    """The plan line of a multi-rank run. `dtype_note`: where the precision comes from when
    the user did not choose it (a saved plan's); `source`: where the cluster's figures come
    from (a calibration of this device, the catalogue, ...; planning.choose_cluster)."""
    from rich.console import Console

    pred = plan.predicted or {}
    pipeline = (f" schedule={plan.schedule_label()} stage_layers={list(plan.stage_layers)}"
                if plan.pp > 1 else "")
    offload = f" {plan.offload_label()}" if plan.offload_label() else ""
    Console().print(
        f"[bold]plan[/] {plan.layout()} zero={plan.zero} micro_batch={plan.micro_batch} "
        f"recompute={plan.recompute} sp={'on' if plan.sp else 'off'}{pipeline}"
        f"{' compile' if plan.compile else ''}{' async_tp' if plan.async_tp else ''}"
        f"{plan.comm_label()}{offload} "
        f"dtype={plan.dtype}{dtype_note} on {cluster.name}; {_predicted_words(pred)}"
        + (f"; cluster: {source}" if source else ""), soft_wrap=True)


def print_moe_aux_note(spec, plan) -> None:
    """What a layout's MoE balancing loss is (docs/guides/moe.md): computed per micro-batch, as
    Megatron-Core's `aux_loss` (megatron/core/transformer/moe/router.py `_apply_aux_loss`), so
    the micro-batch the planner chose is part of the objective."""
    if spec.moe_experts and spec.moe_aux_loss > 0:
        from rich.console import Console

        Console().print(
            f"moe: the balancing loss (moe_aux_loss={spec.moe_aux_loss:g}) is computed per "
            f"micro-batch of {plan.micro_batch} rows on each rank (Megatron-Core's aux_loss); "
            f"layouts match one process at the same micro-batch (`--micro-batch "
            f"{plan.micro_batch}`), another micro-batch changes this term", soft_wrap=True)


def _predicted_words(pred: dict) -> str:
    """The planner's prediction, or 'not priced' when the plan carries none (a plan.toml
    written by hand has no [predicted] table)."""
    step, memory = pred.get("step_time_s"), pred.get("memory_gib")
    if step is None or memory is None:
        return "not priced (the plan file has no predicted table)"
    return f"predicted step {step:.3f} s, {memory:.2f} GiB/rank"
