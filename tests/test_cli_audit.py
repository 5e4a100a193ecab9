"""The bad-input contract of every subcommand, for the defects the command-line audit found:
each case ran `meshtron ...` as a user types it and ended in a traceback, a lie or a file left
behind. Now: one line on stderr naming the field and the value, exit code 2, nothing written.

Through the command's entry point (`meshtron.cli.main`) in this process: every refusal here
comes before any rank starts or any torch work.
"""

from __future__ import annotations

import re

import pytest

from meshtron.cli import main
from testkit.plan_cli import refused

BINARY = b"\xff\xfe\x00\x81not = 'text'\n"
"""A file that is not UTF-8 (a checkpoint shard, an image given by mistake): every reader
raised UnicodeDecodeError with a traceback."""
TINY = ["--model", "tiny", "--cluster", "dgx-h100:1", "--global-batch", "8", "--seq-len", "64"]


def saved_plan(capsys, path, pattern: str = "", new: str = "") -> str:
    """A plan saved by `meshtron plan --save`, its first line matching `pattern` (a regular
    expression, multi-line) replaced by `new`."""
    assert main(["plan", *TINY, "--top", "1", "--save", str(path)]) == 0
    if pattern:
        text, n = re.subn(pattern, new, path.read_text(), count=1, flags=re.M | re.S)
        assert n == 1, pattern
        path.write_text(text)
    capsys.readouterr()
    return str(path)


@pytest.mark.parametrize("argv, field", [
    (["plan", "--model", "tiny", "--global-batch", "8", "--cluster", "{f}"], "cluster="),
    (["plan", "--cluster", "dgx-h100:1", "--global-batch", "8", "--model", "{f}"], "model="),
    (["plan", *TINY[2:], "--model", "tiny", "--cluster", "dgx-h100:1", "--options", "{f}"],
     "options="),
    (["cost", *TINY, "--prices", "{f}"], "prices="),
    (["cost", "--plan", "{f}"], "plan="),
    (["simulate", "--step", "--plan", "{f}"], "plan="),
    (["calibrate", "--router-stats", "{f}"], "router-stats="),
    (["train", "--config", "{f}", "--run-dir", "{run}"], "config="),
])
def test_a_binary_input_file_is_one_line(capsys, tmp_path, argv, field):
    f = tmp_path / "input.toml"
    f.write_bytes(BINARY)
    run = tmp_path / "run"
    line = refused(capsys, *[a.format(f=f, run=run) for a in argv])
    assert f"{field}{str(f)!r}" in line and ("UTF-8" in line or "utf-8" in line), line
    assert not run.exists()


@pytest.mark.parametrize("argv", [["cost", "--plan"], ["simulate", "--step", "--plan"],
                                  ["calibrate", "--router-stats"]])
def test_a_folder_given_as_a_file_is_called_a_folder(capsys, tmp_path, argv):
    """It said "file does not exist" of a folder that exists."""
    line = refused(capsys, *argv, tmp_path)
    assert "is a folder" in line and "does not exist" not in line, line


@pytest.mark.parametrize("pattern, new, want", [
    (r"^model = .*?$", "model = 7", "plan.model=7: must be a non-empty string"),
    (r"^cluster = .*?$", "cluster = 5", "plan.cluster=5: must be a non-empty string"),
    (r"^\[predicted\].*", "predicted = 3\n", "plan.predicted=3: must be a table of numbers"),
])
def test_a_damaged_plan_field_is_named(capsys, tmp_path, pattern, new, want):
    """`model = 7` in a plan file was an AttributeError traceback in `cost --plan` (the int
    read as a path), `predicted = 3` a TypeError in `train --plan` and `rehearse --plan`."""
    plan = saved_plan(capsys, tmp_path / "plan.toml", pattern, new)
    for argv in (["cost", "--plan", plan], ["simulate", "--step", "--plan", plan],
                 ["train", "--plan", plan, "--steps", "1", "--run-dir", tmp_path / "run"]):
        assert want in refused(capsys, *argv)
    assert not (tmp_path / "run").exists()


def test_a_run_file_section_that_is_not_a_table(capsys, tmp_path):
    """`train = 3` and a --steps flag: a TypeError traceback in apply_overrides."""
    run_file = tmp_path / "run.toml"
    run_file.write_text("train = 3\n")
    line = refused(capsys, "train", "--config", run_file, "--steps", "1", "--run-dir",
                   tmp_path / "run")
    assert "train=3: must be a table ([train])" in line
    assert not (tmp_path / "run").exists()


