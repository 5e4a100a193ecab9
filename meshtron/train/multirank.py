"""`meshtron train` on many ranks: the parent (validate, plan, launch, report) and the rank side.

Parent (`--nproc N` on this machine): every check that can fail on user input runs here, before
any rank starts or anything is written: the config, the data, the plan against the world size and
the model. Then the plan is saved to RUN_DIR/plan.toml and torchrun starts the ranks, which read it.

Rank (started by meshtron, or by an outside torchrun / srun for multi-node jobs): joins the
process group, takes the plan rank 0 resolved (broadcast, so nodes with different local files
cannot disagree), trains, and leaves. A rank that fails prints one line and exits without
waiting for the others at a barrier (torchrun then stops the rest).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from meshtron.errors import UserError
from meshtron.launch import ARGV_ENV

EXIT_USAGE = 2


def replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with every `flag X` / `flag=X` removed and `flag value` appended."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out + [flag, value]


def run_parent(args: Any, cfg) -> int:
    from meshtron.launch import check_nproc, launch_local
    from meshtron.train.loop import build_run_data
    from meshtron.train.planning import knobs_from_args, resolve_run_plan

    nproc = args.nproc or 1
    check_nproc(nproc)
    plan, cluster = resolve_run_plan(cfg, args.plan or "auto", nproc, knobs_from_args(args, cfg),
                                     args.cluster)
    # The data must open on every data-parallel rank: check once here (cheap: the corpus is
    # read, not trained on) so that a bad path is one line, not N tracebacks.
    build_run_data(cfg, dp_rank=0, dp_size=plan.dp)
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    plan_path = run_dir / "plan.toml"
    plan.save(plan_path)
    print_plan(plan, cluster)
    code = launch_local(nproc, replace_flag(args.argv, "--plan", str(plan_path)))
    if code != 0:
        print(f"meshtron train: the {nproc} ranks failed (exit code {code}); their output is "
              "above", file=sys.stderr)
        return EXIT_USAGE if code == EXIT_USAGE else 1
    print_summary(cfg, run_dir)
    return 0


def run_rank(args: Any, cfg, world) -> int:
    """Never returns: exits the process with 0, 2 (bad input) or 1."""
    from meshtron.runtime import init_rank, shutdown_rank

    try:
        device = init_rank(world)
        plan, cluster = _agreed_plan(args, cfg, world)
        from meshtron.train.parallel import train_on_rank

        summary = train_on_rank(cfg, plan, world, device, cluster)
        if summary is not None and not os.environ.get(ARGV_ENV):
            # Started by an outside torchrun/srun: rank 0 reports (meshtron's own launcher
            # reports from the parent instead).
            plan.save(Path(cfg.train.run_dir) / "plan.toml")
            print_summary(cfg, Path(cfg.train.run_dir))
    except UserError as exc:
        _abort(world, f"error: {exc}", EXIT_USAGE)
    except BaseException as exc:  # noqa: BLE001 - a rank must not hang its peers
        traceback.print_exc()
        _abort(world, f"failed: {type(exc).__name__}: {exc}", 1)
    shutdown_rank(0)
    return 0


def _agreed_plan(args: Any, cfg, world):
    """Rank 0 resolves the plan and the cluster; every rank receives the same (or the same
    error)."""
    import torch.distributed as dist

    from meshtron.planner.cluster import cluster_from_dict
    from meshtron.planner.plan import Plan
    from meshtron.train.planning import knobs_from_args, resolve_run_plan

    payload: list[Any] = [None]
    if world.rank == 0:
        try:
            plan, cluster = resolve_run_plan(cfg, args.plan or "auto", world.world_size,
                                             knobs_from_args(args, cfg), args.cluster)
            payload[0] = {"plan": plan.to_dict(), "cluster": cluster.to_dict()}
        except UserError as exc:
            payload[0] = {"error": str(exc)}
    if dist.is_initialized() and world.world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    if "error" in payload[0]:
        raise UserError(payload[0]["error"])
    return Plan.from_dict(payload[0]["plan"]), cluster_from_dict(payload[0]["cluster"])


def _abort(world, message: str, code: int) -> None:
    import torch.distributed as dist

    print(f"meshtron train (rank {world.rank}): {message}", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    # No barrier: the other ranks may be stuck in a collective; torchrun (or the job's own
    # launcher) stops them once this rank is gone.
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
    os._exit(code)


def print_plan(plan, cluster) -> None:
    from rich.console import Console

    pred = plan.predicted or {}
    virtual = f":{plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    Console().print(
        f"[bold]plan[/] {plan.layout()} zero={plan.zero} micro_batch={plan.micro_batch} "
        f"recompute={plan.recompute} sp={'on' if plan.sp else 'off'} "
        f"schedule={plan.schedule}{virtual} stage_layers={plan.stage_layers} on {cluster.name}; "
        f"predicted step {pred.get('step_time_s', float('nan')):.3f} s, "
        f"{pred.get('memory_gib', float('nan')):.2f} GiB/rank")


def print_summary(cfg, run_dir: Path) -> None:
    from rich.console import Console

    path = run_dir / "summary.json"
    if not path.is_file():
        return
    s = json.loads(path.read_text())
    ev = f", eval {s['eval_loss']:.4f}" if s.get("eval_loss") is not None else ""
    pred = s.get("predicted_step_time_s")
    vs = (f"; step time measured {s['measured_step_time_s']:.3f} s vs planner "
          f"{pred:.3f} s (x{s['measured_step_time_s'] / pred:.2f})" if pred else "")
    Console().print(
        f"[bold]done[/]: {cfg.model.name} on {s['world_size']} ranks, {s['steps']} steps, "
        f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}{ev}, "
        f"{s['tokens_per_s']:,.0f} tok/s, {s['wall_s']:.1f} s{vs}; "
        f"metrics in {run_dir}/metrics.jsonl, memory in {run_dir}/memory.json")
