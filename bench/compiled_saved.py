"""What one meshtron block saves for backward, eager against compiled per block (inductor), on
the CPU, beside the planner's figures for both stacks.

Each case builds one block, wraps it for recomputation and compiles it as `parallelize` does at
tp = 1 (testkit/block_saved.py `block_saves`: saved_tensors_hooks, one count per storage,
parameters and the RoPE table excluded) and prints its saved bytes eager (without
recomputation only: an eager checkpoint saves through hooks of its own, which hide the
block's from these) and compiled, the
planner's `activation_bytes` for the eager and the compiled stack (CPU kernels:
fused_norm=False, as the eager block here runs the composite RMSNorm), and with --list every
tensor the compiled block saves (shape, dtype). A byte count: the same on every run of the
same code and torch; compiling takes 5-15 s per case on a 2-core machine. Last, what the
partitioner saves around each SDPA kernel (testkit/block_saved.py `sdpa_saves`: the CUDA
kernels traced on the meta device), to show the compiled list does not depend on the device's
attention kernel.

    .venv/bin/python bench/compiled_saved.py                # the default cases
    .venv/bin/python bench/compiled_saved.py --list --cases llama-gqa/bf16/none
    .venv/bin/python bench/compiled_saved.py --tp       # and tp=2 on two gloo ranks
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MID = dict(name="mid", layers=2, hidden=1024, heads=8, kv_heads=4, ffn_hidden=2816, vocab=512,
           max_seq=4096)
SHAPES = {
    "llama-mha": dict(MID, kv_heads=8),
    "llama-gqa": MID,
    "llama-gqa-wide": dict(MID, hidden=2048, heads=16, kv_heads=2, ffn_hidden=5632),
    "gelu-layernorm": dict(MID, mlp="gelu", norm="layernorm", bias=True),
    "qwen3": dict(MID, head_size=256, qk_norm=True),
}
DEFAULT_CASES = [f"{s}/{d}/{r}" for s in ("llama-mha", "llama-gqa") for d in ("bf16", "fp32")
                 for r in ("none", "selective", "full")] + [
    "llama-gqa/bf16/none@256", "llama-gqa-wide/bf16/none", "gelu-layernorm/bf16/none",
    "qwen3/bf16/none", "llama-gqa/bf16/selective-torchtitan"]
"""shape/dtype/recompute[@seq]; recompute 'selective-torchtitan': torchtitan's op policy."""


def planned(spec, dtype: str, recompute: str, seq: int, stack: str, saved: str) -> float:
    from meshtron.planner.compute import KernelOptions
    from meshtron.planner.memory_acts import activation_bytes
    from meshtron.planner.memory_options import MemoryOptions

    mem = MemoryOptions(dtype=dtype, framework="fsdp2", fused_norm=False, activations=saved)
    return activation_bytes(spec, 1, False, 1, seq, recompute, KernelOptions(stack=stack), mem)


def run_case(case: str, show: bool) -> str:
    from meshtron.model.spec import ModelSpec
    from testkit.block_saved import block_saves

    name, dtype, rest = case.split("/")
    recompute, _, seq = rest.partition("@")
    seq = int(seq or 512)
    policy = "meshtron"
    saved_list = "eager"
    if recompute == "selective-torchtitan":
        recompute, policy, saved_list = "selective", "torchtitan", "alternate-matmul"
    spec = ModelSpec(**SHAPES[name])
    start = time.perf_counter()
    got = {c: block_saves(spec, dtype, recompute, c, seq=seq, policy=policy)
           for c in ((False, True) if recompute == "none" else (True,))}
    got.setdefault(False, [])
    took = time.perf_counter() - start
    eager, comp = (sum(s.nbytes for s in got[c]) for c in (False, True))
    plan_e, plan_c = (planned(spec, dtype, recompute, seq, st, saved_list)
                      for st in ("eager", "compiled"))
    # an eager checkpoint saves through its own hooks, which hide the block's from ours
    shown = f"{eager / 2**20:8.3f}" if recompute == "none" else "       -"
    line = (f"{case:38s} eager {shown} MiB  compiled {comp / 2**20:8.3f} MiB"
            f"  planner eager {plan_e / 2**20:8.3f}  compiled {plan_c / 2**20:8.3f} MiB"
            f"  ({took:.0f} s)")
    if show:
        line += "".join(f"\n    {s.shape} {s.dtype} {s.nbytes}" for s in got[True])
    return line


def run_tp_case(sp: bool) -> str:
    """The GQA block at tp = 2 (two gloo ranks, testkit/block_saved.py `tp_block_saves`):
    rank 0's saved bytes eager and compiled beside the planner's per-rank figures."""
    from meshtron.model.spec import ModelSpec
    from meshtron.planner.compute import KernelOptions
    from meshtron.planner.memory_acts import activation_bytes
    from meshtron.planner.memory_options import MemoryOptions
    from testkit.block_saved import tp_block_saves
    from testkit.multiproc import run_on_ranks

    fields = dict(SHAPES["llama-gqa"], layers=1)
    spec, mem = ModelSpec(**fields), MemoryOptions(fused_norm=False)
    got = {c: run_on_ranks(tp_block_saves, 2, fields, "bf16", sp, 512, c, timeout=900)[0]
           for c in (False, True)}
    plan = {c: activation_bytes(spec, 2, sp, 1, 512, "none", KernelOptions(stack=st), mem)
            for c, st in ((False, "eager"), (True, "compiled"))}
    return (f"{'llama-gqa/bf16/none tp=2 sp=' + ('on' if sp else 'off'):38s} eager "
            f"{got[False] / 2**20:8.3f} MiB  compiled {got[True] / 2**20:8.3f} MiB  planner eager "
            f"{plan[False] / 2**20:8.3f}  compiled {plan[True] / 2**20:8.3f} MiB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=DEFAULT_CASES)
    ap.add_argument("--list", action="store_true", help="every tensor the compiled block saves")
    ap.add_argument("--tp", action="store_true",
                    help="also the GQA block at tp=2 over 2 gloo ranks, sp off and on")
    args = ap.parse_args(argv)
    import torch

    from testkit.block_saved import hooks_see_compiled_saves

    print(f"torch {torch.__version__}; a compiled function's saves reach saved_tensors_hooks: "
          f"{hooks_see_compiled_saves()}")
    for case in args.cases:
        print(run_case(case, args.list), flush=True)
    if args.tp:
        for sp in (False, True):
            print(run_tp_case(sp), flush=True)
    from testkit.block_saved import SDPA_KERNELS, sdpa_saves

    print("SDPA kernels, projections + attention traced (CUDA kernels on meta), what the "
          "partitioner saves:")
    for kernel in SDPA_KERNELS:
        got = sdpa_saves(kernel)
        print(f"  {kernel:10s} {sum(s.nbytes for s in got):8d} bytes: "
              + ", ".join(f"{list(s.shape)} {s.dtype}" for s in got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
