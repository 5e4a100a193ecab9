"""A block compiled per block saves what the planner's compiled stack counts (memory_saved.py
`compiled_none`, memory_acts.py's compiled selective lists), measured on the block the runtime
compiles (testkit/block_saved.py: inductor on the CPU, saved_tensors_hooks, one count per
storage), and `meshtron plan --stack compiled` prices less activation memory than eager.
The whole sweep (MHA, GQA, fp32, a wider block, GeLU + LayerNorm, Qwen3's q/k norms):
bench/compiled_saved.py, docs/measurements.md#compiled-activations."""

from __future__ import annotations

import json

import pytest

from testkit.cli_inproc import meshtron_main

SMALL = dict(name="small-gqa", layers=1, hidden=256, heads=4, kv_heads=2, ffn_hidden=704,
             vocab=512, max_seq=1024)
"""Llama-shaped (SwiGLU, RMSNorm, RoPE) with grouped-query attention; one compile of a few
seconds."""
SEQ = 128


def _planned(spec, recompute: str, stack: str, fused_norm: bool = False,
             saved: str | None = None) -> float:
    from meshtron.planner.compute import KernelOptions
    from meshtron.planner.memory_acts import activation_bytes
    from meshtron.planner.memory_options import MemoryOptions

    mem = MemoryOptions(dtype="bf16", framework="fsdp2", fused_norm=fused_norm,
                        activations=saved)
    return activation_bytes(spec, 1, False, 1, SEQ, recompute, KernelOptions(stack=stack), mem)


def test_compiled_block_saves_what_the_planner_counts():
    """Compiled, recompute none: the saved bytes are the planner's compiled figure (a byte
    count of the partitioner's choice: equal on torch 2.13; 1% allows a statistic's dtype to
    move), and they are what a GPU's eager block saves less one [tokens, ffn] tensor and one
    RoPE cast pair (the planner's eager figure with the fused norm is further off than 1%, so
    the test fails if the compiled stack were priced as eager). That compiled saves reach
    saved_tensors_hooks at all is this count's premise: were they missed, it would be a few
    KiB and fail."""
    pytest.importorskip("torch")
    from meshtron.model.spec import ModelSpec
    from testkit.block_saved import block_saves

    spec = ModelSpec(**SMALL)
    got = sum(s.nbytes for s in block_saves(spec, "bf16", "none", True, seq=SEQ))
    assert got == pytest.approx(_planned(spec, "none", "compiled"), rel=0.01)
    eager_gpu = _planned(spec, "none", "eager", fused_norm=True)
    assert got < 0.97 * eager_gpu
    # and the compiled figure does not depend on the CPU's composite norm
    assert _planned(spec, "none", "compiled") == _planned(spec, "none", "compiled", True)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["meshtron", "torchtitan"])
def test_compiled_selective_block_saves_what_the_planner_counts(policy):
    """Compiled with the selective policy traced into the graph (tp = 1): meshtron's policy
    and torchtitan's op policy ('alternate-matmul') keep one [tokens, hidden] fewer than eager
    (w2's output, which the backward does not read); the RNG state (5056 bytes) where the
    compiled block saves it."""
    pytest.importorskip("torch")
    from meshtron.model.spec import ModelSpec
    from testkit.block_saved import block_saves

    spec = ModelSpec(**SMALL)
    got = sum(s.nbytes for s in block_saves(spec, "bf16", "selective", True, seq=SEQ,
                                            policy=policy))
    saved = "alternate-matmul" if policy == "torchtitan" else "eager"
    assert got == pytest.approx(_planned(spec, "selective", "compiled", saved=saved), abs=5056)


