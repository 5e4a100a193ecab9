"""A block's own backward temporaries (planner/memory_bwd.py) and the last block's prefetch
(planner/memory_peak.py), torch-free. The end-to-end check is the rehearsal table
(tests/test_rehearse_kinds.py, the vocabulary-512 rows)."""

from __future__ import annotations

from meshtron.model.spec import ModelSpec
from meshtron.planner.compute import KernelOptions
from meshtron.planner.memory_bwd import _moments, block_backward_bytes
from meshtron.planner.memory_options import MemoryOptions
from meshtron.planner.memory_peak import block_moment

MIB = 2.0**20
MID = ModelSpec(name="mid", layers=2, hidden=2048, heads=16, kv_heads=4, ffn_hidden=5632,
                vocab=512, max_seq=4096)
CPU = MemoryOptions(dtype="bf16", framework="fsdp2", fused_norm=False)


def test_gate_product_moment_is_the_tensors_rehearsed_there():
    """`meshtron rehearse` of 'mid' (2 x 2048 tokens, bf16, ZeRO-3, vocabulary 512) peaks in
    the last block's `mul` backward with, beyond the saved activations: the block's output
    gradient [4096, 2048] (16 MiB), w2's input gradient and the two products' gradients
    ([4096, 5632], 44 MiB each), w2's saved input freed (44 MiB) and of the unit's 86 MiB
    bf16 gradient only w2's 22 MiB made (the 64 MiB of wq, wk, wv, wo, w1, w3 not yet)."""
    got = block_backward_bytes(MID, 1, False, 2, 2048, "none", KernelOptions(), CPU)
    assert got == (16 + 3 * 44 - 44 - 64) * MIB
    # Megatron-LM's gradients land in main_grad (the states'): no unit gradient to subtract;
    # its fused kernels are not walked (not rehearsed): nothing
    megatron = MemoryOptions(dtype="bf16", framework="megatron")
    assert block_backward_bytes(MID, 1, False, 2, 2048, "none", KernelOptions(), megatron) == 0


def test_selective_keeps_the_down_projections_cached_output():
    """meshtron's selective policy caches w2's output, which checkpoint's early stop never
    replays: one more [tokens, hidden] than without recomputation (rehearsed: 16 MiB)."""
    args = (MID, 1, False, 2, 2048)
    none = block_backward_bytes(*args, "none", KernelOptions(), CPU)
    selective = block_backward_bytes(*args, "selective", KernelOptions(), CPU)
    assert selective - none == 16 * MIB


def test_the_gpus_flash_backward_workspace_is_priced_only_with_the_gpus_kernels():
    """Where attention's backward is the fullest moment (a narrow MLP), FlashAttention-2's
    fp32 dq accumulator and the GQA-expanded dk and dv ([tokens, heads x head_dim] each) are
    held on a GPU, not by the CPU kernel a fake-tensor rehearsal runs."""
    narrow = MID.replace(ffn_hidden=512, norm="layernorm")  # no composite-norm difference
    gpu_kernels = MemoryOptions(dtype="bf16", framework="fsdp2")
    args = (narrow, 1, False, 2, 2048, "none", KernelOptions())
    cpu = block_backward_bytes(*args, CPU)
    gpu = block_backward_bytes(*args, gpu_kernels)
    assert gpu > cpu
    # attention's moment (the third of the walk): per token, the fp32 dq accumulator and the
    # bf16 dk and dv expanded to every query head
    (cpu_held, cpu_unmade), (gpu_held, gpu_unmade) = (
        _moments(narrow, 1, False, "none", KernelOptions(), m, 2048)[2]
        for m in (CPU, gpu_kernels))
    q = narrow.heads * narrow.head_dim
    assert cpu_unmade == gpu_unmade and gpu_held - cpu_held == 4.0 * q + 2 * 2.0 * q
    # native GQA off (K and V copied to every head before attention): nothing to expand
    copies = MemoryOptions(dtype="bf16", framework="fsdp2", gqa_copies=True)
    held, _ = _moments(narrow, 1, False, "none", KernelOptions(), copies, 2048)[2]
    assert held - gpu_held == 2.0 * 2 * (q - narrow.kv_dim) - 2 * 2.0 * q


def test_the_last_block_in_backward_order_prefetches_the_root_unit():
    """Of two blocks the later in backward order gathers the embedding's unit, not a block
    (rehearsed: 2 MiB at vocabulary 512 beside the previous block's fp32 gradient); of
    three, a middle block prefetches the next block."""
    mem = MemoryOptions(dtype="bf16", framework="fsdp2")
    p_layer, unit, act = 45e6, 1e6, 16 * MIB

    def moment(layers):
        return block_moment(mem, 3, 8, layers, p_layer, 2 * unit, p_layer, 2.0, False,
                            unit, 4.0, act)

    assert moment(3) - moment(2) == 2.0 * (p_layer - unit)
    assert moment(2) == 2.0 * (2 * p_layer + unit) + 4.0 * p_layer - act


def test_few_tokens_peak_at_the_blocks_last_op_with_every_gradient_made():
    """With few tokens per micro-batch the unit gradient outweighs the temporaries: the
    fullest moment is the block's last op (every weight gradient made, the saved tensors
    but the attention norm's freed), not the gate product, which has 3/4 of the unit's
    gradient still to make."""
    got = block_backward_bytes(MID, 1, False, 1, 128, "none", KernelOptions(), CPU)
    moments = _moments(MID, 1, False, "none", KernelOptions(), CPU, 128)
    end_held, end_unmade = moments[-1]
    gate_held, gate_unmade = moments[0]
    assert end_unmade == 0 and got == 128 * end_held
    assert got > 128 * gate_held - 2.0 * gate_unmade