def test_plan_save_to_an_unwritable_path_is_refused_before_the_search(capsys, tmp_path):
    """`--save` under a path that cannot hold a file was a FileNotFoundError traceback after the
    search; a new sub-folder of a writable one is created, as `calibrate --out` does."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    line = refused(capsys, "plan", *TINY, "--save", blocker / "sub" / "plan.toml")
    assert line.startswith("meshtron plan: error: save=") and "is a file" in line, line
    target = tmp_path / "new" / "deeper" / "plan.toml"
    assert main(["plan", *TINY, "--top", "1", "--save", str(target)]) == 0
    assert "format = " in target.read_text()


def test_simulate_out_that_cannot_be_created(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    line = refused(capsys, "simulate", "--model", "tiny", "--global-batch", "8", "--seq-len",
                   "64", "--gpus", "8", "--out", blocker / "sweep")
    assert "out=" in line and "is a file" in line, line


@pytest.mark.parametrize("flag, allowed", [("--cluster", "expected a preset"),
                                           ("--model", "unknown preset")])
def test_an_empty_name_is_not_the_current_folder(capsys, flag, allowed):
    """`--cluster ''` was refused as "cluster='.': is a folder" (Path('') is '.')."""
    argv = dict(zip(TINY[::2], TINY[1::2]), **{flag: ""})
    line = refused(capsys, "plan", *[x for kv in argv.items() for x in kv])
    assert f"{flag[2:]}='':" in line and allowed in line, line


@pytest.mark.parametrize("argv, want", [
    (["simulate", "--step", *TINY, "--mtbf-hours", "-1"], "--mtbf-hours: '-1'"),
    (["simulate", "--step", *TINY, "--failures-per-gpu-hour", "nan"],
     "--failures-per-gpu-hour: 'nan'"),
    # a value that starts with '-' is the flag's value, refused naming it (argtypes.
    # negative_values_are_values), not argparse's "expected one argument"
    (["plan", *TINY, "--tokens", "-1T"], "tokens='-1T'"),
])
def test_simulate_rates_are_checked_on_the_flag(capsys, argv, want):
    assert want in refused(capsys, *argv)


def test_a_seed_beyond_64_bits_is_refused_before_the_run_folder(capsys, tmp_path):
    """torch takes a seed as a signed 64-bit integer: 10**23 was an OverflowError traceback
    after the run folder had been created."""
    run = tmp_path / "run"
    line = refused(capsys, "train", "--model", "debug", "--steps", "1", "--seed", 10**23,
                   "--run-dir", run)
    assert f"train.seed={10**23}" in line and "2**63 - 1" in line, line
    assert not run.exists()


@pytest.mark.parametrize("flag, field", [("--steps", "train.steps"),
                                         ("--warmup-steps", "optim.warmup_steps"),
                                         ("--global-batch", "data.global_batch")])
def test_a_count_beyond_64_bits_is_refused_before_the_run_folder(capsys, tmp_path, flag, field):
    """`--steps 10**19` was accepted (and written to run.toml, which TOML 1.0 readers refuse:
    its integers are signed 64-bit); 2**63 - 1 itself passes the check."""
    from meshtron.config import INT64_MAX, TrainConfig

    run = tmp_path / "run"
    line = refused(capsys, "train", "--model", "debug", flag, 10**19, "--run-dir", run)
    assert line.startswith("meshtron train: error: ") and f"{field}={10**19}:" in line, line
    assert "at most 2**63 - 1" in line and not run.exists()
    assert TrainConfig(steps=INT64_MAX).steps == INT64_MAX


@pytest.mark.parametrize("env, want", [
    ({"RANK": "0", "WORLD_SIZE": "x"}, "WORLD_SIZE='x' (environment variable): expected an "
                                       "integer >= 1"),
    ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5 (environment variable): must be below "
                                       "WORLD_SIZE=2"),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "two"}, "SLURM_STEP_NUM_TASKS='two'"),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "MASTER_ADDR": "localhost",
      "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
])
def test_a_launcher_variable_that_is_not_a_rank_number(capsys, monkeypatch, tmp_path, env, want):
    """torchrun's and Slurm's variables as `meshtron train` reads them: a value that is not a
    number (or a rank outside the world) was a ValueError traceback, or a rank waiting for
    peers that never come."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                 "SLURM_STEP_NUM_TASKS", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = tmp_path / "run"
    assert want in refused(capsys, "train", "--model", "debug", "--steps", "1", "--run-dir", run)
    assert not run.exists()


