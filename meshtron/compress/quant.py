"""Block-wise absmax quantization (int8) and the bf16 cast, as codecs for gradient transfer.

int8: a flat fp32 vector is cut into blocks of `block` elements; each block keeps one fp32 scale
s = max|x| / 127 and the int8 values q = round(x / s) (Dettmers et al. 2022, "8-bit optimizers
via block-wise quantization"; ZeRO++ qgZ, Wang et al. 2023, quantizes gradients the same way
before its all-to-all). Dequantized x' = q * s, so |x - x'| <= s / 2 = max|block| / 254 per
element: a block's error is bounded by its own largest value, so one outlier only costs
precision inside its block. Bytes per element: 1 + 4 / block (block 256: 0.2539 of fp32).

bf16: the values cast to bfloat16 (8 mantissa bits, relative error <= 2^-9), 2 bytes per element.

A codec works on a 2-D fp32 tensor (rows = destination ranks, each row a whole number of blocks)
and returns the wire tensors; `decode` turns them back into fp32. Scales stay fp32: bf16 scales
would save 2 bytes per block but let x/s overflow 127 after rounding the scale down.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COMPRESSIONS = ("none", "bf16", "int8")
"""Gradient compression modes: fp32 (none), bf16 cast, block-wise int8 with fp32 scales."""
QMAX = 127.0
"""Symmetric int8 range [-127, 127] (-128 unused, so the grid is symmetric around 0)."""


def padded_len(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and fp32 per-block scales of `x` (fp32, numel a multiple of `block`).

    Returns (q with x's shape, scales of shape [numel / block]). Three passes over x (max |x|
    per block, scale, round in place) and the int8 cast; no clamp is needed: |x| / (max|x| /
    127) <= 127 up to one rounding, far below the 127.5 that would round past 127."""
    blocks = x.reshape(-1, block)
    scales = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=1) / QMAX
    # An all-zero block has scale 0: multiply by 0 there (its q is 0 either way).
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.mul(blocks, inv[:, None]).round_().to(torch.int8)
    return q.reshape(x.shape), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 values of int8 `q` with per-block `scales` (inverse of `quantize` up to rounding);
    one pass (int8 x fp32 promotes to fp32)."""
    return torch.mul(q.reshape(-1, block), scales[:, None]).reshape(q.shape)


@dataclass(frozen=True)
class Codec:
    """How gradient chunks travel: 'none' (fp32), 'bf16' or 'int8' with `block`-element blocks."""

    mode: str = "int8"
    """'none', 'bf16' or 'int8'."""
    block: int = 256
    """Elements per int8 block (one fp32 scale each); rows are padded to a multiple of it."""

    @property
    def row_multiple(self) -> int:
        """Rows of an encoded tensor are padded to this many elements."""
        return self.block if self.mode == "int8" else 1

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Wire tensors for fp32 `x` of shape [rows, cols] (cols a multiple of row_multiple):
        int8: [q int8 [rows, cols], scales fp32 [rows, cols / block]]; bf16: [x bf16];
        none: [x]."""
        if self.mode == "int8":
            q, s = quantize(x, self.block)
            return [q, s.reshape(x.shape[0], -1)]
        if self.mode == "bf16":
            return [x.to(torch.bfloat16)]
        return [x]

    def decode(self, wire: list[torch.Tensor]) -> torch.Tensor:
        """fp32 values of encoded tensors (same leading shape as encoded)."""
        if self.mode == "int8":
            q, s = wire
            return dequantize(q, s.reshape(-1), self.block)
        return wire[0].float()

    def pack(self, wire: list[torch.Tensor]) -> torch.Tensor:
        """One tensor per row holding all wire tensors (int8: values then the scales' bytes),
        so one collective moves them: fewer calls, fewer round trips."""
        if len(wire) == 1:
            return wire[0]
        q, s = wire
        return torch.cat([q.view(torch.uint8), s.contiguous().view(torch.uint8)], dim=1)

    def unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of `pack` (rows of int8 values of a multiple of `block` elements)."""
        if self.mode != "int8":
            return [packed]
        cols = packed.shape[1] * self.block // (self.block + 4)
        q = packed[:, :cols].contiguous().view(torch.int8)
        s = packed[:, cols:].contiguous().view(torch.float32)
        return [q, s]

    def wire_bytes(self, numel: int) -> int:
        """Bytes the encoding of `numel` fp32 elements occupies (scales included)."""
        if self.mode == "int8":
            n = padded_len(numel, self.block)
            return n + 4 * (n // self.block)
        return numel * (2 if self.mode == "bf16" else 4)
