"""Run configuration: typed, validated dataclasses loaded from TOML with command-line overrides.

A run file has one top-level key and three tables:

    model = "tiny"              # a preset, a path to a HF config.json, or a [model] table
    [data]   source, tokenizer, seq_len, global_batch, micro_batch, eval_batches
    [optim]  lr, min_lr_ratio, warmup_steps, weight_decay, beta1, beta2, eps, grad_clip
    [train]  steps, dtype, seed, eval_every, log_every, run_dir, tensorboard

A `[model]` table takes ModelSpec fields, optionally on top of `preset = "..."`.
Every key is checked: an unknown one is an error that lists the allowed keys.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtron.errors import UserError
from meshtron.argtypes import read_text
from meshtron.model.spec import PRESETS, ModelSpec, not_a_preset_name, resolve_model


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise UserError(f"{section}.{name}={value!r}: must be positive")


INT64_MAX = 2**63 - 1
"""TOML 1.0 (toml.io/en/v1.0.0#integer): integers are signed 64-bit; run.toml and plan.toml
hold every setting, so a larger one is a file other TOML readers refuse (torch, too, keeps
counters and seeds as signed 64-bit integers)."""


def _int64(section: str, obj: Any) -> None:
    """Every integer setting of `obj` within TOML's signed 64-bit range (`--steps 10**19` was
    accepted and written to run.toml)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
            raise UserError(f"{section}.{f.name}={value}: allowed at most 2**63 - 1 "
                            f"({INT64_MAX}), TOML's and torch's largest integer")


@dataclass
class DataConfig:
    source: str = "stdlib"
    """'stdlib' (the Python standard library's own sources, present on every machine), a text
    file or folder, a .jsonl file (`json_key` field) or a pre-tokenized .bin shard."""
    json_key: str = "text"
    """The field of each JSON Lines record that holds its document (Megatron-LM's
    preprocess_data.py --json-keys; datasets name it `content`, `story`...); .jsonl sources
    only (checked against the first record by `meshtron train`)."""
    tokenizer: str = "byte"
    """'byte' (259 ids: 256 bytes + BOS/EOS/PAD), 'bpe' (byte-level BPE trained locally, once,
    on rank 0) or a Hugging Face tokenizer.json (or a folder holding one); the model's
    vocabulary follows a tokenizer.json unless the weights come from train.init_from.
    Not given, with a train.init_from folder holding a tokenizer.json: that folder's (the ids
    its weights were trained on; meshtron/train/cli.py)."""
    bpe_vocab: int = 2048
    """Vocabulary size of the locally trained BPE tokenizer (tokenizer='bpe' only)."""
    seq_len: int = 256
    """Tokens per training sequence (when not given: 256, or the model's max_seq when that is
    shorter, so every preset runs with the defaults)."""
    global_batch: int = 16
    """Sequences per optimizer step, summed over all data-parallel ranks."""
    micro_batch: int | None = None
    """Sequences per forward/backward on one rank; fewer than the rank's share means gradient
    accumulation. Default: the whole share at once."""
    eval_batches: int = 4
    """Held-out batches (of global_batch sequences) averaged for the eval loss."""
    attention_mask: str = "causal"
    """'causal' (every token sees all earlier tokens of its sequence) or 'document' (packed
    documents: attention stays inside each document, RoPE positions restart; no pipelining)."""

    def __post_init__(self) -> None:
        _int64("data", self)
        _positive("data", self, "bpe_vocab", "seq_len", "global_batch", "micro_batch", "eval_batches")
        if self.tokenizer not in ("byte", "bpe"):
            from meshtron.data.tokenizer import tokenizer_file

            if tokenizer_file(self.tokenizer) is None:
                raise UserError(f"data.tokenizer={self.tokenizer!r}: allowed values are byte, "
                                 "bpe, a tokenizer.json or a folder holding one")
        if not isinstance(self.json_key, str) or not self.json_key:
            raise UserError(f"data.json_key={self.json_key!r}: must be a non-empty string, the "
                            "field of each JSON Lines record that holds its text")
        if self.attention_mask not in ("causal", "document"):
            raise UserError(f"data.attention_mask={self.attention_mask!r}: allowed values are "
                             "causal, document")
        if self.micro_batch is not None and self.global_batch % self.micro_batch:
            raise UserError(f"data.micro_batch={self.micro_batch}: must divide "
                             f"data.global_batch={self.global_batch}")


