"""The mixture-of-experts `config.json` types besides Mixtral, Qwen3-MoE and DeepSeek (read in
hf_config.py / hf_deepseek.py): Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B), OLMoE, Granite
MoE (with and without a shared expert), gpt-oss, and Qwen3-MoE's dense blocks between MoE
blocks. Keys as transformers' configuration classes name them; errors name them too.

Features with a ModelSpec field of their own are read into it (OLMoE's whole-projection q/k
norms `qk_norm_whole`, Granite's multipliers `embed_scale` / `attn_scale` / `residual_scale` /
`logit_scale`, gpt-oss's windows `sliding_window` / `window_every`: model/hf_variants.py says
which the runtime computes). What meshtron's runtime does not compute (gpt-oss's sinks and
clamped SwiGLU, Llama 4's router) is carried in `attn_sinks` and `train_refusals`: the planner
prices the model, `meshtron train` refuses it in one line (shapes.runtime_refusal).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from meshtron.errors import UserError
from meshtron.model.hf_variants import qwen_window
from meshtron.model.shapes import ModelSpec

HF_MOE_TYPES = ("qwen2_moe", "olmoe", "granitemoe", "granitemoeshared", "gpt_oss", "llama4_text")
"""The model types read here (qwen3_moe's layer pattern too: `hf_moe_type`)."""


def hf_moe_type(cfg: dict[str, Any], mtype: str, name: str, need, num, flag, opt_int,
                rope: Callable[[int], dict[str, Any]], qwen3: Callable[[], ModelSpec]
                ) -> ModelSpec:
    """A ModelSpec of model type `mtype` (HF_MOE_TYPES or qwen3_moe); `need`, `num`, `flag`,
    `opt_int`: hf_config's readers of one key; `rope(max_pos)`: its RoPE fields; `qwen3()`:
    its Qwen3-MoE reader, whose spec gains the layer pattern here."""
    if mtype == "qwen3_moe":
        return qwen3().replace(**_layer_pattern(cfg, need("num_hidden_layers")))
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"config.json hidden_act={cfg['hidden_act']!r}: only 'silu' is "
                         f"supported for model_type {mtype!r}")
    reader = {"qwen2_moe": _qwen2_moe, "olmoe": _olmoe, "granitemoe": _granite,
              "granitemoeshared": _granite, "gpt_oss": _gpt_oss, "llama4_text": _llama4}[mtype]
    heads = need("num_attention_heads")
    common = dict(
        name=name, layers=need("num_hidden_layers"), hidden=need("hidden_size"), heads=heads,
        kv_heads=opt_int("num_key_value_heads", None) or heads, vocab=need("vocab_size"),
        tied_embeddings=flag("tie_word_embeddings", False),  # every config class's default
        **rope(opt_int("max_position_embeddings", 4096)),
        moe_top_k=need("num_experts_per_tok"),
        moe_aux_loss=_coefficient(cfg, 0.01 if mtype == "olmoe" else 0.001))
    if mtype == "llama4_text" and "rope_theta" not in cfg and "rope_parameters" not in cfg:
        common["rope_theta"] = 500000.0  # Llama4TextConfig's default base
    return ModelSpec(**common, **reader(cfg, mtype, need, num, flag, opt_int, common))


def _qwen2_moe(cfg, mtype, need, num, flag, opt_int, common) -> dict[str, Any]:
    """Qwen2-MoE (transformers' Qwen2MoeSparseMoeBlock): softmax top-k (renormalised only with
    `norm_topk_prob`), one shared expert of `shared_expert_intermediate_size` scaled by
    sigmoid(shared_expert_gate(x)), q/k/v biases, dense blocks of `intermediate_size`."""
    fe = need("moe_intermediate_size")
    return dict(ffn_hidden=need("intermediate_size"), qkv_bias=flag("qkv_bias", True),
                norm_eps=num("rms_norm_eps", 1e-6),
                moe_experts=need("num_experts"), moe_ffn_hidden=fe,
                moe_norm_topk=flag("norm_topk_prob", False),
                **_shared(cfg, "shared_expert_intermediate_size", fe, gated=True),
                **_layer_pattern(cfg, common["layers"]),
                **qwen_window(cfg, mtype, common["layers"], common["max_seq"]))


