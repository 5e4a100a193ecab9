"""Hugging Face `config.json` files (llama, mistral, qwen2, mixtral, qwen3_moe, deepseek_v2/v3,
gpt_neox, gpt2; the dense types of model/hf_dense.py) read into a ModelSpec; errors name the
config's keys."""

from __future__ import annotations

import difflib
import json
import math
import re
from pathlib import Path
from typing import Any

from meshtron.argtypes import existing_file
from meshtron.errors import UserError
from meshtron.model.hf_dense import DENSE_TYPES
from meshtron.model.hf_moe_types import HF_MOE_TYPES, hf_moe_type
from meshtron.model.hf_variants import qwen_window
from meshtron.model.mla_shapes import MLA_FIELDS
from meshtron.model.shapes import ROPE_TYPES, ModelSpec, is_number

_HF_LLAMA_LIKE = ("llama", "mistral", "qwen2")
_HF_MOE = ("mixtral", "qwen3_moe")
_HF_DEEPSEEK = ("deepseek_v3", "deepseek_v2")
_HF_TYPES = (_HF_LLAMA_LIKE + DENSE_TYPES + _HF_MOE + HF_MOE_TYPES + _HF_DEEPSEEK
             + ("gpt_neox", "gpt2"))


def from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face `config.json` into a ModelSpec."""
    path = existing_file(path, "model")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"model={str(path)!r}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"model={str(path)!r}: config.json must hold a JSON object")
    return from_hf_dict(cfg, name=_folder_name(path))


def _folder_name(path: Path) -> str:
    """The model's name: its folder's, or in Hugging Face's hub cache
    (`models--ORG--NAME/snapshots/REVISION/config.json`, huggingface_hub's cache layout) NAME,
    not the revision's hash the folder is named after; a file not called config.json is named
    after itself (configs/qwen3-8b.json and configs/llama-1b.json were both 'configs')."""
    if path.name != "config.json":
        return path.stem
    folder = path.parent
    repo = folder.parent.parent.name
    if folder.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.rsplit("--", 1)[-1]
    return folder.name or path.stem


_HF_KEYS = {
    "llama": {"layers": "num_hidden_layers", "hidden": "hidden_size",
              "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
              "ffn_hidden": "intermediate_size", "vocab": "vocab_size",
              "max_seq": "max_position_embeddings"},
    "gpt2": {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "kv_heads": "n_head",
             "ffn_hidden": "n_inner", "vocab": "vocab_size", "max_seq": "n_positions"},
}
_HF_KEYS["gpt_neox"] = dict(_HF_KEYS["llama"], kv_heads="num_attention_heads")


def from_hf_dict(cfg: dict[str, Any], name: str = "hf") -> ModelSpec:
    """A ModelSpec from a config.json's keys; errors name the config's keys (`hidden_size`),
    not ModelSpec's fields (`model.hidden`)."""
    reads = _KeysRead(cfg)
    try:
        spec = _from_hf_dict(reads, name)
    except UserError as exc:
        _refuse_near_misses(cfg, reads.looked_up)  # a misspelt key, the cause, first
        keys = _HF_KEYS.get("llama" if cfg.get("model_type") in
                            _HF_LLAMA_LIKE + DENSE_TYPES + _HF_MOE + _HF_DEEPSEEK + HF_MOE_TYPES
                            else str(cfg.get("model_type")), {})
        if cfg.get("model_type") in _HF_DEEPSEEK:  # MLA's fields are named as its keys
            keys = dict(keys, **{f: f for f in MLA_FIELDS})
        text = re.sub(r"model\.(\w+)", lambda m: f"config.json {keys[m.group(1)]}"
                      if m.group(1) in keys else m.group(0), str(exc))
        raise UserError(text) from None
    _refuse_near_misses(cfg, reads.looked_up)
    notes = dropout_notes(cfg)
    return spec.replace(train_notes=spec.train_notes + notes) if notes else spec


DROPOUT_KEYS = {"gpt2": ("embd_pdrop", "attn_pdrop", "resid_pdrop"),
                "gpt_neox": ("attention_dropout", "hidden_dropout"),
                "phi3": ("attention_dropout", "resid_pdrop"),
                "starcoder2": ("embedding_dropout", "attention_dropout", "residual_dropout")}
"""The dropout probabilities transformers' causal-LM modules read from config.json
(modeling_<type>.py, transformers 5.25: GPT2Model drop(embd_pdrop), GPT2Attention
attn_pdrop/resid_pdrop, GPT2MLP resid_pdrop; GPTNeoX attention_dropout/hidden_dropout;
Phi3 attention_dropout/resid_pdrop; Starcoder2 embedding/attention/residual_dropout); every
other type reads `attention_dropout` only (LlamaAttention and its copies). The heads' keys
(summary_*_dropout, classifier_dropout) are not the language model's."""


def dropout_notes(cfg: dict[str, Any]) -> tuple[str, ...]:
    """One warning line naming the non-zero dropout keys of `cfg` and their values, or ().

    meshtron's model has no dropout, so `meshtron train` trains such a model without it and
    says so, rather than refusing: dropout changes no parameter and no function the trained
    weights compute at inference, and it is a training choice, not the architecture.
    torchtitan's models have none and train converted Hugging Face checkpoints without it;
    Megatron-LM defaults --hidden-dropout/--attention-dropout to 0.1 but current pretraining
    recipes set both to 0 (Llama-style), and GPT-2's config.json carries 0.1 from its 2019
    pretraining, so a refusal would stop every GPT-2 checkpoint. A key absent from the file
    is the model type's class default (DROPOUT_DEFAULTS: GPT2Config's 0.1, which the model
    transformers builds from that file drops with), named as such in the same line."""
    mtype = str(cfg.get("model_type"))
    keys = DROPOUT_KEYS.get(mtype, ("attention_dropout",))
    set_keys, absent = [], []
    for key in keys:
        value = cfg.get(key)
        if value is None:
            value = DROPOUT_DEFAULTS.get(mtype, 0.0)
            if value:
                absent.append(key)
        elif not is_number(value) or not 0 <= value < 1:
            raise UserError(f"config.json {key}={value!r}: must be a dropout probability, "
                            "a number from 0 to below 1")
        if value > 0:
            set_keys.append(f"{key}={value:g}")
    if not set_keys:
        return ()
    default = (f" ({', '.join(absent)} absent: transformers' default for model_type "
               f"{mtype!r})" if absent else "")
    return (f"config.json {', '.join(set_keys)}{default}: meshtron's model has no dropout, so "
            "this run trains without it (set them to 0 to silence this warning)",)


DROPOUT_DEFAULTS = {"gpt2": 0.1}
"""What transformers' configuration class reads an absent DROPOUT_KEYS key as, where not 0
(transformers 5.25: GPT2Config resid_pdrop = embd_pdrop = attn_pdrop = 0.1; GPTNeoXConfig,
Phi3Config, Starcoder2Config and every attention_dropout: 0.0). `meshtron export` writes no
dropout key (meshtron/hf/configs.py), so a GPT-2 it exports reads as 0.1 here too: what
transformers would train it with."""


CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "mistral": {"rms_norm_eps": 1e-6, "sliding_window": 4096,
                "max_position_embeddings": 4096 * 32},
    "mixtral": {"rope_theta": 1e6, "max_position_embeddings": 4096 * 32},
    "qwen2": {"max_position_embeddings": 32768}, "qwen3": {"max_position_embeddings": 32768},
    "qwen3_moe": {"max_position_embeddings": 32768},
    "qwen2_moe": {"shared_expert_intermediate_size": 5632, "max_position_embeddings": 32768},
    "granite": {"max_position_embeddings": 2048}, "granitemoe": {"max_position_embeddings": 2048},
    "granitemoeshared": {"max_position_embeddings": 2048},
    "olmo2": {"max_position_embeddings": 2048},
    "gemma2": {"max_position_embeddings": 8192},
    # Gemma3TextConfig(vocab_size=262_208, ...) (huggingface/transformers
    # src/transformers/models/gemma3/configuration_gemma3.py, commit 008f5c8c29)
    "gemma3_text": {"max_position_embeddings": 131072, "vocab_size": 262208},
    "gpt_oss": {"max_position_embeddings": 131072},
    "llama4_text": {"max_position_embeddings": 4096 * 32},
}
"""transformers' configuration classes' defaults (models/<type>/configuration_<type>.py,
transformers 5.25; 4.x's the same) for keys a hand-written config.json may leave out, where
they are not the reader's generic default: an absent key is the model transformers builds
(LlamaConfig / MistralConfig rms_norm_eps 1e-6; MistralConfig a 4096-token window; MixtralConfig
RoPE base 1e6; Qwen2MoeConfig one shared expert 5632 wide; Gemma3TextConfig a vocabulary of
262208; each class's max_position_embeddings, which dynamic NTK and YaRN scale from). A key
listed here is never "missing", even where the reader requires it of other types."""


