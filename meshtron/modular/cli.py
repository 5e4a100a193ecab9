"""`meshtron merge --experts RUN_A RUN_B ... --to DIR [--top-k K] [--copies C]`.

N dense branches of one base (run folders with a checkpoint, or exported weights) -> one MoE
Hugging Face folder (safetensors + config.json + the branches' tokenizer + merge.json) that
`meshtron train --init-from DIR` starts from. One input with `--copies E` is sparse upcycling.
Everything that can be checked is checked before a tensor is read (the inputs' configurations,
shapes, vocabulary, tokenizer and base, the output folder); the folder is written under a
temporary name and renamed into place, so an error leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

from meshtron.argtypes import literal_value, nonnegative_int, positive_int
from meshtron.errors import UserError


def _fields(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("model."):
            raise UserError(f"merge --set {item!r}: expected model.KEY=VALUE, e.g. "
                            "model.moe_router=sigmoid")
        out[key[len("model."):]] = literal_value(value)
    return out


def _prepare_output(to: str) -> Path:
    """The output folder: absent or empty, and creatable (probed now, before any work)."""
    from meshtron.argtypes import writable_target

    out = Path(to)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"merge --to={to!r}: already exists and is not an empty folder; "
                        "choose a new folder")
    writable_target(out, "merge --to")
    return out


def cmd_merge(args: argparse.Namespace) -> int:
    from meshtron.hf.names import check_supported
    from meshtron.modular import branches as br
    from meshtron.modular.upcycle import moe_spec

    out = _prepare_output(args.to)
    inputs = [br.describe(p) for p in args.experts]
    br.check_compatible(inputs)
    inputs = [br.with_checkpoint(b) for b in inputs]
    br.check_distinct(inputs)
    copies = args.copies or (1 if len(inputs) > 1 else 0)
    if copies * len(inputs) < 2:
        raise UserError("merge --copies: one input needs --copies E (E >= 2) to upcycle into E "
                        "experts")
    experts = copies * len(inputs)
    spec = moe_spec(inputs[0].spec, experts, args.top_k or min(2, experts), _fields(args.set))
    check_supported(spec, "merge --to")  # the folder must be one --init-from reads
    _check_host_memory(spec, copies, inputs)
    inside = out.is_dir()  # an empty folder (checked above), '.' included
    tmp = (out / f".merge.tmp-{os.getpid()}" if inside
           else out.parent / f".{out.name}.tmp-{os.getpid()}")
    try:
        summary = _write(inputs, spec, copies, args.seed, tmp)
        _put_in_place(tmp, out, inside)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if inside:  # it was empty: whatever is in it now is ours (files moved when stopped)
            for entry in out.iterdir():
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        raise
    print(f"merged {len(inputs)} dense model(s) into {out}: {experts} experts, top-"
          f"{spec.moe_top_k}, {spec.num_params():,} parameters ({spec.active_params():,} "
          f"active); router {summary['router']['gate']}; train it with "
          f"`meshtron train --init-from {out}`")
    return 0


def _put_in_place(tmp: Path, out: Path, inside: bool) -> None:
    """A new `out`: the finished folder renamed into place (atomic). An existing empty `out`
    (whose parent may not be writable, or `--to .`, which cannot be removed and renamed):
    the finished files moved into it, merge.json last, so it marks a complete result."""
    if not inside:
        tmp.rename(out)
        return
    for entry in sorted(tmp.iterdir(), key=lambda p: p.name == "merge.json"):
        entry.replace(out / entry.name)
    tmp.rmdir()


BYTES_PER_PARAM = 4
"""Every tensor of the merge is fp32 in host memory: run checkpoints hold fp32 masters (also
for bf16 runs: meshtron/hf/export.py's docstring), and `branches.load_state` reads exported
weights into float32."""


def _check_host_memory(spec, copies: int, inputs: list) -> None:
    """Refuse, before a tensor is read, a merge that cannot fit in this machine's memory: `_write`
    holds every input's full state (each branch's MLP becomes an expert) and then builds the
    merged one beside them, all fp32 (`--copies 1000000` was a DefaultCPUAllocator traceback;
    the inputs were not counted)."""
    held = sum(b.spec.num_params() for b in inputs) + spec.num_params()
    need = held * BYTES_PER_PARAM
    from meshtron.planner.machine_memory import machine_memory_bytes

    total = machine_memory_bytes()  # the control group's limit where lower (a container)
    if need > total:
        what = f"--copies={copies}" if copies > 1 else f"--experts (x{len(inputs)})"
        raise UserError(f"merge {what}: {spec.moe_experts:,} experts make {spec.num_params():,} "
                        f"parameters; with the {len(inputs)} input(s) held beside them, "
                        f"{held:,} fp32 parameters need {need / 2**30:,.1f} GiB, more than "
                        f"this machine's {total / 2**30:,.1f} GiB of memory")


def _write(inputs, spec, copies: int, seed: int, tmp: Path) -> dict[str, Any]:
    from meshtron.hf.export import save_hf
    from meshtron.modular import branches as br
    from meshtron.modular.upcycle import merge_states

    states, distances, read = [], [], []
    for b in inputs:  # the experts need every branch's MLP; the rest is averaged
        b, state = br.read_branch(b)  # the checkpoint read (a live run may rotate it)
        read.append(b)
        br.check_not_same(b, state, list(zip(inputs, states)))
        distances.append(br.check_close(b, state, inputs[0], states[0]) if states else 0.0)
        states.append(state)
    merged, init = merge_states(states, spec, copies, seed)
    del states
    save_hf(merged, spec, tmp, tokenizer_dir=inputs[0].tokenizer_dir, field="merge --to")
    summary = {
        "format": "meshtron-merge/1",
        "method": "upcycle" if len(inputs) == 1 else "branch-train-mix",
        "branches": [{"path": str(b.path.resolve()), "kind": b.kind, "base": b.base,
                      "tokenizer": b.tokenizer, "relative_distance": d,
                      # the run and step merged (exported weights: their export.json's;
                      # None when they have none), and a run's checkpoint folder
                      "run_id": b.run_id, "run": b.run, "step": b.step,
                      "checkpoint": b.checkpoint.name if b.checkpoint else None}
                     for b, d in zip(read, distances)],
        "copies": copies, "router_seed": seed, "router": init.to_dict(),
        "model": spec.to_dict(),
    }
    (tmp / "merge.json").write_text(json.dumps(summary, indent=2))
    return summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("merge", help="dense runs -> one mixture of experts (upcycling, BTX)",
                       description="Branch-Train-MiX: expert i = branch i's MLP, the other "
                       "weights averaged, router fresh. Sparse upcycling: one input with "
                       "--copies E (logits equal the dense model's before any step).")
    p.add_argument("--experts", nargs="+", required=True, metavar="RUN",
                   help="dense run folders (with a checkpoint) or exported weights folders of "
                        "one base")
    p.add_argument("--to", required=True, metavar="DIR",
                   help="output folder (new or empty): weights for --init-from")
    p.add_argument("--top-k", type=positive_int, metavar="K",
                   help="experts per token (default: 2, or 1 with one expert)")
    p.add_argument("--copies", type=positive_int, metavar="C",
                   help="experts per input (default 1; upcycling one input needs C >= 2)")
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="seed of the fresh router (default 0)")
    p.add_argument("--set", action="append", default=[], metavar="model.KEY=VALUE",
                   help="an MoE field of the result, e.g. model.moe_aux_loss=0.02 (repeatable)")
    p.set_defaults(func=cmd_merge)