def _olmoe(cfg, mtype, need, num, flag, opt_int, common) -> dict[str, Any]:
    """OLMoE (Muennighoff et al. 2024; transformers' OlmoeSparseMoeBlock): every block MoE,
    experts of `intermediate_size`, softmax top-k without renormalisation, RMSNorms over the
    whole q and k projections (`qk_norm_whole`, as OLMo 2: run at tp=1, a plan rule);
    `clip_qkv` clamps q, k, v (not run: train_refusals)."""
    _no_attention_bias(cfg, mtype)
    refusals = []
    if cfg.get("clip_qkv") is not None:
        refusals.append(f"config.json clip_qkv={cfg['clip_qkv']!r}: meshtron's attention does "
                        "not clamp q, k, v (planned only); allowed: null")
    width = need("intermediate_size")
    return dict(ffn_hidden=width, norm_eps=num("rms_norm_eps", 1e-5), qk_norm=True,
                qk_norm_whole=True, moe_experts=need("num_experts"), moe_ffn_hidden=width,
                moe_norm_topk=flag("norm_topk_prob", False), train_refusals=tuple(refusals))


def _granite(cfg, mtype, need, num, flag, opt_int, common) -> dict[str, Any]:
    """Granite 3.0 MoE (transformers' GraniteMoeMoE): top-k of the router's logits, softmax
    over those k (= softmax top-k renormalised), experts of `intermediate_size`; granitemoeshared
    adds one shared expert of `shared_intermediate_size`. Its four scalar multipliers are
    dense Granite's (hf_dense.py; transformers' defaults 1.0, the softmax scale included)."""
    _no_attention_bias(cfg, mtype)
    width = need("intermediate_size")
    shared = (_shared(cfg, "shared_intermediate_size", width, gated=False)
              if mtype == "granitemoeshared" else {})
    return dict(ffn_hidden=width, norm_eps=num("rms_norm_eps", 1e-6),
                moe_experts=need("num_local_experts"), moe_ffn_hidden=width, moe_norm_topk=True,
                embed_scale=num("embedding_multiplier", 1.0),
                attn_scale=num("attention_multiplier", 1.0),
                residual_scale=num("residual_multiplier", 1.0),
                logit_scale=1.0 / num("logits_scaling", 1.0), **shared)