@pytest.mark.parametrize("dump", [b"[1, 2]\n", b"\xff\xfe{", b'{"format": 3}'])
def test_doctor_on_damaged_dumps_says_so(capsys, tmp_path, dump):
    """A rank dump holding a JSON list was an AttributeError traceback; any dump it cannot
    read is now named in the refusal instead of a bare "no trace"."""
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "rank_0.json").write_bytes(dump)
    line = refused(capsys, "doctor", tmp_path)
    assert "no trace" in line and "1 unreadable or not meshtron's: rank_0.json" in line, line


@pytest.mark.parametrize("flags, want", [
    (["--cluster", "dgx-h100:2"], "cluster='dgx-h100:2': contradicts the plan"),
    (["--model", "llama3-8b"], "model='llama3-8b': contradicts the plan"),
    (["--global-batch", "16"], "global-batch=16: contradicts the plan"),
    (["--layout", "tp=2"], "--layout='tp=2': the saved plan"),
    (["--zero", "1"], "--zero=1: the saved plan"),
])
def test_rehearse_plan_refuses_flags_it_would_ignore(capsys, tmp_path, flags, want):
    """`rehearse --plan` rehearsed another cluster's world silently, ignored --global-batch and
    the search knobs, and met another model with a stage-split error; `cost --plan` and
    `simulate --step --plan` already refused a contradicting --model/--cluster."""
    plan = saved_plan(capsys, tmp_path / "plan.toml")
    assert want in refused(capsys, "rehearse", "--plan", plan, *flags)


def test_set_takes_toml_booleans():
    """`--set model.qk_norm=true` (a run file's spelling) was refused as "'true': must be
    bool"; only Python's True was read."""
    import argparse

    from meshtron.train.cli import add_run_arguments, run_config

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--set", "model.qk_norm=true",
                              "--set", "model.tied_embeddings=false", "--set", "model.bias=True"])
    model = run_config(args).model
    assert (model.qk_norm, model.tied_embeddings, model.bias) == (True, False, True)


def test_merge_set_takes_toml_booleans():
    """`meshtron merge --set` reads values as train's --set does (one reader, argtypes)."""
    from meshtron.modular.cli import _fields

    assert _fields(["model.qk_norm=true", "model.bias=false", "model.moe_router=sigmoid",
                    "model.moe_top_k=2"]) == {"qk_norm": True, "bias": False,
                                              "moe_router": "sigmoid", "moe_top_k": 2}


