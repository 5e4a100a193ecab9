"""`meshtron plan`: search the hybrid-parallel plans for a model on a cluster.

    meshtron plan --model llama3-70b --cluster dgx-h100:16 --global-batch 1024 --seq-len 8192
    meshtron plan --model llama3-405b --cluster dgx-h100:2048 --global-batch 2048 --seq-len 8192 \\
        --layout tp=8,pp=16 --zero 1 --schedule interleaved:2 --json
    meshtron plan --model tiny --cluster cpu.toml --global-batch 64 --seq-len 256 --save plan.toml

Exit status: 0 with a plan; 2 for a user error or when nothing fits (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from meshtron.argtypes import output_file, positive_int
from meshtron.errors import UserError

DEFAULT_TOKENS_PER_STEP = 4 * 2**20  # ~4M tokens, typical LLM pre-training batch


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="find the fastest hybrid-parallel plan that fits, and explain it",
        description="Search data x tensor x pipeline layouts, ZeRO stage, micro-batch, "
                    "recomputation, sequence parallelism and pipeline schedule with a memory, "
                    "compute and communication cost model.")
    p.add_argument("--model", required=True,
                   help="preset name, Hugging Face config.json path, or TOML file with a model key")
    p.add_argument("--cluster", required=True,
                   help="dgx-a100:N, dgx-h100:N, dgx-h200:N (N nodes of 8 GPUs) or a cluster TOML")
    p.add_argument("--global-batch", type=positive_int, default=None,
                   help="sequences per step (default: about 4M tokens' worth)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="tokens per sequence (default: the model's max_seq)")
    p.add_argument("--tokens", default="1T",
                   help="training budget in tokens for days / GPU-hours, e.g. 15T, 300B, 2e12")
    p.add_argument("--top", type=positive_int, default=5, help="plans to show (default 5)")
    p.add_argument("--layout", help="fix any of tp, pp, dp: e.g. tp=8,pp=16,dp=64")
    p.add_argument("--zero", type=int, help="fix the ZeRO stage (0-3)")
    p.add_argument("--recompute", help="fix recomputation: none | selective | full")
    p.add_argument("--sp", help="fix sequence parallelism: on | off")
    p.add_argument("--micro-batch", type=positive_int, help="fix the micro-batch size (sequences)")
    p.add_argument("--schedule", help="fix the pipeline schedule: 1f1b | interleaved[:V] | zb | gpipe")
    p.add_argument("--attention", default="flash",
                   help="attention kernel the cost model assumes: flash (default) | unfused")
    p.add_argument("--dropout", action="store_true",
                   help="model dropout kernels (GPT-2/3-era training; modern LLMs use none)")
    p.add_argument("--json", action="store_true", help="print JSON (schema in planner/report.py)")
    p.add_argument("--save", metavar="PLAN.toml", type=output_file, help="write the best plan for `meshtron train`")
    p.set_defaults(func=run)


def parse_tokens(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMbBtT]?)\s*", str(text))
    if not m:
        raise UserError(f"tokens={text!r}: expected a number like 2e12, 300B or 15T")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    value = float(m.group(1)) * scale
    if value <= 0:
        raise UserError(f"tokens={text!r}: must be positive")
    return value


def load_model(text: str):
    from meshtron.model.spec import resolve_model

    if text.endswith(".toml"):
        from meshtron.config import (  # the foundation's TOML model form
            load_toml,
            model_from_value,
        )

        doc = load_toml(text, field="model")
        if "model" not in doc:
            raise UserError(f"model={text!r}: the TOML file has no 'model' key or [model] table")
        return model_from_value(doc["model"])
    return resolve_model(text)


def collect_knobs(args: argparse.Namespace) -> dict[str, Any]:
    from meshtron.planner.plan import fixed_knobs

    return fixed_knobs(args.layout, args.zero, args.recompute, args.sp, args.micro_batch,
                       args.schedule)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from meshtron.planner import report
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.compute import KernelOptions
    from meshtron.planner.search import search_plans

    model = load_model(args.model)
    cluster = resolve_cluster(args.cluster)
    tokens = parse_tokens(args.tokens)
    if args.top <= 0:
        raise UserError(f"top={args.top}: must be a positive integer")
    seq = args.seq_len if args.seq_len is not None else model.max_seq
    if seq <= 0:
        raise UserError(f"seq-len={seq}: must be a positive integer")
    if seq > model.max_seq:
        raise UserError(f"seq-len={seq}: exceeds the model's max_seq={model.max_seq}")
    batch = args.global_batch
    if batch is None:
        batch = 1 << max(0, (DEFAULT_TOKENS_PER_STEP // seq).bit_length() - 1)
    if batch <= 0:
        raise UserError(f"global-batch={batch}: must be a positive integer")
    opts = KernelOptions(attention=args.attention, dropout=args.dropout)
    result = search_plans(model, cluster, batch, seq, collect_knobs(args), top_k=args.top,
                          options=opts)
    console = Console(stderr=False, width=200 if not sys.stdout.isatty() else None)
    if args.json:
        print(json.dumps(report.to_json(result, tokens), indent=2))
    else:
        report.render(result, tokens, console)
    if not result.fits:
        line = report.render_no_fit(result, Console(file=sys.stderr if args.json else sys.stdout,
                                                     width=200))
        raise UserError(line)
    if args.save:
        plan = result.best.to_plan(args.model, args.cluster, cluster.num_gpus, batch, seq,
                                   args.attention)
        plan.save(args.save)
        if not args.json:
            console.print(f"Saved the best plan to {args.save}")
    return 0
