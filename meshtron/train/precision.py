"""Precision of a run: the default dtype per device, TF32 for fp32 on CUDA, and the
single-process bf16 mixed precision that computes what FSDP2's MixedPrecisionPolicy computes.

bf16 here is not autocast. The parallel runtime runs FSDP2 with
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=...)`: every parameter is cast to bf16
(round to nearest even) before the forward, floating inputs of each FSDP unit are cast to bf16
too (the RoPE table passed into each block), the whole forward and backward run on bf16
tensors, and each micro-batch's bf16 gradient is cast to the reduce dtype (fp32 by default) and
accumulated there into the fp32 master gradient, which the fp32 AdamW steps. `BF16Compute`
does exactly that on one process: a bf16 copy of the whole model (parameters and buffers),
refreshed from the fp32 master weights at every step. Autocast instead keeps norms, softmax
and the loss in fp32 and casts per operator, so it computed something else (the bf16
equivalence sweep only held to 2e-2 against it).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def configure_matmul_precision(device: torch.device, dtype: str) -> None:
    """fp32 runs on CUDA use TF32 tensor cores for matmuls and convolutions (10-bit mantissa
    products, fp32 accumulation: PyTorch's "high" precision), as torchtitan and Megatron-LM do;
    bf16 runs are unaffected. CPU: nothing to set.

    Through `matmul.allow_tf32`, whose setter writes torch's new setting (`fp32_precision`
    "tf32") and its legacy one ("high") together: the new one alone leaves them disagreeing,
    and torch 2.11-2.13 then raise "mix of the legacy and new APIs" from every later legacy
    read (`torch.get_float32_matmul_precision()`, `matmul.allow_tf32`: inductor's
    autotuning, TunableOp, a user's own code). `set_float32_matmul_precision("high")` would
    agree too, but also turns oneDNN's CPU matmuls to TF32."""
    if device.type != "cuda" or dtype != "fp32":
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.conv.fp32_precision = "tf32"


class BF16Compute:
    """bf16 compute copy of an fp32 model on one process (see the module doc).

        mp = BF16Compute(model)          # model: fp32 master weights, what the optimizer holds
        mp.refresh()                     # once per optimizer step, before the first forward
        loss = loss_fn(mp.model(x), y)   # bf16 forward
        loss.backward(); mp.accumulate() # per micro-batch: grads into model's fp32 .grad
    """

    def __init__(self, master: nn.Module):
        self.master = master
        self.model = copy.deepcopy(master).to(torch.bfloat16)
        self._pairs = [(m, s) for m, s in zip(master.parameters(), self.model.parameters())
                       if m.requires_grad]

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast the current fp32 master weights into the bf16 copy (one foreach kernel)."""
        torch._foreach_copy_([s for _, s in self._pairs], [m for m, _ in self._pairs])

    @torch.no_grad()
    def accumulate(self) -> None:
        """After a micro-batch's backward: its bf16 gradients cast to fp32 and added to the
        master `.grad` (FSDP2 with an fp32 reduce dtype: one process has nothing to reduce)."""
        for m, s in self._pairs:
            if s.grad is None:
                continue
            if m.grad is None:
                m.grad = s.grad.float()
            else:
                m.grad.add_(s.grad)
            s.grad = None
