"""`meshtron train` and `meshtron demo`."""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from pathlib import Path
from typing import Any

from meshtron.config import apply_overrides, config_from_dict, load_toml
from meshtron.launch import ARGV_ENV

# CLI flag -> dotted config key. Flags left unset do not override the TOML file.
_FLAGS: dict[str, tuple[str, type, str]] = {
    "--model": ("model", str, "preset name or path to a Hugging Face config.json"),
    "--data": ("data.source", str, "'stdlib', a text file/folder, a .jsonl or a .bin token shard"),
    "--tokenizer": ("data.tokenizer", str, "byte | bpe"),
    "--seq-len": ("data.seq_len", int, "tokens per sequence"),
    "--global-batch": ("data.global_batch", int, "sequences per optimizer step"),
    "--micro-batch": ("data.micro_batch", int, "sequences per forward/backward (accumulation)"),
    "--lr": ("optim.lr", float, "peak learning rate"),
    "--warmup-steps": ("optim.warmup_steps", int, "linear warm-up steps"),
    "--steps": ("train.steps", int, "optimizer steps"),
    "--dtype": ("train.dtype", str, "fp32 | bf16"),
    "--seed": ("train.seed", int, "seed of weights and data order"),
    "--eval-every": ("train.eval_every", int, "eval period in steps (0: off)"),
    "--run-dir": ("train.run_dir", str, "output folder"),
}


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="RUN.toml", help="TOML run file (flags override it)")
    for flag, (key, typ, text) in _FLAGS.items():
        p.add_argument(flag, type=typ, dest=key.replace(".", "__"), metavar=typ.__name__.upper(),
                       help=f"{text} [{key}]")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set optim.beta2=0.99 (repeatable)")


def run_config_from_args(args: argparse.Namespace, defaults: dict[str, Any] | None = None):
    doc = load_toml(args.config) if args.config else dict(defaults or {})
    overrides = {key: getattr(args, key.replace(".", "__")) for key, *_ in _FLAGS.values()}
    for item in args.set:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. optim.lr=1e-3")
        key, value = item.split("=", 1)
        if key != "model" and "." not in key:
            raise ValueError(f"--set {key!r}: expected SECTION.KEY (data, optim or train)")
        overrides[key] = _literal(value)
    return config_from_dict(apply_overrides(doc, overrides))


def _print_result(cfg, result) -> None:
    from rich.console import Console

    console = Console()
    ev = f", eval {result.eval_loss:.4f}" if result.eval_loss is not None else ""
    console.print(
        f"[bold]done[/]: {cfg.model.name} ({result.params:,} params), {result.steps} steps, "
        f"loss {result.first_loss:.4f} -> {result.final_loss:.4f}{ev} nats/token, "
        f"{result.tokens_per_s:,.0f} tok/s, {result.wall_s:.1f} s; "
        f"metrics in {cfg.train.run_dir}/metrics.jsonl")


def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (any of these runs the job on torch.distributed)")
    g.add_argument("--nproc", type=int, help="local ranks to start with torchrun (standalone); "
                   "inside an existing torchrun/srun world its size is used")
    g.add_argument("--plan", help="'auto' (ask the planner), a layout 'tp=2,pp=2,dp=2' (open "
                   "knobs are chosen by the planner), or a plan.toml from `meshtron plan --save`")
    g.add_argument("--cluster", help="cluster to plan for: a preset like dgx-h100:1 or a TOML "
                   "file (default: this machine's `meshtron calibrate` file)")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="ZeRO stage over the data axis")
    g.add_argument("--schedule", help="pipeline schedule: gpipe | 1f1b | interleaved[:V] | zb")
    g.add_argument("--recompute", choices=["none", "selective", "full"],
                   help="activation recomputation")
    g.add_argument("--sp", choices=["on", "off"], help="sequence parallelism (with tp > 1)")


def _wants_parallel(args: argparse.Namespace) -> bool:
    from meshtron.launch import current_world

    return (args.plan is not None or (args.nproc or 1) > 1
            or current_world().world_size > 1)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = run_config_from_args(args)
    if _wants_parallel(args):
        return train_parallel_cli(args, cfg)
    from meshtron.train.loop import train

    result = train(cfg)
    _print_result(cfg, result)
    return 0


def _replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == flag:
            skip = True
            continue
        if arg.startswith(flag + "="):
            continue
        out.append(arg)
    return out + [flag, value]


