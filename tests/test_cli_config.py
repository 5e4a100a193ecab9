"""Run config (TOML + overrides) and the CLI's handling of bad input: one line, exit code 2."""

import subprocess
import sys

import pytest

from meshtron.cli import main
from meshtron.config import apply_overrides, config_from_dict, load_toml


def test_toml_with_model_table_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "tiny"\nlayers = 2\n[data]\nseq_len = 64\n'
                    '[train]\nsteps = 3\n')
    doc = apply_overrides(load_toml(path), {"train.steps": 5, "data.global_batch": 4})
    cfg = config_from_dict(doc)
    assert cfg.model.layers == 2 and cfg.model.hidden == 256
    assert cfg.data.seq_len == 64 and cfg.data.global_batch == 4 and cfg.train.steps == 5


def test_set_model_field_on_top_of_a_preset():
    doc = apply_overrides({}, {"model": "debug", "model.layers": 1, "data.seq_len": 64})
    cfg = config_from_dict(doc)
    assert cfg.model.layers == 1 and cfg.model.hidden == 64
    assert config_from_dict(apply_overrides({}, {"model.layers": 3})).model.hidden == 256


def _run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("argv,needle", [
    (["train", "--model", "nope-1b"], "model='nope-1b'"),
    (["train", "--steps", "0"], "train.steps=0"),
    (["train", "--global-batch", "-4"], "data.global_batch=-4"),
    (["train", "--data", "/does/not/exist.txt"], "/does/not/exist.txt"),
    (["train", "--dtype", "fp16"], "train.dtype='fp16'"),
    (["train", "--set", "optim.nope=1"], "optim.nope"),
    (["train", "--global-batch", "6", "--micro-batch", "4"], "data.micro_batch=4"),
    (["train", "--seq-len", "100000"], "data.seq_len=100000"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, needle):
    code, err = _run_cli(capsys, *argv, "--run-dir", str(tmp_path / "r"))
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert needle in err and "Traceback" not in err


def test_unknown_toml_key_and_malformed_hf_config(capsys, tmp_path):
    run = tmp_path / "run.toml"
    run.write_text("[train]\nstepz = 3\n")
    code, err = _run_cli(capsys, "train", "--config", str(run))
    assert code == 2 and "train.stepz" in err and "allowed" in err
    hf = tmp_path / "config.json"
    hf.write_text('{"model_type": "t5"}')
    code, err = _run_cli(capsys, "train", "--model", str(hf))
    assert code == 2 and "model_type='t5'" in err and len(err.splitlines()) == 1


def test_module_entry_point_exit_code():
    proc = subprocess.run([sys.executable, "-m", "meshtron", "train", "--steps", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "train.steps=-1" in proc.stderr


def test_every_subcommand_has_help():
    from meshtron.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in sub.choices:
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([name, "--help"])
        assert exc.value.code == 0
