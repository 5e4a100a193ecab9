"""flash-attn's padding helpers around a variable-length flash kernel (KernelOptions
`flash_unpad`): what llm-foundry's `attn_impl: flash` runs around the kernel. Torch-free.

llm-foundry's `flash_attn_fn` (llmfoundry/models/layers/attention.py, 2023-24: with flash-attn 2,
`flash_attn_interface.flash_attn_varlen_func`) takes a key padding mask (a mask of ones when
nothing is padded: MPTModel passes the batch's attention_mask on, or builds `torch.ones_like`)
and calls flash-attn's `bert_padding` (flash_attn/bert_padding.py, v2.4.2, the version
llm-foundry's `gpu-flash2` extra pinned in January 2024):

* `unpad_input`, once each for query, key and value: `attention_mask.sum(-1)`, `torch.nonzero`
  (the host reads its output size: a synchronisation), `seqlens.max().item()` (a second),
  `cumsum` + `F.pad`, then IndexFirstAxis: `torch.gather` of the [tokens, width] tensor
  (its index is `einops.repeat(indices, 'z -> z d')`, an expanded view: no index traffic
  counted). Backward: `torch.zeros` of the input's size, then `scatter_` of the gradient.
* `pad_input` of the output: IndexPutFirstAxis, `torch.zeros` [tokens, h] and
  `output[indices] = values`; backward `grad_output[indices]`.

Device bytes per token (bf16, 2 bytes each read and write; q = h, k = v = kv_dim wide, over tp):
forward: gathers 4 (q + 2 kv), zeros 2 q, index_put 4 q; backward: index 4 q, and per tensor
zeros 2 + scatter 4 = 6 (q + 2 kv). No backward synchronisation (the indices are saved).

Host: six synchronisations per layer forward (two per unpad call). After each the queue is
empty, so the launches up to the flash kernel run with the GPU waiting on them: the first
call's sum and nonzero queue behind the QKV GEMM; then max, cumsum, pad, gather, and for key
and value sum, nonzero, max, cumsum, pad, gather: 16 launches, host.SYNC_S per
synchronisation and one eager dispatch per launch. A recomputed forward repeats all of it.
(MPTModel.forward's left-padding check, `attention_mask[:, 0].sum() != batch`, adds one more
synchronisation per micro-batch forward, with any attention kernel: not counted, 20 us.)
"""

from __future__ import annotations

from meshtron.model.spec import ModelSpec
from meshtron.planner import host

SYNCS_PER_LAYER = 6
"""`torch.nonzero` and `.item()` in each of the three `unpad_input` calls (module docstring)."""
SERIAL_LAUNCHES = 16
"""Launches issued with an empty queue between the first synchronisation and the flash kernel
(module docstring)."""


def unpad_bytes(model: ModelSpec, tp: int) -> tuple[float, float]:
    """(forward, backward) HBM bytes per token of one layer's unpad / pad copies on one
    tensor-parallel rank (module docstring)."""
    q, qkv = model.hidden / tp, (model.hidden + 2 * model.kv_dim) / tp
    return 4.0 * qkv + 6.0 * q, 4.0 * q + 6.0 * qkv


def unpad_host_s(dispatch_s: float) -> float:
    """GPU seconds per layer forward spent waiting on the host: the synchronisations and the
    launches issued after them with an empty queue (module docstring)."""
    return SYNCS_PER_LAYER * host.SYNC_S + SERIAL_LAUNCHES * dispatch_s
