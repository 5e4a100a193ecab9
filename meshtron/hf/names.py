"""Hugging Face tensor names <-> meshtron parameter names, and the config.json meshtron writes.

Llama, Mistral and Qwen2 checkpoints store every projection unfused and in the layout meshtron's
model uses (`nn.Linear` [out, in] weights; q/k rows in the half-split "rotate_half" RoPE order
that meshtron's `apply_rope` uses): one name to one name, and a rank reads exactly the rows and
columns it owns. GPT-2 stores Conv1D weights transposed ([in, out]) and q, k, v fused in one
`c_attn` matrix (columns q | k | v): a meshtron tensor is then a transposed column range of the
Hugging Face one (`Source.transpose`, `Source.offset`), still read as a box; Phi-3's fused
rows and Granite MoE's fused experts the same way (`Source.axis`). Which type's names hold a
spec: meshtron/hf/layouts.py. GPT-NeoX fuses q/k/v interleaved per head; it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec

from meshtron.hf.layouts import SUPPORTED_TYPES, block_params, hf_module, moe_names, resolve_type

__all__ = ["SUPPORTED_TYPES", "Source", "check_supported", "hf_config", "hf_shapes", "sources"]


@dataclass(frozen=True)
class Source:
    """Where a meshtron tensor lives in a Hugging Face checkpoint."""

    name: str
    """The Hugging Face tensor."""
    transpose: bool = False
    """The Hugging Face tensor is stored [in, out] (GPT-2's Conv1D): meshtron's rows are its
    columns."""
    offset: int = 0
    """First index along `axis` of the meshtron tensor inside a fused Hugging Face tensor (in
    meshtron's orientation: a column offset of the stored tensor when `transpose`)."""
    stacked: tuple[str, ...] = ()
    """MoE experts: the meshtron tensor [experts, out, in] stacks these per-expert Hugging Face
    tensors (expert e is `stacked[e]`; `name` is the first). A rank holding experts e0..e1
    reads only theirs."""
    axis: int = 0
    """The meshtron dimension `offset` runs along: 0 (rows: GPT-2's c_attn, Phi-3's qkv_proj
    and gate_up_proj), 1 (Granite MoE's input_linear [experts, gate | up, hidden])."""

    @property
    def stored_axis(self) -> int:
        """The stored tensor's dimension that `offset` runs along."""
        return 1 - self.axis if self.transpose else self.axis


LM_HEAD = "lm_head.weight"

IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
"""Checkpoint tensors that are derived buffers, not weights (older Llama conversions' RoPE
frequencies, old GPT-2 files' causal-mask buffers)."""


def check_supported(spec: ModelSpec, where: str, declared: Any = None) -> str:
    """The model_type whose tensor names hold `spec`'s weights (meshtron/hf/layouts.py):
    `declared` (a config.json's model_type) where it expresses the spec, else the type its
    fields read as; a one-line UserError naming `where` for other architectures."""
    return resolve_type(spec, declared, where)


def sources(spec: ModelSpec, mtype: str | None = None) -> dict[str, Source]:
    """Every meshtron parameter name (tied weights once, as `named_parameters` gives them) ->
    where it lives in a Hugging Face checkpoint of model type `mtype` (default: the type the
    spec's fields read as)."""
    mtype = mtype or check_supported(spec, "model")
    if mtype == "gpt2":
        return _gpt2_sources(spec)
    out = {"tok_embeddings.weight": Source("model.embed_tokens.weight")}
    for i in range(spec.layers):
        out.update(_block_sources(spec, mtype, i))
    out["norm.weight"] = Source("model.norm.weight")
    if spec.norm == "layernorm":
        out["norm.bias"] = Source("model.norm.bias")
    if not spec.tied_embeddings:
        out["output.weight"] = Source(LM_HEAD)
    return out


def _phi3_fused(spec: ModelSpec) -> dict[str, tuple[str, int]]:
    """Phi-3's fused rows (Phi3Attention splits qkv_proj's output at heads x head_dim and
    + kv_dim; Phi3MLP chunks gate_up_proj's in two): meshtron module -> (tensor, first row)."""
    q = spec.heads * spec.head_dim
    return {"attention.wq": ("self_attn.qkv_proj", 0), "attention.wk": ("self_attn.qkv_proj", q),
            "attention.wv": ("self_attn.qkv_proj", q + spec.kv_dim),
            "feed_forward.w1": ("mlp.gate_up_proj", 0),
            "feed_forward.w3": ("mlp.gate_up_proj", spec.ffn_hidden)}


def _block_sources(spec: ModelSpec, mtype: str, i: int) -> dict[str, Source]:
    base, out = f"model.layers.{i}.", {}
    fused = _phi3_fused(spec) if mtype == "phi3" else {}
    moe = spec.is_moe_layer(i)
    for ours in block_params(spec, i):
        module, leaf = ours.rsplit(".", 1)
        if moe and module.startswith("feed_forward."):
            continue
        if module in fused:
            theirs, first = fused[module]
            out[f"layers.{i}.{ours}"] = Source(f"{base}{theirs}.{leaf}", offset=first)
            continue
        theirs = hf_module(mtype, module)
        if theirs is None:
            raise UserError(f"model: meshtron parameter layers.{i}.{ours} has no tensor in a "
                            f"model_type {mtype!r} checkpoint")
        out[f"layers.{i}.{ours}"] = Source(f"{base}{theirs}.{leaf}")
    if moe:
        out.update(_moe_sources(spec, mtype, i))
    return out


def _moe_sources(spec: ModelSpec, mtype: str, i: int) -> dict[str, Source]:
    base, ff = f"model.layers.{i}.", f"layers.{i}.feed_forward."
    if mtype in ("granitemoe", "granitemoeshared"):  # [E, gate | up, hidden], [E, hidden, w]
        moe, shared = base + "block_sparse_moe.", base + "shared_mlp."
        out = {ff + "router.gate.weight": Source(moe + "router.layer.weight"),
               ff + "experts.w1.weight": Source(moe + "input_linear.weight", axis=1),
               ff + "experts.w3.weight": Source(moe + "input_linear.weight",
                                                offset=spec.moe_ffn_hidden, axis=1),
               ff + "experts.w2.weight": Source(moe + "output_linear.weight")}
        if spec.moe_shared_experts:  # one shared expert: [gate | up, hidden], [hidden, w]
            width = spec.moe_shared_experts * spec.moe_ffn_hidden
            out.update({ff + "shared.w1.weight": Source(shared + "input_linear.weight"),
                        ff + "shared.w3.weight": Source(shared + "input_linear.weight",
                                                        offset=width),
                        ff + "shared.w2.weight": Source(shared + "output_linear.weight")})
        return out
    router, expert, (w1, w3, w2) = moe_names(mtype)
    out = {ff + "router.gate.weight": Source(f"{base}{router}.weight")}
    for ours, theirs in (("w1", w1), ("w3", w3), ("w2", w2)):
        names = tuple(f"{base}{expert.format(e=e)}{theirs}.weight"
                      for e in range(spec.moe_experts))
        out[f"{ff}experts.{ours}.weight"] = Source(names[0], stacked=names)
    if spec.moe_shared_experts:  # Qwen2-MoE's one shared expert and its gate
        for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            out[f"{ff}shared.{ours}.weight"] = Source(f"{base}mlp.shared_expert.{theirs}.weight")
    if spec.moe_shared_gate:
        out[f"{ff}shared.gate.weight"] = Source(f"{base}mlp.shared_expert_gate.weight")
    return out


def _gpt2_sources(spec: ModelSpec) -> dict[str, Source]:
    h = spec.hidden
    out = {"tok_embeddings.weight": Source("transformer.wte.weight"),
           "pos_embeddings.weight": Source("transformer.wpe.weight")}
    for i in range(spec.layers):
        p, q = f"layers.{i}.", f"transformer.h.{i}."
        for j, proj in enumerate(("wq", "wk", "wv")):  # c_attn columns: q | k | v
            out[f"{p}attention.{proj}.weight"] = Source(f"{q}attn.c_attn.weight", True, j * h)
            out[f"{p}attention.{proj}.bias"] = Source(f"{q}attn.c_attn.bias", False, j * h)
        out[f"{p}attention.wo.weight"] = Source(f"{q}attn.c_proj.weight", True)
        out[f"{p}attention.wo.bias"] = Source(f"{q}attn.c_proj.bias")
        out[f"{p}feed_forward.w1.weight"] = Source(f"{q}mlp.c_fc.weight", True)
        out[f"{p}feed_forward.w1.bias"] = Source(f"{q}mlp.c_fc.bias")
        out[f"{p}feed_forward.w2.weight"] = Source(f"{q}mlp.c_proj.weight", True)
        out[f"{p}feed_forward.w2.bias"] = Source(f"{q}mlp.c_proj.bias")
        for ours, theirs in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            out[f"{p}{ours}.weight"] = Source(f"{q}{theirs}.weight")
            out[f"{p}{ours}.bias"] = Source(f"{q}{theirs}.bias")
    out["norm.weight"] = Source("transformer.ln_f.weight")
    out["norm.bias"] = Source("transformer.ln_f.bias")
    return out


def meshtron_to_hf(spec: ModelSpec, mtype: str | None = None) -> dict[str, str]:
    """Every meshtron parameter name -> the Hugging Face tensor that holds it."""
    return {k: s.name for k, s in sources(spec, mtype).items()}


def hf_shapes(spec: ModelSpec, shapes: dict[str, tuple[int, ...]],
              mtype: str | None = None) -> dict[str, tuple[int, ...]]:
    """The shape every Hugging Face tensor must have, from meshtron's global `shapes`
    (fused tensors: the meshtron parts side by side along their axis)."""
    out: dict[str, list[int]] = {}
    for ours, src in sources(spec, mtype).items():
        shape = list(shapes[ours])
        if src.stacked:  # one [out, in] tensor per expert
            out.update({name: shape[1:] for name in src.stacked})
            continue
        if src.transpose:
            shape = shape[::-1]
        dim = src.stored_axis
        if src.name in out:  # fused: parts extend one dimension
            out[src.name][dim] = max(out[src.name][dim], src.offset + shape[dim])
        else:
            shape[dim] += src.offset
            out[src.name] = shape
    return {k: tuple(v) for k, v in out.items()}


def is_ignorable(hf_name: str, spec: ModelSpec) -> bool:
    """A checkpoint tensor meshtron may skip: derived buffers, and the output head of a tied
    model (some writers store the shared matrix twice)."""
    return hf_name.endswith(IGNORED_SUFFIXES) or (spec.tied_embeddings and hf_name == LM_HEAD)


def hf_config(spec: ModelSpec, dtype: str = "float32", mtype: str | None = None
              ) -> dict[str, Any]:
    """A config.json `transformers` reads back into the same architecture (hf/configs.py)."""
    from meshtron.hf.configs import hf_config as build

    return build(spec, dtype, mtype or check_supported(spec, "export"))


def rope_parameters(spec: ModelSpec) -> dict[str, Any]:
    from meshtron.hf.configs import rope_parameters as build

    return build(spec)


class HFTensors:
    """Turns full meshtron tensors, fed one at a time, into Hugging Face tensors: transposes
    GPT-2's Conv1D weights and assembles a fused tensor once all its parts have arrived."""

    def __init__(self, spec: ModelSpec, shapes: dict[str, tuple[int, ...]],
                 mtype: str | None = None):
        self.sources = sources(spec, mtype)
        self.want = hf_shapes(spec, shapes, mtype)
        self.pending: dict[str, list[tuple[int, Any]]] = {}

    def add(self, name: str, tensor: Any) -> list[tuple[str, Any]]:
        """The Hugging Face tensors completed by meshtron tensor `name` (often one, or none
        while a fused tensor waits for its other parts)."""
        import torch

        src = self.sources[name]
        if src.stacked:
            return [(n, tensor[e].contiguous()) for e, n in enumerate(src.stacked)]
        t = tensor.t().contiguous() if src.transpose else tensor
        dim = src.stored_axis
        total = self.want[src.name][dim]
        if src.offset == 0 and t.shape[dim] == total:
            return [(src.name, t)]
        parts = self.pending.setdefault(src.name, [])
        parts.append((src.offset, t))
        if sum(p.shape[dim] for _, p in parts) < total:
            return []
        del self.pending[src.name]
        return [(src.name, torch.cat([p for _, p in sorted(parts, key=lambda x: x[0])], dim))]