class _KeysRead(dict):
    """config.json's top-level object, remembering every key the reader looked up, present or
    not (`looked_up`): the keys whose absence gives a default. `defaults`: the model type's
    CLASS_DEFAULTS, which an absent key reads as (before the reader's own default)."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg)
        self.looked_up: set[str] = set()
        self.defaults = CLASS_DEFAULTS.get(str(cfg.get("model_type")), {})

    def get(self, key, default=None):
        self.looked_up.add(key)
        return super().get(key, self.defaults.get(key, default))

    def __getitem__(self, key):
        self.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.looked_up.add(key)
        return super().__contains__(key)


NEAR_MISS_CUTOFF = 0.9
"""difflib ratio above which a key the reader never looks up is taken for a misspelling of one
it looked up and did not find (one letter off a name of 10+ letters: `num_key_value_head`,
0.97); the foreign keys Hugging Face configs carry (architectures, torch_dtype,
transformers_version, bos_token_id...) are not that close to any key read, and '_'-led keys
(transformers' private attributes) are never taken for one."""


def _refuse_near_misses(cfg: dict[str, Any], looked_up: set[str]) -> None:
    """Refuse a key of `cfg` that nothing read but that is a near miss of a key the reader
    looked up and found absent (it then built the model with that key's default: a silently
    different model). Keys that are no near miss are foreign to meshtron and kept."""
    missing = sorted(k for k in looked_up if k not in cfg)
    for key in cfg:
        if key in looked_up or key.startswith("_"):
            continue  # '_'-led: transformers' private attributes (_name_or_path, gemma3's
            # _sliding_window_pattern beside layer_types), saved as they are
        close = difflib.get_close_matches(key, missing, n=1, cutoff=NEAR_MISS_CUTOFF)
        if close:
            raise UserError(f"config.json {key}: not a key meshtron reads for model_type "
                            f"{cfg.get('model_type')!r}; did you mean {close[0]}? ({close[0]} "
                            "is absent: rename the key)")


def _refuse_multimodal(cfg: dict[str, Any], mtype: Any) -> None:
    """A vision-language config.json (transformers' composite configs: gemma3, llama4,
    mistral3 hold the language model under `text_config`) whose text model meshtron reads:
    say so, rather than list the supported types as if the model were unknown. Not read in
    its place: its checkpoint's names and its vision tower are not the text model's."""
    text = cfg.get("text_config")
    if isinstance(text, dict) and text.get("model_type") in _HF_TYPES:
        raise UserError(f"config.json model_type={mtype!r}: a multimodal model; its "
                        f"text_config (model_type {text['model_type']!r}) is one meshtron "
                        "reads: save that object as a config.json of its own and give that")


def _from_hf_dict(cfg: dict[str, Any], name: str) -> ModelSpec:
    mtype = cfg.get("model_type")
    if mtype not in _HF_TYPES:
        _refuse_multimodal(cfg, mtype)
        raise UserError(
            f"config.json model_type={mtype!r}: supported model types are {', '.join(_HF_TYPES)}")

    def need(key: str) -> Any:
        if key not in cfg and key not in getattr(cfg, "defaults", {}):  # CLASS_DEFAULTS
            raise UserError(f"config.json {key}: missing (required for model_type {mtype!r})")
        return _hf_int(cfg, key, None, required=True)

    def num(key: str, default: float) -> float:
        value = cfg.get(key, default)
        if not is_number(value) or not math.isfinite(value) or value <= 0:
            raise UserError(f"config.json {key}={value!r}: must be a positive number")
        return float(value)

    def flag(key: str, default: bool) -> bool:
        value = cfg.get(key, default)
        if not isinstance(value, bool):
            raise UserError(f"config.json {key}={value!r}: must be true or false")
        return value

    def opt_int(key: str, default: Any) -> Any:
        return _hf_int(cfg, key, default)

    if mtype in _HF_LLAMA_LIKE:
        _check_hf_attention(cfg, mtype)
        if cfg.get("hidden_act", "silu") != "silu":
            raise UserError(f"config.json hidden_act={cfg['hidden_act']!r}: only 'silu' is "
                             f"supported for model_type {mtype!r}")
        heads, hidden = need("num_attention_heads"), need("hidden_size")
        head_dim = opt_int("head_dim", None)  # Mistral-Nemo: 128 with hidden 5120, 32 heads
        max_pos = opt_int("max_position_embeddings", 4096)  # CLASS_DEFAULTS first
        return ModelSpec(
            name=name, layers=need("num_hidden_layers"), hidden=hidden, heads=heads,
            head_size=head_dim if head_dim not in (None, hidden // heads) else None,
            kv_heads=opt_int("num_key_value_heads", None) or heads,
            ffn_hidden=need("intermediate_size"), vocab=need("vocab_size"),
            tied_embeddings=flag("tie_word_embeddings", False),
            qkv_bias=(mtype == "qwen2") or _no_out_bias(flag("attention_bias", False)),
            **_hf_rope(cfg, "rope_theta", num, max_pos),
            **(qwen_window(cfg, mtype, need("num_hidden_layers"), max_pos) if mtype == "qwen2"
               else _mistral_window(cfg, mtype, max_pos)),
            norm_eps=num("rms_norm_eps", 1e-6 if mtype == "qwen2" else 1e-5),
        )
    if mtype in DENSE_TYPES:
        from meshtron.model.hf_dense import hf_dense

        return hf_dense(cfg, mtype, name, need, num, flag, opt_int,
                        lambda rope_cfg, max_pos: _hf_rope(rope_cfg, "rope_theta", num, max_pos))
    if mtype in HF_MOE_TYPES or mtype == "qwen3_moe":  # model/hf_moe_types.py
        return hf_moe_type(cfg, mtype, name, need, num, flag, opt_int,
                           lambda max_pos: _hf_rope(cfg, "rope_theta", num, max_pos),
                           lambda: _hf_moe(cfg, mtype, name, need, num, flag, opt_int))
    if mtype in _HF_MOE:
        return _hf_moe(cfg, mtype, name, need, num, flag, opt_int)
    if mtype in _HF_DEEPSEEK:
        from meshtron.model.hf_deepseek import hf_deepseek

        return hf_deepseek(cfg, mtype, name, need, num, flag, opt_int,
                           lambda max_pos: _hf_rope(cfg, "rope_theta", num, max_pos))
    if mtype == "gpt_neox":
        from meshtron.model.hf_dense import neox_fields

        hidden = need("hidden_size")
        fields, rope_cfg = neox_fields(cfg)
        return ModelSpec(**fields,
            name=name, layers=need("num_hidden_layers"), hidden=hidden,
            heads=need("num_attention_heads"), kv_heads=need("num_attention_heads"),
            ffn_hidden=opt_int("intermediate_size", 4 * hidden), vocab=need("vocab_size"),
            mlp="gelu", norm="layernorm",
            position="rope", tied_embeddings=flag("tie_word_embeddings", False),
            bias=True, parallel_residual=flag("use_parallel_residual", True),
            **_hf_rope(rope_cfg, "rotary_emb_base", num,
                       opt_int("max_position_embeddings", 2048)),
            norm_eps=num("layer_norm_eps", 1e-5),
        )
    # gpt2
    hidden = need("n_embd")
    return ModelSpec(
        name=name, layers=need("n_layer"), hidden=hidden, heads=need("n_head"),
        kv_heads=need("n_head"), ffn_hidden=opt_int("n_inner", None) or 4 * hidden,
        vocab=need("vocab_size"), max_seq=opt_int("n_positions", 1024), mlp="gelu",
        norm="layernorm", position="learned", tied_embeddings=True, bias=True,
        norm_eps=num("layer_norm_epsilon", 1e-5), **_gpt2_variants(cfg, flag),
    )


_GPT2_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh",
              "gelu": "none"}
"""GPT-2's `activation_function` (transformers' GPT2MLP: ACT2FN[activation_function], default
gelu_new) -> ModelSpec.gelu_approximate; 'gelu' is the erf form."""


def _gpt2_variants(cfg: dict[str, Any], flag) -> dict[str, Any]:
    """What transformers' GPT2Attention / GPT2MLP read beyond the shapes (modeling_gpt2.py,
    transformers 5.25): the MLP's activation, and two softmax scales meshtron's attention does
    not compute (scores not divided by sqrt(head_dim) with scale_attn_weights=false; also by
    layer_idx + 1 with scale_attn_by_inverse_layer_idx): priced, refused by `meshtron train`
    (train_refusals) rather than trained as another function."""
    act = cfg.get("activation_function", "gelu_new")
    if act not in _GPT2_GELU:
        raise UserError(f"config.json activation_function={act!r}: allowed values for "
                        f"model_type 'gpt2' are {', '.join(_GPT2_GELU)}")
    refusals = []
    if not flag("scale_attn_weights", True):
        refusals.append("config.json scale_attn_weights=false: meshtron's attention divides "
                        "scores by sqrt(head_dim) (planned only); allowed: true")
    if flag("scale_attn_by_inverse_layer_idx", False):
        refusals.append("config.json scale_attn_by_inverse_layer_idx=true: meshtron's "
                        "attention does not divide block i's scores by i + 1 (planned only); "
                        "allowed: false")
    return {"gelu_approximate": _GPT2_GELU[act], "train_refusals": tuple(refusals)}


def _hf_moe(cfg: dict[str, Any], mtype: str, name: str, need, num, flag, opt_int) -> ModelSpec:
    """Mixtral (Jiang et al. 2024) and Qwen3-MoE config.json files."""
    qwen = mtype == "qwen3_moe"
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"config.json hidden_act={cfg['hidden_act']!r}: only 'silu' is "
                         f"supported for model_type {mtype!r}")
    _no_out_bias(flag("attention_bias", False))
    experts_key = "num_experts" if qwen and "num_experts" in cfg else "num_local_experts"
    max_pos = opt_int("max_position_embeddings", 4096)
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    head_dim = opt_int("head_dim", None)
    return ModelSpec(
        name=name, layers=need("num_hidden_layers"), hidden=hidden, heads=heads,
        kv_heads=opt_int("num_key_value_heads", None) or heads,
        ffn_hidden=need("intermediate_size"), vocab=need("vocab_size"),
        tied_embeddings=flag("tie_word_embeddings", False),
        head_size=head_dim if head_dim not in (None, hidden // heads) or qwen else None,
        qk_norm=qwen,
        **_hf_rope(cfg, "rope_theta", num, max_pos),
        **(qwen_window(cfg, mtype, need("num_hidden_layers"), max_pos) if qwen
           else _mistral_window(cfg, mtype, max_pos)),
        norm_eps=num("rms_norm_eps", 1e-6 if qwen else 1e-5),
        moe_experts=need(experts_key), moe_top_k=need("num_experts_per_tok"),
        moe_ffn_hidden=need("moe_intermediate_size") if qwen else need("intermediate_size"),
        moe_norm_topk=flag("norm_topk_prob", False) if qwen else True,
        moe_aux_loss=float(cfg.get("router_aux_loss_coef", 0.001)),
    )


def _hf_rope(cfg: dict[str, Any], key: str, num, max_pos: int) -> dict[str, Any]:
    """ModelSpec's RoPE fields (and max_seq) from `rope_parameters` (transformers >= 5) or the
    flat `rope_theta` / `key` with `rope_scaling` (transformers 4.x), read as transformers reads
    them (`modeling_rope_utils`): original_max_position_embeddings defaults to the top-level key,
    then to max_position_embeddings; YaRN's mscale/mscale_all_dim become its attention factor."""
    params, scaling = cfg.get("rope_parameters"), cfg.get("rope_scaling")
    for field, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise UserError(f"config.json {field}={value!r}: must be an object")
    field, rope = "rope_parameters", params or {}
    if _rope_kind(rope) == "default" and scaling:
        field, rope = "rope_scaling", scaling
    kind = _rope_kind(rope)
    if kind not in ROPE_TYPES:
        raise UserError(f"config.json {field}.rope_type={kind!r}: allowed values are "
                         f"{', '.join(ROPE_TYPES)}")

    def value(name: str, default: Any, integer: bool = False) -> Any:
        got = rope.get(name)
        if got is None:
            return default
        if integer and (not isinstance(got, int) or isinstance(got, bool) or got <= 0):
            raise UserError(f"config.json {field}.{name}={got!r}: must be a positive integer")
        if not is_number(got) or not math.isfinite(got) or got <= 0:
            raise UserError(f"config.json {field}.{name}={got!r}: must be a positive number")
        return got if integer else float(got)

    partial = (params or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UserError(f"config.json partial_rotary_factor={partial!r}: partial rotary "
                         "embeddings are not supported; only 1.0")
    theta = (value("rope_theta", None) if isinstance(params, dict) and "rope_theta" in params
             else num(key, 10000.0))
    out: dict[str, Any] = {"rope_theta": theta, "max_seq": max_pos}
    if kind == "default":
        return out
    out.update(rope_type=kind, rope_factor=value("factor", None))
    original = value("original_max_position_embeddings",
                     _hf_int(cfg, "original_max_position_embeddings", max_pos), integer=True)
    if kind == "dynamic":
        original = max_pos  # transformers' dynamic NTK scales from max_position_embeddings
    if out["rope_factor"] is None:
        if kind != "yarn":
            raise UserError(f"config.json {field}.factor: missing (required for rope_type {kind!r})")
        out["rope_factor"] = max_pos / original  # transformers: implied by the two lengths
    factor = out["rope_factor"]
    if kind != "linear":
        out["rope_original_max_seq"] = original
    if kind == "llama3":
        out.update(rope_low_freq_factor=value("low_freq_factor", 1.0),
                   rope_high_freq_factor=value("high_freq_factor", 4.0))
    if kind in ("dynamic", "yarn"):  # the point of both: run past the pre-training length
        out["max_seq"] = max(max_pos, int(factor * original))
    if kind == "yarn":
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = value("attention_factor", None)
        if attention is None and mscale and mscale_all:  # DeepSeek's variant of YaRN's mscale
            attention = 1.0 if factor <= 1 else ((0.1 * mscale * math.log(factor) + 1)
                                                 / (0.1 * mscale_all * math.log(factor) + 1))
        truncate = rope.get("truncate", True)
        if not isinstance(truncate, bool):
            raise UserError(f"config.json {field}.truncate={truncate!r}: must be true or false")
        out.update(rope_beta_fast=value("beta_fast", 32.0), rope_beta_slow=value("beta_slow", 1.0),
                   rope_attention_factor=attention, rope_truncate=truncate)
    return out


def _rope_kind(rope: dict[str, Any]) -> Any:
    return rope.get("rope_type", rope.get("type", "default"))


def _no_out_bias(attention_bias: bool) -> bool:
    """Llama's `attention_bias` puts biases on q, k, v and the output projection; meshtron's
    model has q/k/v biases only (Qwen2), so that variant is refused."""
    if attention_bias:
        raise UserError("config.json attention_bias=true: biases on the attention output "
                         "projection are not supported; only q/k/v biases (model_type qwen2)")
    return False


def _mistral_window(cfg: dict[str, Any], mtype: str, max_pos: int) -> dict[str, Any]:
    """Mistral's and Mixtral's `sliding_window` in every block (transformers' MistralAttention
    and MixtralAttention pass it to the mask in every layer: query i attends to keys
    i - window + 1 .. i): the runtime computes it (model/attention.py window_attention), so
    sequences run to max_position_embeddings; a window no shorter than that is full causal
    attention. Absent: Mistral 4096 (CLASS_DEFAULTS), Mixtral null (MixtralConfig; the
    Mixtral-8x7B-v0.1 config.json says null, Mistral-7B-v0.1 4096)."""
    if mtype not in ("mistral", "mixtral"):
        return {}
    window = cfg.get("sliding_window")
    if window in (None, 0):
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise UserError(f"config.json sliding_window={window!r}: must be a positive "
                        "integer or null")
    return {"sliding_window": window} if window < max_pos else {}


def _check_hf_attention(cfg: dict[str, Any], mtype: str) -> None:
    """Refuse what meshtron's attention does not compute: biases beyond q/k/v; Llama's and
    Mistral's `use_sliding_window` (no key of theirs; Qwen2's: hf_variants.qwen_window)."""
    if mtype != "qwen2" and cfg.get("use_sliding_window") is True:
        raise UserError("config.json use_sliding_window=true: sliding-window attention is not "
                         "supported; only full attention")
    if cfg.get("mlp_bias") is True:
        raise UserError("config.json mlp_bias=true: MLP biases are not supported for "
                         f"model_type {mtype!r}")


def _hf_int(cfg: dict[str, Any], key: str, default: Any, required: bool = False) -> Any:
    """A positive integer field of config.json; absent or null gives `default` unless
    `required`."""
    value = cfg.get(key)
    if value is None and not required:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"config.json {key}={value!r}: must be a positive integer")
    return value
