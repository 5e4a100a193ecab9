"""DeepSeek-V2 / V3 (and Kimi K2, model_type deepseek_v3) `config.json` files read into a
ModelSpec: multi-head latent attention (model/mla.py) and DeepSeekMoE (model/moe.py). Keys as
transformers' `DeepseekV3Config` / `DeepseekV2Config` name them; errors name them too.

Not carried over (the model meshtron builds differs there; planning is unaffected): the
multi-token-prediction module (`num_nextn_predict_layers`: DeepSeek-V3's 671B count excludes
it), the sequence-wise auxiliary loss of V3 (`seq_aux`, alpha 1e-4 in the report: meshtron's
auxiliary loss is the batch-wise Switch one, off for the bias-balanced router), and YaRN's
softmax-scale factor mscale(factor, mscale_all_dim)^2, which DeepSeek applies on top of
1/sqrt(q/k head size) for its long-context configs (meshtron's attention keeps 1/sqrt(d)).
"""

from __future__ import annotations

from typing import Any, Callable

from meshtron.errors import UserError
from meshtron.model.shapes import ModelSpec

_GROUPED = ("noaux_tc", "group_limited_greedy")
"""DeepSeek's group-limited routing methods (`topk_method`); 'greedy' ignores the groups."""


def hf_deepseek(cfg: dict[str, Any], mtype: str, name: str, need, num, flag, opt_int,
                rope: Callable[[int], dict[str, Any]]) -> ModelSpec:
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"config.json hidden_act={cfg['hidden_act']!r}: only 'silu' is "
                         f"supported for model_type {mtype!r}")
    if cfg.get("attention_bias") is True:
        raise UserError("config.json attention_bias=true: multi-head latent attention has no "
                         "biases in meshtron's model")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise UserError(f"config.json moe_layer_freq={cfg.get('moe_layer_freq')!r}: only 1 "
                         "(every layer after first_k_dense_replace an MoE layer) is supported")
    heads = need("num_attention_heads")
    scoring = cfg.get("scoring_func", "sigmoid" if mtype == "deepseek_v3" else "softmax")
    if scoring not in ("sigmoid", "softmax"):
        raise UserError(f"config.json scoring_func={scoring!r}: allowed values are sigmoid, "
                         "softmax")
    method = cfg.get("topk_method", "noaux_tc" if mtype == "deepseek_v3" else "greedy")
    grouped = method in _GROUPED
    experts = opt_int("n_routed_experts", 0) or 0
    return ModelSpec(
        name=name, layers=need("num_hidden_layers"), hidden=need("hidden_size"), heads=heads,
        kv_heads=heads, ffn_hidden=need("intermediate_size"), vocab=need("vocab_size"),
        tied_embeddings=flag("tie_word_embeddings", False),
        **rope(opt_int("max_position_embeddings", 4096)),
        norm_eps=num("rms_norm_eps", 1e-6),
        q_lora_rank=opt_int("q_lora_rank", None) or 0, kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"),
        moe_experts=experts,
        moe_top_k=need("num_experts_per_tok") if experts else 0,
        moe_ffn_hidden=need("moe_intermediate_size") if experts else 0,
        moe_shared_experts=(opt_int("n_shared_experts", 0) or 0) if experts else 0,
        moe_dense_layers=(opt_int("first_k_dense_replace", 0) or 0) if experts else 0,
        moe_router=scoring,
        moe_norm_topk=flag("norm_topk_prob", mtype == "deepseek_v3"),
        moe_route_scale=num("routed_scaling_factor", 1.0),
        moe_groups=(opt_int("n_group", 1) or 1) if grouped else 1,
        moe_topk_groups=(opt_int("topk_group", 1) or 1) if grouped else 1,
        # auxiliary-loss-free balancing (noaux_tc): the report's bias update speed gamma
        moe_bias_update=1e-3 if method == "noaux_tc" and experts else 0.0,
        moe_aux_loss=float(cfg.get("aux_loss_alpha", 0.0)) if method != "noaux_tc" and experts
        else 0.0,
    )