def train_parallel_cli(args: argparse.Namespace, cfg) -> int:
    """Parent: resolve and save the plan, start the ranks. Rank: train."""
    from meshtron.launch import check_nproc, current_world, launch_local
    from meshtron.train.planning import knobs_from_args, resolve_run_plan

    world = current_world()
    knobs = knobs_from_args(args, cfg)
    if world.source == "single":
        nproc = args.nproc or 1
        check_nproc(nproc)
        plan, cluster = resolve_run_plan(cfg, args.plan or "auto", nproc, knobs, args.cluster)
        run_dir = Path(cfg.train.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        plan_path = run_dir / "plan.toml"
        plan.save(plan_path)
        _print_plan(plan, cluster)
        argv = _replace_flag(args.argv, "--plan", str(plan_path))
        code = launch_local(nproc, argv)
        if code != 0:
            print(f"meshtron train: {nproc} ranks failed (exit code {code}); "
                  f"see the rank output above", file=sys.stderr)
            return 1
        _print_parallel_summary(cfg, run_dir)
        return 0
    return _train_rank(args, cfg, world, knobs)


def _train_rank(args, cfg, world, knobs) -> int:
    from meshtron.runtime import init_rank, shutdown_rank
    from meshtron.train.parallel import train_on_rank
    from meshtron.train.planning import resolve_run_plan

    # Every rank resolves the same plan (deterministic), so a multi-node torchrun/srun start
    # needs no shared file; locally started ranks read the parent's saved plan.
    plan, cluster = resolve_run_plan(cfg, args.plan or "auto", world.world_size, knobs,
                                     args.cluster)
    device = init_rank(world)
    summary = train_on_rank(cfg, plan, world, device, cluster)
    if summary is not None and not os.environ.get(ARGV_ENV):
        # Started by an outside torchrun/srun: rank 0 reports (meshtron's own launcher
        # reports from the parent instead).
        plan.save(Path(cfg.train.run_dir) / "plan.toml")
        _print_parallel_summary(cfg, Path(cfg.train.run_dir))
    shutdown_rank(0)
    return 0


def _print_plan(plan, cluster) -> None:
    from rich.console import Console

    pred = plan.predicted or {}
    Console().print(
        f"[bold]plan[/] {plan.layout()} zero={plan.zero} micro_batch={plan.micro_batch} "
        f"recompute={plan.recompute} sp={'on' if plan.sp else 'off'} schedule={plan.schedule}"
        f"{':' + str(plan.virtual_stages) if plan.virtual_stages > 1 else ''} "
        f"stage_layers={plan.stage_layers} on {cluster.name}; predicted step "
        f"{pred.get('step_time_s', float('nan')):.3f} s, {pred.get('memory_gib', float('nan')):.2f} GiB/rank")


def _print_parallel_summary(cfg, run_dir: Path) -> None:
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


# The demo: the default model on the embedded corpus, on 4 local ranks with a hybrid layout
# (tensor parallel 2; the planner picks the rest for this machine), about three minutes on a
# 2-core machine.
DEMO_CONFIG: dict[str, Any] = {
    "model": "tiny",
    "data": {"source": "stdlib", "seq_len": 256, "global_batch": 16},
    "optim": {"lr": 3e-3, "warmup_steps": 10},
    "train": {"steps": 120, "eval_every": 40, "run_dir": "runs/demo"},
}
DEMO_NPROC = 4
DEMO_LAYOUT = "tp=2"


def cmd_demo(args: argparse.Namespace) -> int:
    """Calibrate this machine (once), plan for it, then train on local ranks."""
    from meshtron.launch import current_world

    cfg = run_config_from_args(args, defaults=DEMO_CONFIG)
    if current_world().source != "single":
        return train_parallel_cli(args, cfg)  # a rank of the demo
    args.nproc = args.nproc or DEMO_NPROC
    args.plan = args.plan or DEMO_LAYOUT
    _ensure_calibration(args.nproc, args.cluster)
    _show_plans(args, cfg)
    return train_parallel_cli(args, cfg)


def _ensure_calibration(nproc: int, cluster: str | None) -> None:
    from rich.console import Console

    from meshtron.calibrate.cli import default_cluster_path
    from meshtron.launch import launch_local

    path = default_cluster_path(nproc)
    if cluster or path.is_file():
        return
    Console().print(f"[bold]calibrate[/]: measuring {nproc} local ranks (once; saved to {path})")
    if launch_local(nproc, ["calibrate", "--nproc", str(nproc)]) != 0:
        raise RuntimeError("calibration failed; see the output above")


def _show_plans(args: argparse.Namespace, cfg) -> None:
    """The planner's view of this machine: top plans of every layout, and why others lose."""
    from rich.console import Console

    from meshtron.planner import report
    from meshtron.planner.search import search_plans
    from meshtron.train.planning import local_cluster

    cluster = local_cluster(args.nproc, args.cluster)
    result = search_plans(cfg.model, cluster, cfg.data.global_batch, cfg.data.seq_len, top_k=3)
    report.render(result, tokens=cfg.train.steps * cfg.data.global_batch * cfg.data.seq_len,
                  console=Console())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model (single process)",
                       description="Train a model. Configure with --config RUN.toml and/or flags.")
    add_run_arguments(p)
    add_parallel_arguments(p)
    p.set_defaults(func=cmd_train)
    d = sub.add_parser("demo", help="the main job on the embedded default (no downloads)",
                       description="Calibrate this machine, plan for it, and train the tiny model "
                                   f"on {DEMO_NPROC} local ranks (layout {DEMO_LAYOUT}, the "
                                   "rest chosen by the planner) on the Python standard "
                                   "library's sources.")
    add_run_arguments(d)
    add_parallel_arguments(d)
    d.set_defaults(func=cmd_demo)
