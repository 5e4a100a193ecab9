"""The software stacks of the published runs, as the planner's KernelOptions (kernels, overlap,
collectives, optimizer) and MemoryOptions (what each framework keeps in memory). Each bundle
states the stack as its source and code of the time had it; the row modules
(`rows_megatron.py`, `rows_pytorch.py`, `rows_moe.py`) pick one per row. A stack a user can
name (`meshtron plan --framework NAME[@ERA]`, planner/frameworks.py) is taken from that preset,
with the per-run settings as the [options] a user would write (`from_preset`), so the rows
price what the command line prices (tests/test_framework_names.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtron.planner.compute import KernelOptions
from meshtron.planner.frameworks import PRESETS, Framework, with_options
from meshtron.planner.memory import MemoryOptions


def from_preset(name: str, **options: Any) -> Framework:
    """The preset NAME@ERA with single options as an [options] table would set them."""
    return with_options(PRESETS[name], options) if options else PRESETS[name]


MEGATRON_2021 = KernelOptions(attention="unfused", dropout=True, overlap_grad_reduce=False,
                              separate_projections=False,
                              fp32_grad_reduce=True, stack="fused", sharding="zero")
"""Megatron-LM 2021-2022: fused kernels, materialised attention scores with dropout, fp32
main_grad reduced after the backward pass."""
MEGATRON_2022 = dataclasses.replace(MEGATRON_2021, grad_accum_fusion=True, megatron_linear=True)
"""Megatron-LM of K22 (spring 2022, the sequence-parallel and selective-recompute commits):
gradient accumulation fusion (Feb 2022, commit 83b1e42f30, on unless
--no-gradient-accumulation-fusion) adds each micro-batch's weight gradient to main_grad in the
wgrad GEMM; its LinearWithGradAccumulationAndAsyncCommunication reduces the input gradient beside
the weight-gradient GEMM and re-gathers the sequence-parallel input beside the input-gradient
GEMM (the async tensor-parallel all-reduce of late 2021 and K22's section 4.2.2)."""
DEEPSPEED_PIPE_2021 = PRESETS["deepspeed@2021"].kernel
"""Megatron-DeepSpeed (MT-NLG), the deepspeed@2021 preset (`--framework megatron-deepspeed`; its
ZeRO-3 fields change nothing under the pipeline engine's ZeRO-1): Megatron's fused kernels,
DeepSpeed's pipeline engine, which splits the activation it sends over the tensor group
(runtime/pipe/engine.py is_pipe_partitioned = is_model_parallel, v0.3.15 on) and, before v0.5.4
(microsoft/DeepSpeed #1407), sends the gradient whole (is_grad_partitioned = False; MT-NLG's
DeepSpeed version is not published: the older engine assumed), and under ZeRO-1 all-reduces the
gradients (`_exec_reduce_grads`: buffered_allreduce_fallback until v0.3.16, zero1_all_reduce).
BLOOM's stack: rows_megatron.BLOOM_STACK."""
MEGATRON_DEEPSPEED_MEMORY = PRESETS["deepspeed@2021"].memory
"""Megatron-DeepSpeed's memory layout, the deepspeed@2021 preset's (16-bit weights and DeepSpeed's
ZeRO: framework 'deepspeed', whose own terms, ZeRO-2's buckets, do not arise at the rows' ZeRO-1;
'megatron' before this preset, the same bytes there) and its layer split: GPTModelPipe builds
DeepSpeed's PipelineModule with partition_method='type:transformer' (GPT-NeoX:
'type:transformer|mlp'), DeepSpeed's balanced split over the blocks alone (BLOOM ran
'type:transformer|embedding', [embedding + 5, 6 x 10, 5 + tied head], which no pipeline_split
states: its first stage is charged 6 blocks and the embedding); its ZeRO is DeepSpeed's
(zero_optimization in the DeepSpeed config), at most stage 1 in the pipeline engine
(plan_rules_zero.PIPELINE_MAX), not Megatron-LM 2021's replicated optimizer."""
DEEPSPEED_ZERO3_2021 = KernelOptions(attention="unfused", dropout=True, fp32_grad_reduce=False,
                                     separate_projections=False,
                                     overlap_grad_reduce=False, stack="fused", sharding="zero",
                                     shard_units_per_layer=4, reduce_units_per_layer=12,
                                     prefetch_params=5e7, max_live_params=1e9, live_embedding=True,
                                     recompute_regathers=True, list_collectives=True)
"""DeepSpeed ZeRO-3 as of N21 (v0.3.15, April 2021; deepspeed/runtime/zero/stage3.py,
partition_parameters.py and constants.py at that version). Gathers: `fetch_sub_module` gathers
each parameter of a submodule with its own `_allgather_param` call, each after a
torch.cuda.synchronize(), then synchronizes again; parameters below
`stage3_param_persistence_threshold` (default 1e5 elements: biases and norms) stay gathered, so a
GPT layer gathers its four weight matrices (shard_units_per_layer=4). Right after each fetch,
`prefetch_next_sub_modules` gathers the next weight (`stage3_prefetch_bucket_size` 5e7 admits it
whole) on the fetch stream (overlap_comm, on by default for stage 3), beside the submodule's
compute, unless the coordinator already holds `stage3_max_live_parameters` (1e9) gathered
elements (prefetch_params, max_live_params). Those include the tied word embedding, which
Megatron's GPT2Model registers as an external parameter of the top module and which therefore
stays gathered over the whole step (live_embedding; 175B: 6.3e8, 530B: 1.05e9 elements): with it
a 175B GPT's average weight (4.5e8) reaches the limit, and a 530B GPT never prefetches. Reductions:
every parameter's gradient is reduce-scattered by its own call (`_reduce_scatter_gradients`, 12
per GPT layer with biases); ZeRO-3's overlap_comm defaults to on, but the device-wide
synchronisation of the next fetch waits for it, so it is costed as not overlapped. Parameters
are released after every forward, so the recomputed forward gathers them again. Every call goes
through list-based collectives: zero-filled gather buffers, PyTorch 1.8's per-chunk staging
copies and a Python loop over the ranks (list_collectives; estimate.LIST_HOST_S_PER_RANK)."""
TORCHTITAN_MEMORY = dataclasses.replace(PRESETS["torchtitan@2024"].memory, activations=None)
"""The torchtitan@2024 preset's memory (FSDP2, its ZeRO and offload rules, repeat_kv copies) with
the saved-tensor list left to the row's recomputation: the Python path prices the TT24 'selective'
rows as every other layer recomputed on the eager list, where the command line runs the op-policy
rows as `--recompute selective` on the preset's 'alternate-matmul' list (bench/planner_cli_table.py
`_recompute`). torchtitan's loss, eager in both stacks: train.py of December 2024 leaves
`torch.compile(loss_fn)` commented out ("compiling loss function causes CUDA errors"), so the
logits are cast to fp32 whole and log_softmax's output is saved (memory_acts.py, 12 bytes per
logit), and no head replay is priced (that is meshtron's chunked loss, the fsdp2 default). The
command line's torchtitan preset states the same loss; without it here the Python path of the table
priced these rows with meshtron's chunked loss."""
LLM_FOUNDRY_MEMORY = PRESETS["llm-foundry@2024"].memory
"""llm-foundry's MPT: FSDP with fp32 sharded parameters, and flash-attn's fused cross-entropy
(its default `loss_fn: fused_crossentropy`) at flash-attn's default inplace_backward=False: its
backward writes a new 16-bit gradient beside the logits (MemoryOptions loss 'flash-ce')."""
DEEPSPEED_MEMORY = MemoryOptions(framework="deepspeed")
"""DeepSpeed ZeRO: 16-bit weights, fp32 master weights and moments in the optimizer, ZeRO-3
gathering per submodule under stage3_max_live_parameters."""
TORCHTITAN_EAGER = PRESETS["torchtitan@2024"].kernel
"""torchtitan@2024 (FSDP2 without torch.compile): bf16 parameters, fp32 gradient reduce-scatter;
foreach AdamW (torchtitan/optimizer.py of December 2024: `--optimizer.fused` off by default,
fused became the default in February 2025, #881); its own Python RMSNorm (norms.py, until the
switch to torch.nn.RMSNorm in March 2025, #985). RoPE: models/llama/model.py
`apply_rotary_emb` multiplies complex numbers (complex_rope); K/V are repeated per query head
(`repeat_kv`, the rows' gqa_copies); context parallelism is torch's ring attention
(torch_ring) overlapping each K/V exchange with attention (cp_overlap, the 2025 preset's; the
eager rows have no context parallelism)."""
TORCHTITAN_COMPILED = from_preset("torchtitan@2024", stack="compiled").kernel
"""torchtitan@2024 with `stack = "compiled"` (its `--compile.enable`: per-block compilation fuses
the memory-bound ops of each TransformerBlock; train.py of December 2024 leaves
`torch.compile(loss_fn)` commented out, so the final norm, head and loss stay eager; foreach AdamW
as above)."""
LLM_FOUNDRY_AMP = PRESETS["llm-foundry@2024"].kernel
"""llm-foundry, amp_bf16 with FSDP mixed precision DEFAULT as Composer 0.17.2 (the pin of
llm-foundry's January 2024 main, setup.py 'mosaicml>=0.17.2,<0.18') defines it
(composer/trainer/mosaic_fsdp_utils.py `get_mixed_precision`): param_dtype bf16 (FSDP1 casts
each fp32 shard to bf16 before gathering it), reduce_dtype fp32 (since composer#2628, October
2023, v0.16.4), buffers bf16. Composer's DecoupledAdamW steps parameter by parameter with
separate ops, reading a step counter per tensor, after FSDP's per-gradient clip (optimizer
'for-loop': composer/optim/decoupled_weight_decay.py, planner/optimizer_loop.py). The loss is
flash-attn's fused cross-entropy (flash_ce), and Composer updates and synchronises
ComposerMPTCausalLM's two train metrics (train_metrics: planner/composer_metrics.py)."""
LLM_FOUNDRY_PURE_OPTIONS = {"fp32_grad_reduce": False, "reduce_dtype": "bf16"}
"""FSDP mixed precision PURE as an [options] table on llm-foundry@2024."""
LLM_FOUNDRY_PURE = from_preset("llm-foundry@2024", **LLM_FOUNDRY_PURE_OPTIONS).kernel
"""llm-foundry, bf16 with FSDP mixed precision PURE (bf16 parameters, bf16 gradient
reduction)."""
LLM_FOUNDRY_AMP_2023 = PRESETS["llm-foundry@2023"].kernel
"""llm-foundry v0.3.0 (September 2023, 'mosaicml>=0.16.3,<0.17'), amp_bf16 with DEFAULT: from
composer#2047 (March 2023) to composer#2628 (v0.16.4, 11 October 2023) DEFAULT set param_dtype
and buffer_dtype to bf16 and left reduce_dtype None, which FSDP1 reads as param_dtype (bf16
reduction): PURE's kernels. The October 2023 tables do not say which of 0.16.3 and 0.16.4 ran;
0.16.3, the one released before 11 October, is assumed."""
MEGATRON_2019 = KernelOptions(attention="unfused", dropout=True, overlap_grad_reduce=False,
                              separate_projections=False,
                              fp32_grad_reduce=False, stack="eager", sharding="zero",
                              optimizer="foreach")
"""Megatron-LM 2019: apex fused LayerNorm only; softmax, GeLU, dropout as separate kernels; fp16
gradients all-reduced after the backward pass (its 'local' DDP); FP16_Optimizer's separate
copy / unscale / norm passes around the Adam step (optimizer 'foreach' bytes)."""
