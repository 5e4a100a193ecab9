"""`meshtron train` and `meshtron demo`."""

from __future__ import annotations

import argparse
import ast
import os
from typing import Any

from meshtron.config import apply_overrides, config_from_dict, load_toml
from meshtron.errors import RunFailed, UserError
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
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. optim.lr=1e-3")
        key, value = item.split("=", 1)
        if key != "model" and "." not in key:
            raise UserError(f"--set {key!r}: expected SECTION.KEY (data, optim or train)")
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


def _wants_parallel(args: argparse.Namespace, world) -> bool:
    """Any parallelism flag (or an outside torchrun/srun world) means torch.distributed."""
    flags = (args.plan, args.cluster, args.zero, args.schedule, args.recompute, args.sp)
    return any(f is not None for f in flags) or (args.nproc or 1) > 1 or world.source != "single"


def cmd_train(args: argparse.Namespace) -> int:
    from meshtron.launch import current_world

    cfg = run_config_from_args(args)
    world = current_world()
    if _wants_parallel(args, world):
        return train_parallel_cli(args, cfg, world)
    from meshtron.train.loop import train

    result = train(cfg)
    _print_result(cfg, result)
    return 0


def train_parallel_cli(args: argparse.Namespace, cfg, world) -> int:
    from meshtron.train import multirank

    if world.source == "single":
        return multirank.run_parent(args, cfg)
    if args.nproc is not None and args.nproc != world.world_size and not os.environ.get(ARGV_ENV):
        raise UserError(f"--nproc={args.nproc}: this {world.source} world already has "
                         f"{world.world_size} ranks; drop --nproc inside torchrun/srun")
    return multirank.run_rank(args, cfg, world)


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
    world = current_world()
    if world.source != "single":
        return train_parallel_cli(args, cfg, world)  # a rank of the demo
    args.nproc = args.nproc or DEMO_NPROC
    args.plan = args.plan or DEMO_LAYOUT
    _ensure_calibration(args.nproc, args.cluster)
    _show_plans(args, cfg)
    return train_parallel_cli(args, cfg, world)


def _ensure_calibration(nproc: int, cluster: str | None) -> None:
    from rich.console import Console

    from meshtron.calibrate.cli import default_cluster_path
    from meshtron.launch import launch_local

    path = default_cluster_path(nproc)
    if cluster or path.is_file():
        return
    Console().print(f"[bold]calibrate[/]: measuring {nproc} local ranks (once; saved to {path})")
    if launch_local(nproc, ["calibrate", "--nproc", str(nproc)]) != 0:
        raise RunFailed("calibration failed; see the output above")


def _show_plans(args: argparse.Namespace, cfg) -> None:
    """The planner's view of this machine: top plans of every layout, and why others lose."""
    from rich.console import Console

    from meshtron.planner import report
    from meshtron.planner.search import search_plans
    from meshtron.train.planning import local_cluster

    cluster = local_cluster(args.nproc, args.cluster)
    result = search_plans(cfg.model, cluster, cfg.data.global_batch, cfg.data.seq_len, top_k=3)
    console = Console()
    if not console.is_terminal:  # logs: wide enough that the table's columns stay readable
        console = Console(width=200)
    report.render(result, tokens=cfg.train.steps * cfg.data.global_batch * cfg.data.seq_len,
                  console=console)


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
