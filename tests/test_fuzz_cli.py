"""Fuzzing the command line's input: every config.json field, every run-file key and every
numeric flag of `train` and `plan`, damaged at random (wrong types, null, objects, lists,
zero, negative, huge, non-finite). Whatever the input, the outcome is one of:
- refused by name: exit code 2 (a `UserError`), one line, and that line names a damaged field;
- provably harmless: accepted, and the value the command runs with is the given value itself,
  or the reader's documented normalisation of it (null = the documented default; an integer
  where a float is read; `HF_READS` below, from meshtron/model/hf_config.py `from_hf_dict`).
Never a traceback, and never a damaged value silently replaced by something else.

In process and without training: `train` is parsed and validated into a job (run file, flags,
model, config) and `plan` runs end to end with its search narrowed, so a few hundred cases take
seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtron.cli import build_parser, main
from meshtron.config import DataConfig, OptimConfig, TrainConfig
from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec
from meshtron.train.cli import job_from_args

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-10**13, 10**13),
    st.sampled_from([0, 1, 2, 3, 4, 7, 8, 64, 10**12]),
    # near misses a reader could silently coerce: a float, a bool or a string of a number
    st.sampled_from([2.0, 64.0, 1.0, 1e-5, True, False, "64", "2", "silu", "llama"]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.lists(st.integers(-3, 3), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
TOML_VALUES = JSON_VALUES.filter(lambda v: v is not None)
NUMBER_TEXT = st.one_of(st.integers(-10**13, 10**13).map(str),
                        st.sampled_from(["0", "-1", "1", "2", "8", "1e-3", "nan", "inf", "-inf",
                                         "1000000000000", "", "x", "1.5", "0x10"]),
                        st.floats(allow_nan=True, allow_infinity=True).map(repr))

HF_BASE = {
    "llama": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300,
              "max_position_embeddings": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu"},
    "gpt_neox": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                 "intermediate_size": 256, "vocab_size": 300, "max_position_embeddings": 128,
                 "rotary_pct": 1.0, "rotary_emb_base": 10000, "layer_norm_eps": 1e-5,
                 "use_parallel_residual": True, "tie_word_embeddings": False},
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_inner": None, "vocab_size": 300,
             "n_positions": 128, "layer_norm_epsilon": 1e-5},
}
PLAN_REASONS = ["no plan fits", "Nothing fits", "fits on no layout", "seq_len", "global_batch"]
"""What `plan` may name instead of a config.json key when it refuses a shape the model reader
accepted (e.g. a valid but huge vocab_size: nothing fits; max_position_embeddings below
--seq-len)."""
PLAN_NARROW = ["--layout", "tp=1,pp=1", "--zero", "0", "--micro-batch", "1", "--recompute",
               "none", "--sp", "off", "--schedule", "1f1b", "--top", "1"]


def _quiet(fn, *args):
    """Run fn(*args) with stdout/stderr captured; returns (result, stderr text)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = fn(*args)
    return result, err.getvalue()


def _check_main(argv: list[str], names: list[str]) -> int:
    """Run `meshtron argv`: exit 0, or exit 2 with one line naming one of `names`."""
    code, err = _quiet(main, argv)
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err, err
    if code == 2:
        assert len(err.strip().splitlines()) == 1, err
        assert _names(err, names), (names, err)
    return code


def _names(text: str, names: list[str]) -> bool:
    return any(n in text for n in names)


def _check_train(argv: list[str], names: list[str]):
    """Parse and validate `meshtron train argv`: the job, or None after a one-line UserError
    that names one of `names`."""
    try:
        return job_from_args(build_parser().parse_args(["train", *argv]))
    except UserError as exc:
        assert "\n" not in str(exc), str(exc)
        assert _names(str(exc), names), (names, str(exc))
        return None


_MISSING = object()


def _int_or(default):
    """A positive-integer key: the value itself; null (or absent) = `default`."""
    return lambda v, doc: default(doc) if v is None else v


def _float_or(default):
    return lambda v, doc: default if v is None else float(v)


# config.json key -> (ModelSpec field, what the reader makes of an accepted value), per type.
# Keys with field None are read for validation only (accepted = the one allowed value).
HF_READS = {
    "llama": {"num_hidden_layers": ("layers", _int_or(None)), "hidden_size": ("hidden", _int_or(None)),
              "num_attention_heads": ("heads", _int_or(None)),
              "num_key_value_heads": ("kv_heads", _int_or(lambda d: d["num_attention_heads"])),
              "intermediate_size": ("ffn_hidden", _int_or(None)), "vocab_size": ("vocab", _int_or(None)),
              "max_position_embeddings": ("max_seq", _int_or(lambda d: 4096)),
              "rope_theta": ("rope_theta", _float_or(10000.0)),
              "rms_norm_eps": ("norm_eps", _float_or(1e-5)),
              "tie_word_embeddings": ("tied_embeddings", lambda v, d: v),
              "attention_bias": ("qkv_bias", lambda v, d: v),
              "hidden_act": (None, lambda v, d: "silu"), "model_type": (None, lambda v, d: "llama")},
    "gpt_neox": {"num_hidden_layers": ("layers", _int_or(None)), "hidden_size": ("hidden", _int_or(None)),
                 "num_attention_heads": ("heads", _int_or(None)),
                 "intermediate_size": ("ffn_hidden", _int_or(lambda d: 4 * d["hidden_size"])),
                 "vocab_size": ("vocab", _int_or(None)),
                 "max_position_embeddings": ("max_seq", _int_or(lambda d: 2048)),
                 "rotary_pct": ("rope_fraction", lambda v, d: 0.25 if v is None else float(v)),
                 "rotary_emb_base": ("rope_theta", _float_or(10000.0)),
                 "layer_norm_eps": ("norm_eps", _float_or(1e-5)),
                 "use_parallel_residual": ("parallel_residual", lambda v, d: v),
                 "tie_word_embeddings": ("tied_embeddings", lambda v, d: v),
                 "model_type": (None, lambda v, d: "gpt_neox")},
    "gpt2": {"n_layer": ("layers", _int_or(None)), "n_embd": ("hidden", _int_or(None)),
             "n_head": ("heads", _int_or(None)),
             "n_inner": ("ffn_hidden", _int_or(lambda d: 4 * d["n_embd"])),
             "vocab_size": ("vocab", _int_or(None)), "n_positions": ("max_seq", _int_or(lambda d: 1024)),
             "layer_norm_epsilon": ("norm_eps", _float_or(1e-5)), "model_type": (None, lambda v, d: "gpt2")},
}


def _check_hf_harmless(spec, model_type: str, doc: dict, damaged: list[str]) -> None:
    """An accepted config.json: every damaged key reads back as its value (or documented
    normalisation); a validation-only key holds its one allowed value."""
    for key in damaged:
        field, read = HF_READS[model_type][key]
        value = doc[key]
        want = read(value, doc)
        if field is None:
            assert value == want and type(value) is type(want), (key, value)
            continue
        got = getattr(spec, field)
        if field == "qkv_bias":
            assert value is False and got is False, (key, value)
            continue
        assert got == want and type(got) is type(want), (key, value, field, got)
        if isinstance(value, (int, float)):  # no bool read as a number, no float as an int
            assert not isinstance(value, bool) or isinstance(got, bool), (key, value)


@settings(SETTINGS, max_examples=120)
@given(model_type=st.sampled_from(sorted(HF_BASE)), data=st.data())
def test_config_json_fields(model_type, data):
    base = dict(HF_BASE[model_type], model_type=model_type)
    fields = sorted(base)
    damaged = data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=2, unique=True))
    doc = dict(base)
    for key in damaged:
        doc[key] = data.draw(JSON_VALUES, label=key)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(doc))
        # a refusal may name the key or the model field it sets ("the model's max_seq=1")
        names = damaged + [f for k in damaged if (f := HF_READS[model_type][k][0])]
        job = _check_train(["--model", str(path), "--seq-len", "64", "--run-dir", tmp], names)
        if job is not None:
            _check_hf_harmless(job.cfg.model, model_type, doc, damaged)
        # plan reads the same spec; it may also refuse an accepted shape for the planner's own
        # reasons (naming a planner field: it does not fit, too many layers for the layout)
        code = _check_main(["plan", "--model", str(path), "--cluster", "dgx-h100:1",
                            "--global-batch", "8", "--seq-len", "64", *PLAN_NARROW],
                           names + (PLAN_REASONS if job is not None else []))
        assert job is not None or code == 2, (doc, "plan accepted what train refused")


RUN_KEYS = ([f"data.{f}" for f in DataConfig.__dataclass_fields__]
            + [f"optim.{f}" for f in OptimConfig.__dataclass_fields__]
            + [f"train.{f}" for f in TrainConfig.__dataclass_fields__]
            + [f"model.{f}" for f in ModelSpec.__dataclass_fields__] + ["model.preset", "model"])