def test_plan_prices_less_activation_memory_compiled():
    """The user's path: `meshtron plan --stack compiled` against `--stack eager`, llama3-8b,
    one pinned layout without recomputation: 32 layers x 8192 tokens x (2 x 14336 bytes of
    the SiLU output + the RoPE casts' half) fewer, 7.125 GiB of 37.8."""
    got = {}
    for stack in ("eager", "compiled"):
        rc, out, err = meshtron_main(
            "plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "8",
            "--seq-len", "8192", "--stack", stack, "--layout", "tp=1,dp=8", "--zero", "3",
            "--recompute", "none", "--micro-batch", "1", "--json")
        assert rc == 0, err
        got[stack] = json.loads(out)["plans"][0]["memory_gib"]["activations"]
    saved = 32 * 8192 * (2.0 * 14336 + 2 * 2 * 128) / 2**30
    assert got["eager"] - got["compiled"] == pytest.approx(saved, rel=1e-6)


def test_cuda_sdpa_kernels_save_what_the_cpu_kernel_saves():
    """The compiled list measured on the CPU holds on a GPU as far as attention goes: around
    each CUDA SDPA kernel (flash, memory-efficient, cuDNN; traced on the meta device) the
    partitioner saves the block's input, Q, K, V, the output and an fp32 log-sum-exp per head
    and row, as around the CPU's flash kernel; flash adds its 16-byte RNG state."""
    pytest.importorskip("torch")
    from testkit.block_saved import SDPA_KERNELS, sdpa_saves

    cpu = sdpa_saves("cpu")
    assert len(cpu) == 6 and sum(s.dtype == "float32" for s in cpu) == 1
    for kernel in SDPA_KERNELS[:3]:
        got = sdpa_saves(kernel)
        assert sum(s.nbytes for s in got) - sum(s.nbytes for s in cpu) in (0, 16), kernel


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_compiled_tensor_parallel_block_saves_what_the_planner_counts(sp):
    """tp = 2 on two gloo ranks, compiled as the runtime compiles a tensor-parallel block
    (DTensor plans applied, then compile; no recomputation): each rank saves the planner's
    per-rank compiled figure less RoPE's two casts, which the tensor-parallel graph does not
    keep (its partitioner saves the model's fp32 RoPE table, a graph input the model holds
    anyway, where the tp = 1 graph keeps the casts: measured, mid GQA block, 512 tokens, sp
    off and on: 0.25 MiB of 9.9 and 8.9 MiB). The planner keeps them: conservative."""
    pytest.importorskip("torch")
    from meshtron.model.spec import ModelSpec
    from meshtron.planner.compute import KernelOptions
    from meshtron.planner.memory_acts import activation_bytes, rope_copy_bytes
    from meshtron.planner.memory_options import MemoryOptions
    from testkit.block_saved import tp_block_saves
    from testkit.multiproc import run_on_ranks

    spec, mem = ModelSpec(**SMALL), MemoryOptions(dtype="bf16", fused_norm=False)
    got = run_on_ranks(tp_block_saves, 2, SMALL, "bf16", sp, SEQ, True, timeout=600)
    planned = activation_bytes(spec, 2, sp, 1, SEQ, "none", KernelOptions(stack="compiled"),
                               mem)
    assert got[0] == got[1] == planned - rope_copy_bytes(spec, SEQ, mem, "compiled")


@pytest.mark.parametrize("saved", [None, "alternate-matmul"])
def test_compiled_selective_under_tensor_parallelism_keeps_eagers_list(saved):
    """w2's output is left out of a compiled selective block at tp = 1, where it was measured
    (test above); under tensor parallelism it was not measured (the tp = 2 graph keeps other
    tensors than tp = 1's), so the planner keeps eager's list there: never an unmeasured
    saving."""
    from meshtron.model.spec import ModelSpec
    from meshtron.planner.compute import KernelOptions
    from meshtron.planner.memory_acts import activation_bytes
    from meshtron.planner.memory_options import MemoryOptions

    spec = ModelSpec(**SMALL)
    mem = MemoryOptions(dtype="bf16", framework="fsdp2", activations=saved)

    def planned(tp: int, stack: str) -> float:
        return activation_bytes(spec, tp, True, 1, SEQ, "selective", KernelOptions(stack=stack),
                                mem)

    assert planned(2, "compiled") == planned(2, "eager")
    assert planned(1, "compiled") == planned(1, "eager") - 2 * SEQ * spec.hidden