@dataclass
class OptimConfig:
    lr: float = 2e-3
    """Peak learning rate of AdamW (0: a dry run that leaves every weight unchanged)."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of `lr`."""
    warmup_steps: int = 20
    """Linear warm-up steps before the cosine decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay (Loshchilov & Hutter 2019) on matrices only."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    def __post_init__(self) -> None:
        _int64("optim", self)
        _positive("optim", self, "eps")
        if self.lr < 0:  # 0 is a dry run that changes no weight (e.g. a load/export check)
            raise UserError(f"optim.lr={self.lr!r}: must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"optim.min_lr_ratio={self.min_lr_ratio!r}: must be in [0, 1]")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"optim.{name}={getattr(self, name)!r}: must be in [0, 1)")
        for name in ("warmup_steps", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise UserError(f"optim.{name}={getattr(self, name)!r}: must be >= 0")

    def lr_factor(self, step: int, total_steps: int) -> float:
        """The learning rate of optimizer step `step` (0-based) of a `total_steps` run, as a
        fraction of `lr`: linear warm-up to the peak, then cosine decay to `min_lr_ratio` of it
        (Loshchilov & Hutter 2017, as used by GPT-3 and Llama). Torch-free: the trainer's
        scheduler (meshtron/train/optim.py) and --resume's check of a changed train.steps
        (meshtron/checkpoint/extend.py) compute it with this one function."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (
            1.0 + math.cos(math.pi * progress))


@dataclass
class TrainConfig:
    steps: int = 200
    """Optimizer steps to run."""
    dtype: str = "fp32"
    """'fp32'; 'bf16' compute with fp32 master weights; 'fp8': bf16 with the blocks' large
    Linear GEMMs in FP8 (torchao float8; emulated on CPU, meshtron/parallel/fp8.py)."""
    fp8_recipe: str = "rowwise"
    """FP8 scaling with dtype 'fp8': 'rowwise' (per-row scales) or 'tensorwise' (one per tensor;
    FP8 all-gather under FSDP2 on CUDA)."""
    compile: bool = False
    """Per-block torch.compile (meshtron/parallel/compile.py), one process or many (the plan's
    `compile`); the compile time is reported apart from the step time (`compile_time_s`)."""
    seed: int = 0
    """Seed of the weights and of the data order: same seed, same losses."""
    eval_every: int = 50
    """Evaluate the held-out loss every this many steps (and at the end); 0 disables."""
    log_every: int = 1
    """Write a metrics line every this many steps."""
    run_dir: str = "runs/default"
    """Folder for metrics.jsonl, summary.json, curves.png, the resolved config and plan."""
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN_DIR/tensorboard (needs the tensorboard
    package)."""
    init_from: str | None = None
    """A Hugging Face checkpoint folder (config.json + *.safetensors) to start from instead of
    the seed's initialization; each rank reads only its own slices (meshtron/hf/)."""
    export: str | None = None
    """Write the final weights to this folder as a Hugging Face checkpoint (safetensors +
    config.json + tokenizer files) that transformers loads."""
    replica_ft: int = 0
    """Replica groups (one process each, the whole model) trained with per-step fault
    tolerance (meshtron/train/replica.py, torchft): a dead group drops out of the step and a
    replacement rejoins with the live weights. 0: off."""
    run_id: str | None = None
    """Set by meshtron, not a setting: the run's random id, written into run.toml when the run
    is created (a new run or an --overwrite gets a new one, replacing any in the run file it
    was given; --resume keeps the checkpoint's). export.json records it and `meshtron merge`
    knows a run by it, wherever its folder is (meshtron/checkpoint/run_id.py)."""

    def __post_init__(self) -> None:
        _int64("train", self)
        _positive("train", self, "steps", "log_every")
        if not (isinstance(self.replica_ft, int) and (self.replica_ft == 0
                                                      or self.replica_ft >= 2)):
            raise UserError(f"train.replica_ft={self.replica_ft!r}: allowed 0 (off) or a whole "
                            "number >= 2 of replica groups")
        if self.dtype not in ("fp32", "bf16", "fp8"):
            raise UserError(f"train.dtype={self.dtype!r}: allowed values are fp32, bf16, fp8")
        if self.fp8_recipe not in ("rowwise", "tensorwise"):
            raise UserError(f"train.fp8_recipe={self.fp8_recipe!r}: allowed values are "
                            "rowwise, tensorwise")
        if not isinstance(self.compile, bool):
            raise UserError(f"train.compile={self.compile!r}: must be true or false")
        if self.eval_every < 0:
            raise UserError(f"train.eval_every={self.eval_every}: must be >= 0")
        if not 0 <= self.seed < 2**63:  # torch takes a seed as a signed 64-bit integer
            raise UserError(f"train.seed={self.seed}: allowed an integer from 0 to 2**63 - 1")
        if not self.run_dir.strip():
            raise UserError("train.run_dir='': must name a folder")
        for name in ("init_from", "export"):  # '' was read as not given: no export, silently
            if isinstance(getattr(self, name), str) and not getattr(self, name).strip():
                raise UserError(f"train.{name}={getattr(self, name)!r}: must name a folder "
                                "(leave it out for none)")


