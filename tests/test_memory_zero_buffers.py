"""The mixed-precision ZeRO frameworks' optimizer and gradient buffers as the stacks make them
(issue 30 session 41, branch mem405): Apex DistributedFusedAdam's master weights as NeMo sets
it up (MemoryOptions.master_weights), FSDP's gradient buffers made at a block's first backward
(MemoryOptions.grads_at_first_backward: the Llama 3 405B rows) and Megatron-Core's checkpointed
attention core under selective recomputation (memory_acts._korthikanti, estimate_pieces). Each
test differences two plans that differ in the one term."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec, preset
from meshtron.planner import memory
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.compute import KernelOptions
from meshtron.planner.estimate import Evaluator
from meshtron.planner.memory import MemoryOptions
from meshtron.planner.memory_states import layer_params_local
from meshtron.planner.plan import Plan

DENSE = ModelSpec(name="dense", layers=4, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                  vocab=32000, max_seq=8192)
TE = KernelOptions(stack="fused", sharding="zero", fp8_filter="all", fp8_scaling="te-current")
MEGATRON = MemoryOptions(dtype="bf16", framework="megatron")


@pytest.mark.parametrize("master, bf16_moments, optimizer_bytes", [
    ("fp32", False, 12.0),       # fp32 master + two fp32 moments (ZeRO's K)
    ("remainders", False, 10.0),  # Apex store_param_remainders: int16 + two fp32 moments
    ("none", True, 4.0),          # Apex dtype bf16, store_params False: two bf16 moments
    ("bf16", True, 6.0),          # Apex dtype bf16 with store_params (fp8_params): bf16 copy
])
def test_master_weights_set_the_optimizers_bytes_per_parameter(master, bf16_moments,
                                                               optimizer_bytes):
    mem = dataclasses.replace(MEGATRON, master_weights=master, bf16_moments=bf16_moments)
    w, g, o = memory.state_bytes(1, 8, 4.0, mem)
    assert (w, g) == (2.0, 4.0) and o == pytest.approx(optimizer_bytes / 8)


def test_master_weights_refused_where_not_priced():
    with pytest.raises(UserError, match=r"^memory.master_weights='half': allowed values are "
                                        r"fp32, bf16, remainders, none$"):
        MemoryOptions(framework="megatron", master_weights="half")
    with pytest.raises(UserError, match=r"^memory.master_weights='none': priced for the "):
        MemoryOptions(framework="fsdp2", master_weights="none")
    with pytest.raises(UserError, match=r"^memory.master_weights='none': the bf16 parameters "
                                        r"are the master weights only with bf16 moments"):
        MemoryOptions(framework="megatron", master_weights="none")  # fp32 moments: no stack
    with pytest.raises(UserError, match=r"^memory.master_weights='bf16': a bf16 master copy "):
        MemoryOptions(framework="megatron", master_weights="bf16")
    with pytest.raises(UserError, match=r"^memory.grads_at_first_backward=true: fsdp2 "):
        MemoryOptions(framework="fsdp2", grads_at_first_backward=True)


def _llama3_16k(first_backward: bool, zero: int = 1, stage: int | None = None):
    """The Llama 3 405B 16,384-GPU layout (bench/published/rows_pytorch.llama3): pp 16, 8
    one-layer chunks per rank, 16 micro-batches, fp32 gradients; `zero` 0 or 1."""
    opts = KernelOptions(stack="fused", sharding="zero", separate_projections=False,
                         fp32_grad_reduce=True)
    mem = dataclasses.replace(MEGATRON, pipeline_split="megatron-ends",
                              grads_at_first_backward=first_backward)
    plan = Plan(8, 16, 128, zero, 1, "none", True, "interleaved", 8)
    ev = Evaluator(preset("llama3-405b"), preset_cluster("dgx-h100", 2048), 2048, 8192,
                   opts=opts, mem=mem)
    return ev.evaluate(plan, stage=stage, keep_infeasible=True).memory


def test_gradients_made_at_the_first_backward_hold_one_chunks_at_the_peak():
    """With 16 micro-batches on 16 stages, pipeline rank 1 runs all 128 forwards of its eight
    one-layer chunks before its first backward (Megatron-Core's warm-up is the whole step):
    its peak holds every micro-batch's activations beside the gradients of the one chunk whose
    backward has begun, not all eight chunks' (the buffer Megatron-Core keeps over the step).
    The breakdown lists them as gradients either way; the difference is 7 layers x 4 bytes."""
    buffer, first = _llama3_16k(False), _llama3_16k(True)
    assert buffer.stage == first.stage == 1
    p_layer = layer_params_local(preset("llama3-405b"), 8)
    assert first.grads == pytest.approx(buffer.grads, rel=1e-12)
    saved = (buffer.allocated - first.allocated) * memory.GIB
    assert saved == pytest.approx(7 * 4.0 * p_layer, rel=1e-9)


def test_selective_recompute_drops_flashs_output_beside_tes_fp8_copy():
    """Megatron-Core's selective recomputation checkpoints the attention core (its inputs Q, K,
    V kept): FlashAttention's bf16 output is no longer kept, only the out-projection's copy of
    it, which under Transformer Engine's FP8 is its own 1-byte tensor (bf16: the same tensor,
    nothing saved)."""
    tokens, tp = 4096, 2
    q = DENSE.heads * DENSE.head_dim
    fp8 = dataclasses.replace(MEGATRON, dtype="fp8")
    args = (DENSE, tp, True, 1, tokens)
    dropped = (memory.activation_bytes(*args, "none", TE, fp8)
               - memory.activation_bytes(*args, "selective", TE, fp8))
    assert dropped == pytest.approx(tokens * 2.0 * q / tp, rel=1e-12)
    assert (memory.activation_bytes(*args, "selective", TE, MEGATRON)
            == memory.activation_bytes(*args, "none", TE, MEGATRON))


def test_selective_recompute_runs_the_flash_forward_again():
    """The checkpointed core's forward runs again in the backward: a selective plan of a
    Megatron-style stack costs one attention-core forward per layer and micro-batch more than
    the same plan without recomputation."""
    cluster = preset_cluster("dgx-h100", 1)
    ev = Evaluator(DENSE, cluster, 64, 4096, opts=TE, mem=MEGATRON)
    none, sel = (ev.evaluate(Plan(2, 1, 4, 1, 1, r, True, "1f1b", 1, dtype="bf16"),
                             keep_infeasible=True) for r in ("none", "selective"))
    lc = next(v for k, v in ev._cache.items()
              if isinstance(k, tuple) and k[0] == "layer" and k[4] == "selective")
    extra = sel.time.compute - none.time.compute
    assert lc.core_fwd > 0 and extra == pytest.approx(DENSE.layers * 16 * lc.core_fwd, rel=1e-6)


def test_gradients_made_at_the_first_backward_at_zero_0_too():
    """Without the distributed optimizer (ZeRO-0) the gradients are whole as well: the same
    walk, the same saving on the same rank."""
    buffer, first = _llama3_16k(False, zero=0, stage=1), _llama3_16k(True, zero=0, stage=1)
    p_layer = layer_params_local(preset("llama3-405b"), 8)
    assert (buffer.allocated - first.allocated) * memory.GIB == pytest.approx(
        7 * 4.0 * p_layer, rel=1e-9)