@pytest.mark.parametrize("layout, ranks", [("dp=2", 2), ("tp=2,dp=2", 4), ("tp=2,pp=1,dp=2", 4)])
def test_a_layout_without_nproc_says_how_to_start_its_ranks(tmp_path, layout, ranks):
    """Session-50 user audit: `meshtron train --plan dp=2` (no --nproc) was refused as "plan
    dp=2: must divide the world size 1", true but not what a user who forgot --nproc needs."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "meshtron", "train", "--model", "debug",
                           "--plan", layout, "--steps", "1", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "must" in err and f"--nproc {ranks} starts {ranks} local ranks" in err, err
    assert not run_dir.exists()


def test_doctor_on_a_one_process_run_says_it_has_no_ranks(tmp_path):
    """Session-50 user audit: `meshtron doctor` on the folder of a one-process `meshtron train`
    said "no trace (expected trace/rank_N.json, written by `meshtron train` ranks)", as if the
    folder were not a run; it is one, with no ranks to record."""
    import subprocess
    import sys

    run = [sys.executable, "-m", "meshtron"]
    # the run trained in-process (its folder is what a one-process launch writes; suite time),
    # the doctor as typed
    assert main(["train", "--model", "debug", "--steps", "1", "--seq-len", "16",
                 "--global-batch", "2", "--eval-every", "0", "--run-dir",
                 str(tmp_path / "r")]) == 0
    done = subprocess.run([*run, "doctor", str(tmp_path / "r")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    err = done.stderr.strip()
    assert len(err.splitlines()) == 1 and "a one-process run" in err and "--nproc N" in err, err


def test_init_from_a_run_folder_names_it_and_the_ways_on(tmp_path):
    """Session-50 user audit: `meshtron train --init-from runs/tour` (a trained run) was refused
    as "config.json model_type=None: supported model types are llama, ...": the run's own
    config.json record read as a Hugging Face one. Through the `meshtron` command."""
    import subprocess
    import sys

    run = [sys.executable, "-m", "meshtron"]
    # the trained run in-process (suite time), the refused --init-from as typed
    assert main(["train", "--model", "debug", "--steps", "1", "--seq-len", "16",
                 "--global-batch", "2", "--eval-every", "0", "--checkpoint-every", "1",
                 "--run-dir", str(tmp_path / "r")]) == 0
    done = subprocess.run([*run, "train", "--init-from", str(tmp_path / "r"), "--steps", "1",
                           "--run-dir", str(tmp_path / "new")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip()
    assert len(err.splitlines()) == 1 and "a meshtron run folder" in err, err
    assert "meshtron export" in err and "--resume" in err and "model_type" not in err, err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("folder, needle", [
    ("missing", "does not exist"),
    ("empty", "holds no config.json"),
    ("empty/weights.safetensors", "is a file, not a folder"),
])
def test_init_from_without_a_model_names_init_from(capsys, tmp_path, folder, needle):
    """Session-52 user audit: `meshtron train --init-from out/nothere --steps 3` (no --model:
    the model comes from the folder's config.json) was refused as "model='out/nothere': file
    does not exist", naming a field the user never gave."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "weights.safetensors").write_bytes(b"")
    path = str(tmp_path / folder)
    code = main(["train", "--init-from", path, "--steps", "1", "--run-dir",
                 str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"train.init_from={path!r}: {needle}" in err and "model=" not in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name, what", [("missing", "does not exist"), ("file", "is a file, not a folder")])
def test_export_of_a_folder_that_is_not_there_says_so(capsys, tmp_path, name, what):
    """Session-52 user audit: `meshtron export runs/nothere --to out/x` said "no run.toml or
    config.json (not a meshtron run folder)" about a folder that does not exist."""
    (tmp_path / "file").write_text("{}")
    run, out = str(tmp_path / name), tmp_path / "out"
    assert main(["export", run, "--to", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [f"meshtron export: error: export RUN_DIR={run!r}: {what}; give "
                                "a meshtron run folder"], err
    assert not out.exists()


def test_resume_with_overwrite_is_refused(capsys, tmp_path):
    """Session-52 user audit: `meshtron train --run-dir R --resume --overwrite` resumed, as if
    --overwrite were not there; one of them is what the user meant."""
    run = str(tmp_path / "r")
    assert main(["train", "--model", "debug", "--steps", "1", "--run-dir", run, "--resume",
                 "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [
        f"meshtron train: error: --resume with --overwrite: allowed one of them (--resume "
        f"continues the run in train.run_dir={run!r}, --overwrite replaces it with a new run)"]
    assert not (tmp_path / "r").exists()


def test_resume_of_a_run_that_saved_no_checkpoint_says_why(capsys, tmp_path):
    """Audit s54: `--resume` of a run trained without --checkpoint-every (checkpoints are off
    by default) said only "no complete checkpoint in R/checkpoints", as for a folder with no
    run in it; now it says which, and writes nothing."""
    run = tmp_path / "r"
    assert main(["train", "--model", "debug", "--steps", "1", "--eval-every", "0",
                 "--run-dir", str(run)]) == 0
    capsys.readouterr()
    before = sorted(p.name for p in run.iterdir())
    line = refused(capsys, "train", "--run-dir", run, "--resume", "--steps", "2")
    assert f"no complete checkpoint in {run}/checkpoints (the run there saved none by its " \
        "last logged step, 1: " in line, line
    # audit s55: a run of --checkpoint-every 50 killed before step 50 was told checkpoints
    # were off: the line says both cases
    assert ("checkpoints are off unless --checkpoint-every N is given, and with it the first is "
            "saved at step N") in line, line
    assert sorted(p.name for p in run.iterdir()) == before
    line = refused(capsys, "train", "--model", "debug", "--run-dir", tmp_path / "none",
                   "--resume")
    assert f"({tmp_path / 'none'} holds no run)" in line, line
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("flag", ["--options", "--model", "--cluster"])
def test_a_device_given_as_a_file_is_not_called_missing(capsys, flag):
    """Audit s54: `plan --options /dev/null` said "file does not exist" of a path that
    exists: a device or pipe is named as what it is."""
    argv = dict(zip(TINY[::2], TINY[1::2]), **{flag: "/dev/null"})
    line = refused(capsys, "plan", *[x for kv in argv.items() for x in kv])
    assert "='/dev/null': not a regular file (a device, pipe or socket)" in line, line


@pytest.mark.parametrize("name, what", [("typo", "does not exist"),
                                        ("file", "is a file, not a folder")])
def test_merge_of_a_folder_that_is_not_there_says_which(capsys, tmp_path, name, what):
    """Session-55 audit: `meshtron merge --experts runs/typo ...` said "not a folder" about a
    folder that does not exist (argtypes.folder_problem now words every folder reader's line)."""
    from meshtron.cli import main

    (tmp_path / "file").write_text("x")
    path = str(tmp_path / name)
    assert main(["merge", "--experts", path, path, "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"merge --experts={path!r}: {what} (" in err, err
    assert not (tmp_path / "out").exists()