@dataclass
class RunConfig:
    model: ModelSpec = field(default_factory=lambda: PRESETS["tiny"])
    """Model shapes (a preset name, a HF config.json path or a [model] table in TOML)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data source, tokenizer and batch geometry."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Loop length, precision, seed and outputs."""

    def __post_init__(self) -> None:
        self.model.check_seq_len(self.data.seq_len, "data.seq_len")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml_dict(self) -> dict[str, Any]:
        """A run file that `config_from_dict` reads back into this same config (the model as a
        full [model] table; unset optional keys left out)."""
        return {k: {f: v for f, v in table.items() if v is not None}
                for k, table in self.to_dict().items()}

    def warnings(self) -> list[str]:
        """Valid but probably unintended settings, for the user to see before the run starts."""
        out = []
        # lr 0 (huggingface.md's dry run of --init-from and --export) has no rate to reach
        if self.optim.warmup_steps > self.train.steps and self.optim.lr > 0:
            out.append(f"optim.warmup_steps={self.optim.warmup_steps} is longer than "
                       f"train.steps={self.train.steps}: the learning rate never reaches "
                       f"optim.lr={self.optim.lr:g}")
        out.extend(self.model.train_notes)  # a config.json's dropout (model/hf_config.py)
        return out


_SECTIONS = {"data": DataConfig, "optim": OptimConfig, "train": TrainConfig}


