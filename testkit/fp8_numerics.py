"""FP8 numerics over a training run: the same model, seed and batches in fp32, bf16 and emulated
FP8 (torchao float8, rowwise or tensorwise), one process each, loss curves side by side.

Data: byte tokens of the Python standard library's sources (meshtron/data/corpus.py, no
download), random windows drawn from one seeded generator, so every precision sees the same
batches in the same order. Text is learnable (a byte-level model drops from ln(259) = 5.56 to
about 3 nats within a few hundred steps), so the curve shows whether FP8 *trains*, not just
whether it matches bf16 on noise.

What each precision computes is the product's: fp32 the plain model; bf16
meshtron.train.precision.BF16Compute (what FSDP2's MixedPrecisionPolicy computes); fp8 the same
bf16 copy with its block Linears converted by meshtron.parallel.fp8.convert_to_fp8 (what
`meshtron train --dtype fp8` runs). Used by tests/test_fp8_numerics.py and bench/gpu_check.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CurveConfig:
    """One training run's geometry (everything but the precision)."""

    model: str = "debug"
    """Model preset (meshtron/model/spec.py)."""
    steps: int = 300
    """Optimizer steps."""
    batch: int = 8
    """Sequences per step."""
    seq: int = 64
    """Tokens per sequence."""
    lr: float = 3e-3
    """AdamW learning rate (constant: a schedule would only hide differences late in the run)."""
    seed: int = 0
    """Seed of the initial weights and of the batch windows."""
    corpus_bytes: int = 1 << 20
    """Bytes of stdlib source the windows are drawn from."""


def _windows(cfg: CurveConfig) -> np.ndarray:
    """[steps, batch, seq+1] byte tokens, the same for every precision."""
    from meshtron.data.corpus import stdlib_documents

    data = np.frombuffer("".join(stdlib_documents(cfg.corpus_bytes)).encode("utf-8"),
                         dtype=np.uint8).astype(np.int64)
    rng = np.random.default_rng(cfg.seed + 1)
    starts = rng.integers(0, len(data) - cfg.seq - 1, size=(cfg.steps, cfg.batch))
    return data[starts[..., None] + np.arange(cfg.seq + 1)]


def train_curve(cfg: CurveConfig, dtype: str, recipe: str = "rowwise",
                windows: np.ndarray | None = None) -> dict[str, Any]:
    """Train cfg.steps steps in `dtype` ('fp32', 'bf16' or 'fp8' with `recipe`); returns the
    per-step losses and the names of the Linears that ran in FP8."""
    import torch

    from meshtron.model.spec import preset
    from meshtron.model.transformer import Transformer
    from meshtron.train.loop import forward_backward
    from meshtron.train.optim import adamw_kernel
    from meshtron.train.precision import BF16Compute

    tokens = torch.from_numpy(_windows(cfg) if windows is None else windows)
    torch.manual_seed(cfg.seed)
    model = Transformer(preset(cfg.model))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, **adamw_kernel("cpu"))
    mp = BF16Compute(model) if dtype in ("bf16", "fp8") else None
    converted: list[str] = []
    if dtype == "fp8":
        from meshtron.parallel.fp8 import convert_to_fp8

        converted = convert_to_fp8(mp.model, recipe, torch.device("cpu"))
    losses = []
    for step in range(cfg.steps):
        x, y = tokens[step, :, :-1], tokens[step, :, 1:]
        loss = forward_backward(model, x, y, cfg.batch, mp)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return {"losses": losses, "fp8_linears": converted}


def smoothed(losses: list[float], window: int) -> np.ndarray:
    """Running mean over `window` steps (batch-to-batch noise of one curve is larger than the
    precision effect on any single step; the tolerance is on the trend)."""
    a = np.asarray(losses, dtype=np.float64)
    kernel = np.ones(window) / window
    return np.convolve(a, kernel, mode="valid")
