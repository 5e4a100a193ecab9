"""RoPE frequencies, with the long-context scalings Hugging Face checkpoints use.

Every variant changes only the inverse frequencies (and, for YaRN, multiplies cos and sin by an
"attention factor"), so one table [2, positions, rope_dim] of cos and sin serves the model
(rope_dim: the head size, or MLA's rotary part qk_rope_head_dim, as DeepSeek's config computes
its frequencies):

- "default": Su et al. 2021, inv_freq_i = theta^(-2i/d).
- "linear": position interpolation (Chen et al. 2023), inv_freq / factor.
- "dynamic": dynamic NTK scaling (bloc97/emozilla 2023): for a sequence of L > original tokens the
  base becomes theta * (factor * L / original - (factor - 1))^(d / (d - 2)); shorter sequences
  use the plain frequencies. As in transformers, L is the length of the sequence being run.
- "llama3": Llama 3.1's smooth frequency-band scaling (Meta's reference code, `apply_scaling`):
  wavelengths above original/low_freq_factor are divided by factor, those below
  original/high_freq_factor are kept, the band between is interpolated.
- "yarn": Peng et al. 2023 (YaRN): a linear ramp between interpolated (inv_freq / factor) and
  extrapolated frequencies over the dimensions whose rotation count at the original length lies
  between beta_slow and beta_fast, and cos/sin multiplied by the attention factor
  (0.1 ln(factor) + 1 unless the config gives it or mscale/mscale_all_dim).

The formulas follow transformers' `modeling_rope_utils` (the code checkpoints were validated
against), computed here in float64; tests compare logits with transformers on tiny models.
"""

from __future__ import annotations

import math

import torch

from meshtron.model.spec import ModelSpec


def inv_freq(spec: ModelSpec, seq_len: int | None = None, device=None) -> torch.Tensor:
    """Inverse frequencies [rope_dim / 2] (float64) of `spec`'s RoPE for a sequence of `seq_len`
    tokens (only "dynamic" depends on it)."""
    d, theta, kind = spec.rope_dim, spec.rope_theta, spec.rope_type
    exponent = torch.arange(0, d, 2, dtype=torch.float64, device=device) / d
    if kind == "dynamic":
        original = spec.rope_original_max_seq or spec.max_seq
        length = max(seq_len or original, original)
        theta = theta * (spec.rope_factor * length / original - (spec.rope_factor - 1)) ** (d / (d - 2))
    freq = 1.0 / theta ** exponent
    if kind == "linear":
        return freq / spec.rope_factor
    if kind == "llama3":
        return _llama3(spec, freq)
    if kind == "yarn":
        return _yarn(spec, freq)
    return freq


def attention_factor(spec: ModelSpec) -> float:
    """The factor cos and sin are multiplied by (YaRN's "mscale"; 1 for the other variants)."""
    if spec.rope_type != "yarn":
        return 1.0
    if spec.rope_attention_factor is not None:
        return spec.rope_attention_factor
    return yarn_mscale(spec.rope_factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's sqrt(1/t) = 0.1 ln(s) + 1 (Peng et al. 2023, eq. 22), with DeepSeek's multiplier."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3(spec: ModelSpec, freq: torch.Tensor) -> torch.Tensor:
    original = spec.rope_original_max_seq
    low, high, factor = spec.rope_low_freq_factor, spec.rope_high_freq_factor, spec.rope_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > original / low, freq / factor, freq)
    if high == low:  # no band between the kept and the divided wavelengths (Llama 4 Scout)
        return scaled
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: ModelSpec, freq: torch.Tensor) -> torch.Tensor:
    d, theta, original = spec.rope_dim, spec.rope_theta, spec.rope_original_max_seq

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(spec.rope_beta_fast), dim_of(spec.rope_beta_slow)
    if spec.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: avoid dividing by zero
    ramp = ((torch.arange(d // 2, dtype=torch.float64, device=freq.device) - low)
            / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return freq / spec.rope_factor * (1 - extrapolate) + freq * extrapolate


def rope_table(spec: ModelSpec, positions: int, seq_len: int | None = None,
               device=None) -> torch.Tensor:
    """cos and sin of the angles of positions 0..positions-1, stacked: [2, positions, rope_dim]
    (float32), in the half-split ("rotate_half") layout of Hugging Face Llama checkpoints."""
    freq = inv_freq(spec, seq_len, device)
    t = torch.arange(positions, dtype=torch.float64, device=device)
    angles = torch.outer(t, freq)
    angles = torch.cat([angles, angles], dim=-1)
    return (torch.stack([angles.cos(), angles.sin()]) * attention_factor(spec)).to(torch.float32)


def rope_cache(spec: ModelSpec, device: torch.device | None = None,
               seq_len: int | None = None) -> torch.Tensor:
    """The model's RoPE buffer: cos and sin of every position up to `spec.max_seq`, stacked ->
    [2, max_seq, rope_dim] (Su et al. 2021, half-split layout). `seq_len`: the length of the
    sequence being run (dynamic NTK's frequencies depend on it). It lives here, beside the
    table, so that model/init.py can rebuild the buffer without importing the transformer."""
    return rope_table(spec, spec.max_seq, seq_len, device)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, rope_dim]; cache: the [2, max_seq, rope_dim] table (positions
    0..seq-1) or per-token angles [2, batch, seq, rope_dim] (document positions)."""
    seq = x.shape[1]
    if cache.dim() == 4:
        cos, sin = cache[0][:, :, None, :].to(x.dtype), cache[1][:, :, None, :].to(x.dtype)
    else:
        cos = cache[0, :seq][None, :, None, :].to(x.dtype)
        sin = cache[1, :seq][None, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin
