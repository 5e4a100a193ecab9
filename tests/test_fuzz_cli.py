"""Fuzzing the command line's input: every config.json field, every run-file key and every
numeric flag of `train` and `plan`, damaged at random (wrong types, null, objects, lists,
zero, negative, huge, non-finite). Whatever the input, the outcome is exit code 0 or a
one-line `UserError` (exit code 2): never a traceback.

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
PLAN_NARROW = ["--layout", "tp=1,pp=1", "--zero", "0", "--micro-batch", "1", "--recompute",
               "none", "--sp", "off", "--schedule", "1f1b", "--top", "1"]


def _quiet(fn, *args):
    """Run fn(*args) with stdout/stderr captured; returns (result, stderr text)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = fn(*args)
    return result, err.getvalue()


def _check_main(argv: list[str]) -> None:
    code, err = _quiet(main, argv)
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err, err
    if code == 2:
        assert len(err.strip().splitlines()) == 1, err


def _check_train(argv: list[str]) -> None:
    """Parse and validate `meshtron train argv`: a job, or a UserError."""
    try:
        job_from_args(build_parser().parse_args(["train", *argv]))
    except UserError as exc:
        assert "\n" not in str(exc), str(exc)


@SETTINGS
@given(model_type=st.sampled_from(sorted(HF_BASE)), data=st.data())
def test_config_json_fields(model_type, data):
    base = dict(HF_BASE[model_type], model_type=model_type)
    fields = sorted(base)
    damaged = data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True))
    doc = dict(base)
    for key in damaged:
        doc[key] = data.draw(JSON_VALUES, label=key)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(doc))
        _check_main(["plan", "--model", str(path), "--cluster", "dgx-h100:1",
                     "--global-batch", "8", "--seq-len", "64", *PLAN_NARROW])
        _check_train(["--model", str(path), "--seq-len", "64", "--run-dir", tmp])


RUN_KEYS = ([f"data.{f}" for f in DataConfig.__dataclass_fields__]
            + [f"optim.{f}" for f in OptimConfig.__dataclass_fields__]
            + [f"train.{f}" for f in TrainConfig.__dataclass_fields__]
            + [f"model.{f}" for f in ModelSpec.__dataclass_fields__] + ["model.preset", "model"])


@SETTINGS
@given(keys=st.lists(st.sampled_from(RUN_KEYS), min_size=1, max_size=3, unique=True),
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
        _check_train(["--config", str(path), "--run-dir", str(Path(tmp) / "r")])


TRAIN_NUMERIC = ["--seq-len", "--global-batch", "--micro-batch", "--lr", "--warmup-steps",
                 "--steps", "--seed", "--eval-every", "--log-every", "--nproc", "--zero"]
PLAN_NUMERIC = ["--global-batch", "--seq-len", "--top", "--micro-batch", "--zero", "--tokens"]


@SETTINGS
@given(flags=st.lists(st.sampled_from(TRAIN_NUMERIC), min_size=1, max_size=4, unique=True),
       data=st.data())
def test_train_numeric_flags(flags, data):
    argv = ["--model", "debug", "--seq-len", "32", "--global-batch", "8", "--run-dir",
            "runs/fuzz-never-written"]
    for flag in flags:
        argv += [flag, data.draw(NUMBER_TEXT, label=flag)]
    _check_train(argv)


@SETTINGS
@given(flags=st.lists(st.sampled_from(PLAN_NUMERIC), min_size=1, max_size=3, unique=True),
       data=st.data())
def test_plan_numeric_flags(flags, data):
    argv = ["plan", "--model", "debug", "--cluster", "dgx-h100:1", "--layout", "tp=1,pp=1",
            "--recompute", "none", "--sp", "off", "--schedule", "1f1b"]
    for flag in flags:
        argv += [flag, data.draw(NUMBER_TEXT, label=flag)]
    _check_main(argv)