def _hints(cls: type) -> dict[str, Any]:
    """A dataclass's field annotations, resolved (they are strings under
    `from __future__ import annotations`; Literal aliases live in the class's module)."""
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check a TOML/CLI value against a dataclass field's resolved annotation (int, float, str,
    bool, a Literal of strings, optional)."""
    if typing.get_origin(hint) is typing.Literal:
        allowed_values = typing.get_args(hint)
        if isinstance(value, str) and value in allowed_values:
            return value
        raise UserError(f"{key}={value!r}: allowed values are {', '.join(allowed_values)}")
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:  # tuple[X, ...] (ModelSpec.moe_mlp_only_layers): a list
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key}={value!r}: must be a list")
        return tuple(_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
    allowed = tuple(a for a in args if a is not type(None)) or (hint,)
    if value is None and type(None) in args:
        return None
    for typ in allowed:
        if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise UserError(f"{key}={value!r}: must be a finite number")
            return float(value)
        if typ is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if typ in (str, bool) and isinstance(value, typ):
            return value
    names = " or ".join(t.__name__ for t in allowed)
    raise UserError(f"{key}={value!r}: must be {names}")


def _build_section(name: str, cls: type, table: Any) -> Any:
    if not isinstance(table, dict):
        raise UserError(f"{name}={table!r}: must be a table")
    fields = _hints(cls)
    kwargs = {}
    for key, value in table.items():
        if key not in fields:
            raise UserError(f"config key '{name}.{key}': unknown; allowed: {', '.join(fields)}")
        kwargs[key] = _coerce(f"{name}.{key}", value, fields[key])
    return cls(**kwargs)


def model_from_value(value: Any) -> ModelSpec:
    """A preset name, a config.json path, or a table of ModelSpec fields (with optional preset)."""
    if isinstance(value, ModelSpec):
        return value
    if isinstance(value, str):
        return resolve_model(value)
    if isinstance(value, dict):
        table = dict(value)
        base = resolve_model(table.pop("preset")) if "preset" in table else None
        fields = _hints(ModelSpec)
        for key in table:
            if key not in fields:
                raise UserError(f"config key 'model.{key}': unknown; allowed: preset, "
                                 f"{', '.join(fields)}")
        kwargs = {k: _coerce(f"model.{k}", v, fields[k]) for k, v in table.items()}
        if base is not None:
            return not_a_preset_name(base.replace(**kwargs))
        kwargs.setdefault("name", "custom")
        try:
            return ModelSpec(**kwargs)
        except TypeError:
            missing = [f for f in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab",
                                   "max_seq") if f not in kwargs]
            raise UserError(f"model table: missing {', '.join(missing)} (or give preset=...)") from None
    raise UserError(f"model={value!r}: must be a preset name, a config.json path or a table")


def config_from_dict(doc: dict[str, Any]) -> RunConfig:
    allowed = ("model", *_SECTIONS)
    for key in doc:
        if key not in allowed:
            raise UserError(f"config key '{key}': unknown; allowed: {', '.join(allowed)}")
    model = model_from_value(doc["model"]) if "model" in doc else PRESETS["tiny"]
    data = doc.get("data", {})
    if isinstance(data, dict) and "seq_len" not in data \
            and model.max_seq < DataConfig.seq_len:  # a default the model cannot take
        doc = {**doc, "data": {**data, "seq_len": model.max_seq}}
    sections = {name: _build_section(name, cls, doc.get(name, {})) for name, cls in _SECTIONS.items()}
    return RunConfig(model=model, **sections)


def load_toml(path: str | Path, field: str = "config") -> dict[str, Any]:
    """Read a TOML file; a missing or malformed file is a one-line error naming `field`."""
    text = read_text(path, field)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{field}={str(path)!r}: not valid TOML ({exc})") from None


def apply_overrides(doc: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Merge dotted keys ('data.seq_len': 128, 'model': 'debug') into a TOML document."""
    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in doc.items()}
    # The model first, so that `model.KEY` overrides apply on top of a new `model`.
    overrides = dict(sorted(overrides.items(), key=lambda kv: kv[0] != "model"))
    for dotted, value in overrides.items():
        if value is None:
            continue
        if dotted == "model":
            doc["model"] = value
            continue
        section, key = dotted.split(".", 1)
        if section == "model":  # a field on top of the preset or table already chosen
            base = doc.get("model", "tiny")
            doc["model"] = dict(base) if isinstance(base, dict) else {"preset": base}
        table = doc.setdefault(section, {})
        if not isinstance(table, dict):  # `train = 3` in the run file, then --steps
            raise UserError(f"{section}={table!r}: must be a table ([{section}])")
        table[key] = value
    return doc