@settings(SETTINGS, max_examples=150)
@given(keys=st.lists(st.sampled_from(RUN_KEYS), min_size=1, max_size=2, unique=True),
       data=st.data())
def test_run_file_keys(keys, data):
    doc: dict = {"model": {"preset": "debug"}, "data": {"seq_len": 32, "global_batch": 4},
                 "train": {"steps": 2}}
    for key in keys:
        value = data.draw(TOML_VALUES, label=key)
        if key == "model":
            doc["model"] = value
            continue
        section, field = key.split(".")
        if not isinstance(doc.get(section), dict):
            doc[section] = {}
        doc[section][field] = value
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.toml"
        path.write_text(tomli_w.dumps(doc))
        names = [k.split(".")[-1] for k in keys] + ["model", "config key"]
        job = _check_train(["--config", str(path), "--run-dir", str(Path(tmp) / "r")], names)
        if job is not None:
            _check_run_file_harmless(job.cfg, doc, keys)


def _check_run_file_harmless(cfg, doc: dict, keys: list[str]) -> None:
    """An accepted run file runs with each damaged key's value (an integer read as a float is
    the one normalisation), except documented ones: --run-dir overrides train.run_dir, and
    data.tokenizer='bpe' raises model.vocab to data.bpe_vocab."""
    from meshtron.model.spec import PRESETS

    model = doc.get("model")
    for key in keys:
        if key == "model" or (key == "model.preset" and isinstance(model, dict)):
            value = model if key == "model" else model.get("preset")
            if isinstance(value, str):  # a preset (or a path, which must then exist)
                assert value in PRESETS or Path(value).exists(), (key, value)
            else:
                assert isinstance(value, dict), (key, value)
            continue
        section, field = key.split(".")
        table = doc.get(section)
        if not isinstance(table, dict) or field not in table:
            continue  # replaced by a later damaged key (e.g. model = "debug")
        value = table[field]
        if key == "train.run_dir":
            continue  # the --run-dir flag wins: the file's value is not read
        got = getattr(cfg.model if section == "model" else getattr(cfg, section), field)
        if key == "model.vocab" and cfg.data.tokenizer == "bpe":
            value = max(value, cfg.data.bpe_vocab)
        want = float(value) if isinstance(got, float) and type(value) is int else value
        assert got == want and type(got) is type(want), (key, value, got)


TRAIN_NUMERIC = ["--seq-len", "--global-batch", "--micro-batch", "--lr", "--warmup-steps",
                 "--steps", "--seed", "--eval-every", "--log-every", "--nproc", "--zero"]
PLAN_NUMERIC = ["--global-batch", "--seq-len", "--top", "--micro-batch", "--zero", "--tokens"]


@SETTINGS
@given(flags=st.lists(st.sampled_from(TRAIN_NUMERIC), min_size=1, max_size=4, unique=True),
       data=st.data())
def test_train_numeric_flags(flags, data):
    from meshtron.train.cli import _FLAGS

    argv = ["--model", "debug", "--seq-len", "32", "--global-batch", "8", "--run-dir",
            "runs/fuzz-never-written"]
    given = {}
    for flag in flags:
        given[flag] = data.draw(NUMBER_TEXT, label=flag)
        argv += [flag, given[flag]]
    keys = [_FLAGS[f][0] for f in flags if f in _FLAGS]
    job = _check_train(argv, flags + keys)
    if job is None:
        return
    for flag, text in given.items():  # accepted: the number as written, nothing else
        if flag == "--nproc":
            got, typ = job.parallel.nproc, int
        elif flag == "--zero":
            got, typ = job.parallel.knobs["zero"], int
        else:
            key, typ, _ = _FLAGS[flag]
            section, field = key.split(".")
            got = getattr(getattr(job.cfg, section), field)
        assert got == typ(text) and type(got) is typ, (flag, text, got)


@SETTINGS
@given(flags=st.lists(st.sampled_from(PLAN_NUMERIC), min_size=1, max_size=3, unique=True),
       data=st.data())
def test_plan_numeric_flags(flags, data):
    argv = ["plan", "--model", "debug", "--cluster", "dgx-h100:1", "--layout", "tp=1,pp=1",
            "--recompute", "none", "--sp", "off", "--schedule", "1f1b"]
    for flag in flags:
        argv += [flag, data.draw(NUMBER_TEXT, label=flag)]
    fields = [f.lstrip("-").replace("-", "_") for f in flags]
    _check_main(argv, flags + fields + [f"{f}=" for f in ("tokens",)] + PLAN_REASONS)
