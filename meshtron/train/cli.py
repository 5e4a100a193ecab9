"""`meshtron train` and `meshtron demo`."""

from __future__ import annotations

import argparse
import ast
from typing import Any

from meshtron.config import apply_overrides, config_from_dict, load_toml

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


def cmd_train(args: argparse.Namespace) -> int:
    cfg = run_config_from_args(args)
    from meshtron.train.loop import train

    result = train(cfg)
    _print_result(cfg, result)
    return 0


# The demo: the default model on the embedded corpus, sized to take about three minutes on a
# 2-core machine.
DEMO_CONFIG: dict[str, Any] = {
    "model": "tiny",
    "data": {"source": "stdlib", "seq_len": 256, "global_batch": 16},
    "optim": {"lr": 3e-3, "warmup_steps": 20},
    "train": {"steps": 300, "eval_every": 50, "run_dir": "runs/demo"},
}


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = run_config_from_args(args, defaults=DEMO_CONFIG)
    from meshtron.train.loop import train

    result = train(cfg)
    _print_result(cfg, result)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model (single process)",
                       description="Train a model. Configure with --config RUN.toml and/or flags.")
    add_run_arguments(p)
    p.set_defaults(func=cmd_train)
    d = sub.add_parser("demo", help="the main job on the embedded default (no downloads)",
                       description="Train the tiny model on the Python standard library's sources.")
    add_run_arguments(d)
    d.set_defaults(func=cmd_demo)