def _gpt_oss(cfg, mtype, need, num, flag, opt_int, common) -> dict[str, Any]:
    """gpt-oss (OpenAI 2025 model card; transformers' GptOssConfig): biases on q, k, v, o, the
    router and the experts; a learned sink logit per head; a `sliding_window`-token window on
    the even blocks (layer_types: sliding, full, sliding, ...: `window_every` 2); a SwiGLU
    clamped at `swiglu_limit` with gate x*sigmoid(1.702x) and up + 1. Sinks, the clamped
    SwiGLU and the biases of experts are planned only (runtime_refusal)."""
    width = need("intermediate_size")
    if not flag("attention_bias", True):  # the experts' and router's biases are always there
        raise UserError("config.json attention_bias=false: meshtron's ModelSpec puts gpt-oss's "
                         "biases on attention, router and experts alike; allowed: true")
    window = opt_int("sliding_window", 128) or 0  # GptOssConfig's default
    _alternating(cfg.get("layer_types"), common["layers"])
    limit = cfg.get("swiglu_limit", 7.0)
    refusals = (f"config.json swiglu_limit={limit!r}: gpt-oss's clamped SwiGLU "
                "(x*sigmoid(1.702x), up + 1) is not meshtron's SiLU SwiGLU (planned only)",)
    head = opt_int("head_dim", None)
    return dict(ffn_hidden=width, bias=True, attn_sinks=True, sliding_window=window,
                window_every=2 if window else 0,
                head_size=head if head not in (None, common["hidden"] // common["heads"])
                else None,
                norm_eps=num("rms_norm_eps", 1e-5), moe_experts=need("num_local_experts"),
                moe_ffn_hidden=width, moe_norm_topk=True, train_refusals=refusals)


def _alternating(kinds: Any, layers: int) -> None:
    """gpt-oss's layer_types must be transformers' default (sliding on even blocks, full on
    odd ones: ModelSpec.slides with window_every 2)."""
    if kinds is None:
        return
    want = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if kinds != want:
        raise UserError(f"config.json layer_types={_kinds_text(kinds)}: meshtron prices "
                         "gpt-oss's alternation only; allowed: sliding_attention on even "
                         f"blocks, full_attention on odd ones ({layers} entries)")


def _llama4(cfg, mtype, need, num, flag, opt_int, common) -> dict[str, Any]:
    """Llama 4's text model (transformers' Llama4TextConfig / Llama4TextMoe): routed experts
    and one shared expert of `intermediate_size`, dense blocks of `intermediate_size_mlp`
    between MoE blocks (`interleave_moe_layer_step`, or an explicit `moe_layers` list), a
    top-k router whose sigmoid scores multiply each expert's input (meshtron's multiply the
    output: train_refusals), chunked attention on the RoPE blocks (`attn_chunk`, priced at
    the chunks) and no RoPE on every 4th (`no_rope_layers`: `chunk_every`), weightless L2 q/k
    norms."""
    _no_attention_bias(cfg, mtype)
    layers, fe = common["layers"], need("intermediate_size")
    pattern = _llama4_pattern(cfg, layers)
    refusals = [f"config.json model_type='llama4_text': its router's sigmoid scores multiply "
                "each expert's input, meshtron's router weights multiply the output (planned "
                "only)"]
    chunk = cfg.get("attention_chunk_size", 8192)  # Llama4TextConfig's default
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool)
                              or chunk <= 0):
        raise UserError(f"config.json attention_chunk_size={chunk!r}: must be a positive "
                        "integer or null")
    if cfg.get("use_qk_norm", True):
        refusals.append("config.json use_qk_norm=true: meshtron's q/k norms are RMSNorms with "
                        "weights, not Llama 4's weightless L2 norm (planned only)")
    head = opt_int("head_dim", 128)  # Llama4TextConfig's defaults: head_dim, dense width
    return dict(ffn_hidden=opt_int("intermediate_size_mlp", 16384),
                attn_chunk=chunk or 0, chunk_every=_nope_interval(cfg, layers) if chunk else 0,
                head_size=head if head not in (None, common["hidden"] // common["heads"])
                else None,
                norm_eps=num("rms_norm_eps", 1e-5), moe_experts=need("num_local_experts"),
                moe_ffn_hidden=fe, moe_shared_experts=1, moe_router="sigmoid",
                moe_norm_topk=False, train_refusals=tuple(refusals), **pattern)


def _nope_interval(cfg: dict[str, Any], layers: int) -> int:
    """Every how many blocks Llama 4 attends fully: transformers' Llama4TextConfig builds
    `no_rope_layers` (1: a RoPE block, chunked; 0: a NoPE block, full attention) as
    int((i + 1) % no_rope_layer_interval != 0) unless the list is given (non-empty)."""
    listed = cfg.get("no_rope_layers")
    interval = cfg.get("no_rope_layer_interval", 4)
    if not listed:
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise UserError(f"config.json no_rope_layer_interval={interval!r}: must be a "
                            "positive integer")
        return interval if interval <= layers else 0
    ok = isinstance(listed, list) and len(listed) == layers and all(v in (0, 1) for v in listed)
    every = listed.index(0) + 1 if ok and 0 in listed else 0
    if not ok or any(v != int(not every or (i + 1) % every != 0) for i, v in enumerate(listed)):
        raise UserError(f"config.json no_rope_layers={_kinds_text(listed)}: meshtron prices "
                        "Llama 4's chunked blocks as a pattern: one 0 or 1 per block "
                        f"({layers}), a 0 (full attention) every N blocks")
    return every


def _llama4_pattern(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """transformers' Llama4TextConfig: `moe_layers` defaults to every
    `interleave_moe_layer_step`-th block from step - 1 on, i.e. (i + 1) % step == 0."""
    step = cfg.get("interleave_moe_layer_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or not 0 < step <= layers:
        raise UserError(f"config.json interleave_moe_layer_step={step!r}: must be an integer "
                         f"from 1 to num_hidden_layers={layers}")
    listed = cfg.get("moe_layers")
    if listed is None:
        return {"moe_layer_step": step}
    if not isinstance(listed, list) or not listed or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < layers
            for i in listed):
        raise UserError(f"config.json moe_layers={listed!r}: must be a non-empty list of "
                        f"block indices from 0 to {layers - 1}")
    # the MoE blocks as ModelSpec says them: every block routed except those listed dense
    return {"moe_mlp_only_layers": tuple(i for i in range(layers) if i not in set(listed))}


def _shared(cfg: dict[str, Any], key: str, expert: int, gated: bool) -> dict[str, Any]:
    """ModelSpec's shared-expert fields from one shared expert of width cfg[key] (0 or
    absent: none): meshtron's shared experts are a whole number of routed experts' width."""
    width = cfg.get(key) or 0
    if not isinstance(width, int) or isinstance(width, bool) or width < 0:
        raise UserError(f"config.json {key}={width!r}: must be a non-negative integer")
    if width % expert:
        raise UserError(f"config.json {key}={width}: meshtron's shared experts are a whole "
                         f"number of routed experts wide; allowed: a multiple of {expert}")
    return {"moe_shared_experts": width // expert, "moe_shared_gate": gated and width > 0}


def _layer_pattern(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """Qwen's `decoder_sparse_step` and `mlp_only_layers` (transformers: block i is MoE when
    i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0)."""
    step = cfg.get("decoder_sparse_step", 1)
    if step is None:
        step = 1
    if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        raise UserError(f"config.json decoder_sparse_step={step!r}: must be a positive integer")
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(not isinstance(i, int) or isinstance(i, bool)
                                         or not 0 <= i < layers for i in only):
        raise UserError(f"config.json mlp_only_layers={only!r}: must be a list of block "
                         f"indices from 0 to {layers - 1}")
    listed = sum(1 for i in set(only) if (i + 1) % step == 0)
    if layers // step - listed <= 0:  # ModelSpec.moe_blocks_in's count, here by config key
        raise UserError(f"config.json decoder_sparse_step={step}, mlp_only_layers={only}: "
                         f"leave none of the {layers} blocks an MoE block; keep at least one")
    return {"moe_layer_step": step, "moe_mlp_only_layers": tuple(sorted(set(only)))}


def _no_attention_bias(cfg: dict[str, Any], mtype: str) -> None:
    if cfg.get("attention_bias") is True:
        raise UserError(f"config.json attention_bias=true: model_type {mtype!r} has no "
                         "attention biases in meshtron's model; allowed: false")


def _kinds_text(kinds: Any) -> str:
    if isinstance(kinds, list) and kinds:
        return f"{kinds[:2]}... ({len(kinds)} entries)"
    return repr(kinds)


def _coefficient(cfg: dict[str, Any], default: float) -> float:
    """router_aux_loss_coef, absent: the config class's default (OlmoeConfig 0.01, the others
    0.001)."""
    value = cfg.get("router_aux_loss_coef", default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
            math.isfinite(value) and value >= 0):
        raise UserError(f"config.json router_aux_loss_coef={value!r}: must be a non-negative "
                         "number")
    return float(value)
