"""The planner's memory breakdown against measurement, component by component.

1. Model states: for each layout, a real `meshtron train --nproc 4` run (gloo on CPU, NCCL on
   GPU) writes RUN_DIR/memory.json; its per-rank parameter, gradient and optimizer bytes are
   printed beside the planner's (meshtron/planner/memory_ranks.py) for the fullest rank, with
   the planner's other components (gathered copies, activations, logits, workspace). On CUDA the
   allocator's peak (torch.cuda.max_memory_allocated) is compared with the planner's allocated
   figure.
2. Activations per block: what autograd keeps after one block's forward on CPU (profiler
   allocation records) against memory.activation_bytes, for each recomputation mode.
3. Published peaks: torchtitan's Llama 3.1 8B FSDP figure, and the planner's verdict on the
   published layouts that must fit.

    .venv/bin/python bench/memory_vs_measured.py            # 4 layouts, about 2-3 min on 2 cores
    .venv/bin/python bench/memory_vs_measured.py --quick    # one layout
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from meshtron.model.spec import preset  # noqa: E402
from meshtron.planner import memory  # noqa: E402
from meshtron.planner.compute import KernelOptions  # noqa: E402
from meshtron.planner.memory_ranks import predict_ranks  # noqa: E402
from meshtron.planner.plan import Plan  # noqa: E402

LAYOUTS = [  # (flags, dtype)
    (["--plan", "tp=2,dp=2", "--zero", "1", "--sp", "on"], "fp32"),
    (["--plan", "dp=4", "--zero", "3"], "bf16"),
    (["--plan", "pp=2,dp=2", "--zero", "2", "--schedule", "1f1b", "--micro-batch", "2"], "fp32"),
    (["--plan", "tp=2,pp=2", "--zero", "0", "--schedule", "gpipe", "--micro-batch", "2"], "bf16"),
]
MIB = 2**20


def run_layout(flags: list[str], dtype: str, run_dir: Path) -> tuple[Plan, dict]:
    cmd = [sys.executable, "-m", "meshtron", "train", "--nproc", "4", *flags, "--model", "tiny",
           "--steps", "2", "--global-batch", "8", "--seq-len", "64", "--dtype", dtype,
           "--run-dir", str(run_dir)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, timeout=900)
    plan = Plan.from_toml((run_dir / "plan.toml").read_text())
    return plan, json.loads((run_dir / "memory.json").read_text())


def states_table(layouts) -> None:
    print("1. Model states per rank, meshtron runtime on 4 ranks (tiny model): planner vs "
          "memory.json, MiB (fullest rank)")
    print(f"{'layout':<34} {'dtype':<5} {'component':<12} {'predicted':>11} {'measured':>11} "
          f"{'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (flags, dtype) in enumerate(layouts):
            plan, mj = run_layout(flags, dtype, Path(tmp) / f"r{i}")
            ranks = predict_ranks(preset("tiny"), plan, dtype, 4.0)
            measured = mj["measured_bytes_per_rank"]
            worst = max(range(len(ranks)), key=lambda r: measured[r]["total"])
            state, bd = ranks[worst]
            name = (f"{plan.layout()} z{plan.zero} mb{plan.micro_batch}"
                    + (f" {plan.schedule}" if plan.pp > 1 else "") + (" sp" if plan.sp else ""))
            exact = all(measured[r][k] == getattr(ranks[r][0], k) for r in range(len(ranks))
                        for k in ("params", "grads", "optimizer"))
            for k in ("params", "grads", "optimizer"):
                p, m = getattr(state, k), measured[worst][k]
                print(f"{name:<34} {dtype:<5} {k:<12} {p / MIB:>11.4f} {m / MIB:>11.4f} "
                      f"{p / m:>7.4f}")
                name = ""
            for k in ("gathered", "activations", "in_flight", "recompute", "logits"):
                print(f"{'':<34} {'':<5} {k:<12} {getattr(bd, k) * 1024:>11.4f} "
                      f"{'(GPU only)':>11}")
            peak = measured[worst].get("cuda_peak_allocated")
            print(f"{'':<34} {'':<5} {'allocated':<12} {bd.allocated * 1024:>11.4f} "
                  f"{(f'{peak / MIB:.4f}' if peak else '(GPU only)'):>11}"
                  + (f" {bd.allocated * 2**30 / peak:>7.4f}" if peak else ""))
            print(f"{'':<34} {'':<5} {'all ranks exact (params/grads/optimizer)':<40} {exact}")


def activations_table() -> None:
    from test_memory import _measured_block_bytes

    print("\n2. Activations kept by one block after forward (batch 2 x 64 tokens, CPU autograd), "
          "KiB")
    print(f"{'model':<9} {'dtype':<5} {'recompute':<10} {'predicted':>10} {'measured':>10} "
          f"{'ratio':>7}")
    for name in ("tiny", "tiny-gpt"):
        for dtype in ("fp32", "bf16"):
            mem = memory.MemoryOptions(dtype=dtype, fused_norm=False)
            for rec in ("none", "selective", "full"):
                m = _measured_block_bytes(preset(name), dtype, rec, 2, 64)
                p = memory.activation_bytes(preset(name), 1, False, 2, 64, rec, KernelOptions(),
                                            mem)
                print(f"{name:<9} {dtype:<5} {rec:<10} {p / 1024:>10.1f} {m / 1024:>10.1f} "
                      f"{p / m:>7.4f}")


TORCHTITAN_8B_PEAK_GIB = 82.4
"""torchtitan benchmarks/llama3_h100_202412_torchtitan.md (docs/performance.md), Table 1: Llama
3.1 8B, 8 H100 96GB (Grand Teton), FSDP (eager, no torch.compile), local batch 2, sequence
8192, selective op activation checkpointing: peak memory 82.4 GiB (max reserved,
torchtitan/metrics.py device_memory_monitor, so the caching allocator's cache included)."""


def torchtitan_8b_row():
    """The Evaluator and plan of that run, with the stack's own inputs: torchtitan's kernels
    (bench/published/stacks.py TORCHTITAN_EAGER) and its memory layout as the command line's
    torchtitan preset states it (meshtron/planner/frameworks.py): the selective "op" policy's
    saved list (alternate-matmul), `repeat_kv` copies, and the eager fp32 loss over whole
    logits (train.py of December 2024 leaves `torch.compile(loss_fn)` commented out; the
    default loss, meshtron's own chunked one, never holds them: 20.7 GiB less here)."""
    import dataclasses

    from bench.published.stacks import TORCHTITAN_EAGER
    from meshtron.planner.cluster import preset_cluster
    from meshtron.planner.estimate import Evaluator

    cl = dataclasses.replace(preset_cluster("dgx-h100", 1), memory_gib=95.0)
    mem = memory.MemoryOptions(framework="fsdp2", activations="alternate-matmul",
                               loss="eager", gqa_copies=True)
    ev = Evaluator(preset("llama3-8b"), cl, 16, 8192, TORCHTITAN_EAGER, mem=mem)
    return ev, Plan.trusted(1, 1, 8, 3, 2, "selective", False, None, dtype="bf16")


def published_table() -> None:
    from meshtron.planner.estimate import Evaluator

    print("\n3. Published runs (GiB per GPU)")
    print(f"{'run':<44} {'predicted':>9} {'published':>9} {'capacity':>8}  fits  breakdown")
    rows = []
    from meshtron.planner.cluster import preset_cluster

    ev, plan = torchtitan_8b_row()
    rows.append(("torchtitan Llama3.1-8B FSDP eager 8xH100-96GB", ev.evaluate(plan),
                 f"{TORCHTITAN_8B_PEAK_GIB:.1f}"))
    ev = Evaluator(preset("llama3-405b"), preset_cluster("dgx-h100", 1024), 2048, 8192,
                   KernelOptions(fp32_grad_reduce=True),
                   mem=memory.MemoryOptions(framework="megatron"))
    rows.append(("Llama3 405B tp8 pp16 dp64 ZeRO-2 H100-80GB",
                 ev.evaluate(Plan.trusted(8, 16, 64, 2, 1, "none", True, "1f1b", dtype="bf16")), "ran"))
    from bench.published.table import gpt_model

    ev = Evaluator(gpt_model("gpt-530B", 105, 20480, 128, tied=False),
                   preset_cluster("dgx-a100", 80), 2560, 2048,
                   KernelOptions(attention="unfused", dropout=True),
                   mem=memory.MemoryOptions(framework="deepspeed"))
    rows.append(("530B DeepSpeed ZeRO-3 640xA100-80GB mb4",
                 ev.evaluate(Plan.trusted(1, 1, 640, 3, 4, "full", False, None, dtype="bf16")), "ran"))
    for name, est, pub in rows:
        m = est.memory
        parts = " ".join(f"{k}={getattr(m, k):.1f}" for k in (
            "params", "grads", "optimizer", "gathered", "activations", "in_flight", "recompute",
            "logits", "workspace"))
        print(f"{name:<44} {m.total:>9.1f} {pub:>9} {m.capacity:>8.0f}  {str(est.fits):<5} "
              f"{parts}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="model states for the first layout only (one training run, not all)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    states_table(LAYOUTS[:1] if args.quick else LAYOUTS)
    activations_table()
    published_table()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
