"""The planner's memory against `meshtron rehearse`, one layout kind per row.

Each row rehearses the first rank of the planner's fullest stage of one plan (fake process
group and fake tensors: the runtime's own modules, shards, optimizer and step at the plan's
shapes, nothing allocated) and prints the rehearsed peak next to the planner's tensors
(`MemoryBreakdown.allocated`, CPU kernels), total and by category (rehearsal/planner, GiB).

Dense (default): tests/test_rehearse.py's table (a 2-layer Llama-shaped model, 6 layers for the
uneven interleaved row, vocabulary 32,000, hidden 2,048, 2 x 2,048 tokens per micro-batch, 8
ranks). `--moe`: tests/test_rehearse_moe.py's mixtures of experts (ep with ZeRO 0/1/3, ep+tp+sp,
ep+pp, recomputation; Mixtral-style softmax routing and DeepSeek-style sigmoid routing with a
shared expert and a dense first block; every MoE layer routes the mean T*k/E tokens per expert
and the rehearsed rank's experts 1.25x it, the planner's default `expert_imbalance`, on both
sides).

`--more`: tests/test_rehearse_kinds.py's HSDP, host offload (device memory: what FSDP2's
CPUOffloadPolicy keeps on the host left out), compile (rehearsed eagerly: torch.compile does
not trace under the memory tracker; the planner's eager figure compared) and torchao float8
kinds (vocabulary 512 for fp8, so that a block's backward, not the loss, holds the peak).

    python bench/rehearse_vs_planner.py [--moe | --more] [KIND ...]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def table(moe: bool, more: bool = False) -> tuple[dict, dict]:
    """(BASE knobs, {kind: (model fields, knobs)}) of the test module's table."""
    if moe:
        from test_rehearse_moe import BASE, KINDS

        return BASE, KINDS
    if more:
        from test_rehearse_kinds import BASE, KINDS, MODEL
    else:
        from test_rehearse import BASE, KINDS, MODEL

    kinds = {}
    for name, knobs in KINDS.items():  # a dense kind may set its own layers and vocabulary
        knobs = dict(knobs)
        shape = {k: knobs.pop(k) for k in ("layers", "vocab") if k in knobs}
        kinds[name] = (dict(MODEL, **shape), knobs)
    return BASE, kinds


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moe", action="store_true",
                   help="the mixture-of-experts table (tests/test_rehearse_moe.py), not the dense")
    p.add_argument("--more", action="store_true",
                   help="the HSDP, host offload, compile and fp8 kinds "
                        "(tests/test_rehearse_kinds.py)")
    p.add_argument("kinds", nargs="*", metavar="KIND",
                   help="rows to run (layout kinds of the chosen table); default: every row")
    return p.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)  # first: --help answers without importing the runtime (torch)
    from meshtron.model.spec import ModelSpec
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.plan import as_plan
    from meshtron.rehearse.run import rehearse

    moe = args.moe
    base, kinds = table(moe, args.more)
    names = args.kinds
    unknown = [n for n in names if n not in kinds]
    if unknown:
        print(f"rehearse_vs_planner: KIND {unknown[0]!r} is not a row of the "
              f"{'MoE' if moe else 'dense'} table; allowed: {'; '.join(kinds)}", file=sys.stderr)
        raise SystemExit(2)
    warnings.filterwarnings("ignore")
    print("| layout kind | rehearsal GiB | planner GiB | planner vs rehearsal | by category "
          "(rehearsal/planner) | wall |")
    print("|---|---|---|---|---|---|")
    for name in names or list(kinds):
        model, knobs = kinds[name]
        spec = ModelSpec(**model)
        plan = as_plan({**base, **knobs, "model": spec.name}).validate(8, spec)
        r = rehearse(spec, plan, resolve_cluster("dgx-h100:1"), "cpu")
        rows = {x["row"]: (x["rehearsal_gib"], x["planner_gib"]) for x in r["memory"]}
        got, want = rows.pop("total")
        cats = " ".join(f"{k} {a:.3f}/{b:.3f}" for k, (a, b) in rows.items())
        print(f"| {name} | {got:.3f} | {want:.3f} | {want / got - 1:+.1%} | {cats} | "
              f"{r['wall_s']:.1f} s |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
