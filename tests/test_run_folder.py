"""The run folder through the `meshtron` command (real processes, real torchrun): every launch
path writes the run's records, export refuses a config that does not describe the checkpoint
and survives a live run's rotation, --resume of a finished run keeps its results, and entries
of the wrong kind are refused before anything is written."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from meshtron.checkpoint import store
from meshtron.cli import main

TINY = ["--seq-len", "32", "--global-batch", "4", "--eval-every", "0"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1")


def _meshtron(*argv, timeout=240):
    return subprocess.run([sys.executable, "-m", "meshtron", *argv], capture_output=True,
                          text=True, timeout=timeout, env=_env())


def _torchrun(*argv, timeout=240):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "meshtron", *argv],
                          capture_output=True, text=True, timeout=timeout, env=_env())


def _one_line_error(proc, needle):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, lines


def test_outside_torchrun_writes_records_and_export_checks_the_model(tmp_path, capsys):
    run, out = tmp_path / "n1", tmp_path / "n1_hf"
    # an earlier run's records in the folder (trained in-process: the launch under test is the
    # outside torchrun's below; suite time)
    assert main(["train", "--model", "debug", *TINY, "--steps", "2", "--run-dir", str(run)]) == 0
    assert 'name = "debug"' in (run / "run.toml").read_text()
    debug_toml = (run / "run.toml").read_text()
    second = _torchrun("train", "--model", "tiny-gpt", *TINY, "--plan", "dp=2", "--steps", "2",
                       "--checkpoint-every", "2", "--run-dir", str(run), "--overwrite")
    assert second.returncode == 0, second.stderr[-3000:]
    # rank 0 prints the plan line meshtron's own launcher prints (it printed none)
    assert re.search(r"^plan tp=1,pp=1,dp=2 .* on nominal-cpu:2", second.stdout, re.M), \
        second.stdout[-2000:]
    # rank 0 of the outside launcher wrote this run's records, as `--nproc` does
    assert 'name = "tiny-gpt"' in (run / "run.toml").read_text()
    assert "dp = 2" in (run / "plan.toml").read_text()
    # tied embeddings: the checkpoint holds output.weight too (the state_dict's alias); the
    # export was refused as "the model of run.toml has none" (audit 47)
    done = _meshtron("export", str(run), "--to", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert config["n_layer"] == 4 and config.get("tie_word_embeddings", True)
    _exported_model_is_the_checkpoints(run / "checkpoints" / "step_00000002", out,
                                       done.stdout)
    # a config of another run beside the checkpoint (what the stale run.toml was): refused
    # (in-process, the same argv: the export above was the command as typed; suite time)
    (run / "run.toml").write_text(debug_toml)
    capsys.readouterr()
    code = main(["export", str(run), "--to", str(tmp_path / "stale_hf")])
    stale = subprocess.CompletedProcess([], code, *capsys.readouterr())
    _one_line_error(stale, "does not match the run's model config")
    assert not (tmp_path / "stale_hf").exists()


def _exported_model_is_the_checkpoints(step_dir, out, printed):
    """The export holds one tensor per HF name (no lm_head beside a tied wte, as transformers
    writes tied models), the count printed is the files' count, and the model `train
    --init-from` reads from it (hf.load.load_into) computes the checkpoint's logits."""
    import torch
    from safetensors import safe_open

    from meshtron.checkpoint.export import load_checkpoint
    from meshtron.hf.load import load_into
    from meshtron.model import PRESETS, Transformer
    from meshtron.model.init import materialize

    names = set()
    for path in out.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names |= set(f.keys())
    assert not any("lm_head" in n for n in names), sorted(names)
    assert "exported step 2 of " in printed and f"({len(names)} tensors)" in printed, printed
    spec = PRESETS["tiny-gpt"]
    with torch.device("meta"):  # filled as `train --init-from` fills its model: no init draw
        trained, exported = Transformer(spec), Transformer(spec)
    state = load_checkpoint(step_dir)
    materialize([trained], torch.device("cpu"), fill=lambda p: p[0].load_state_dict(state))
    materialize([exported], torch.device("cpu"), fill=lambda p: load_into(p, out, spec))
    tokens = torch.randint(0, spec.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(trained(tokens), exported(tokens))


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_resume_of_a_finished_run_keeps_its_results(tmp_path):
    run = tmp_path / "k5"
    common = ["train", "--model", "debug", *TINY, "--plan", "dp=2", "--checkpoint-every", "2",
              "--run-dir", str(run)]
    argv = [*common, "--nproc", "2", "--steps", "4"]
    assert _meshtron(*argv).returncode == 0
    kept = {name: (run / name).read_bytes() for name in ("summary.json", "metrics.jsonl",
                                                         "run.toml", "config.json")}
    again = _meshtron(*argv, "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "already complete at step 4 (train.steps=4)" in again.stdout
    assert {name: (run / name).read_bytes() for name in kept} == kept
    outside = _torchrun(*common, "--steps", "4", "--resume")
    assert outside.returncode == 0, outside.stderr[-2000:]
    assert outside.stdout.count("already complete at step 4") == 1  # rank 0 says it
    assert {name: (run / name).read_bytes() for name in kept} == kept
    # a larger --steps continues the finished run (its 4 steps lie inside the warm-up, so their
    # rates are the same under both lengths: checkpoint/extend.py); the refusal of a length
    # that changes a taken step's rate is tests/test_resume_extend.py's
    longer = _meshtron(*common, "--nproc", "2", "--steps", "6", "--resume")
    assert longer.returncode == 0, longer.stderr[-2000:]
    assert "extending the run from train.steps=4 to 6" in longer.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if "event" not in row]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_checkpoint_removed_while_read_is_chosen_again(tmp_path):
    from meshtron.checkpoint.export import load_checkpoint, read_newest

    from testkit.cli_inproc import meshtron_main

    run = tmp_path / "rot"
    # one process, in this one (testkit/cli_inproc.py: no child's torch import, ~3.5 CPU s)
    code, _, err = meshtron_main("train", "--model", "debug", *TINY, "--steps", "3",
                                 "--checkpoint-every", "1", "--run-dir", run)
    assert code == 0, err[-2000:]
    assert [s for s, _ in store.committed(run / "checkpoints")] == [3, 2, 1]
    tried = []

    def read_while_rotating(folder):
        tried.append(folder.name)
        if len(tried) == 1:  # the run's retention removes it under the reader
            shutil.rmtree(folder)
        return load_checkpoint(folder)

    state, folder, step = read_newest(run, read_while_rotating)
    assert tried == ["step_00000003", "step_00000002"] and step == 2
    assert folder.name == "step_00000002" and len(state) == 21


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_export_of_a_live_run_with_rotation(tmp_path):
    run = tmp_path / "live"
    trainer = subprocess.Popen(
        [sys.executable, "-m", "meshtron", "train", "--model", "debug", *TINY, "--steps",
         "100000", "--checkpoint-every", "1", "--keep", "3", "--run-dir", str(run)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    try:
        deadline = time.time() + 120
        while len(store.committed(run / "checkpoints")) < 2 and time.time() < deadline:
            time.sleep(0.2)
        steps = []
        for i in range(4):
            done = _meshtron("export", str(run), "--to", str(tmp_path / f"x{i}"))
            assert done.returncode == 0, done.stderr[-2000:]
            steps.append(int(done.stdout.split("exported step ")[1].split()[0]))
        assert trainer.poll() is None and steps == sorted(steps)
    finally:
        trainer.send_signal(signal.SIGTERM)
        trainer.wait(timeout=120)


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_entries_of_the_wrong_kind_are_one_line_before_anything_is_written(tmp_path):
    """A folder where the run writes a file: refused with or without --overwrite (which deletes
    outputs, not folders of unknown content). A file where the checkpoints go: refused without
    --overwrite, replaced with it (checkpoint/resume.py prepare_start)."""
    for name, make in (("checkpoints", "file"), ("metrics.jsonl", "folder"),
                       ("config.json", "folder"), ("tensorboard", "file")):
        run = tmp_path / name.replace(".", "_")
        run.mkdir()
        (run / name).mkdir() if make == "folder" else (run / name).touch()
        argv = ["train", "--model", "debug", *TINY, "--steps", "2", "--checkpoint-every", "1",
                "--run-dir", str(run)]
        for extra in ([], ["--overwrite"]):
            proc = _meshtron(*argv, *extra)
            if extra and name == "checkpoints":
                assert proc.returncode == 0, proc.stderr[-2000:]
                assert [s for s, _ in store.committed(run / name)] == [2, 1]
                continue
            needle = "holds a run" if not extra and name in ("checkpoints", "metrics.jsonl") \
                else f"is a {make}, where the run writes"
            _one_line_error(proc, needle)
            assert sorted(p.name for p in run.iterdir()) == [name]  # nothing written


def _workers(parent: int) -> dict[int, int]:
    """torchrun's workers under the agent `parent`: rank (RANK in the environment) -> pid."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        ranks = [v[5:] for v in env if v.startswith(b"RANK=")]
        if ppid == parent and ranks:
            found[int(ranks[0])] = int(entry)
    return found


def _rank_process(parent: int, rank: int, deadline: float) -> int:
    """The pid of torchrun's worker `rank` under the agent `parent`."""
    while time.time() < deadline:
        pid = _workers(parent).get(rank)
        if pid is not None:
            return pid
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} under torchrun {parent}")


@pytest.mark.slow
def test_outside_torchrun_restart_continues_the_run(tmp_path):
    """An outside torchrun's own --max-restarts (no meshtron flag), rank 1 SIGKILLed after a
    checkpoint: the restarted attempt forms its group on a store of its own (on the agent's,
    shared across attempts, gloo read the last attempt's addresses and hung, or failed with
    'Connection refused': pytorch/pytorch#135712), is not refused its own folder as 'holds a
    run', and resumes from the checkpoint to the last step (~40 s on 2 cores)."""
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "--max-restarts", "1", "-m", "meshtron", "train", "--model", "debug", *TINY,
            "--steps", "30", "--checkpoint-every", "5", "--run-dir", str(run)]
    agent = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=_env(), start_new_session=True)
    try:
        deadline = time.time() + 120
        while not store.committed(run / "checkpoints") and time.time() < deadline:
            time.sleep(0.2)
        os.kill(_rank_process(agent.pid, 1, deadline), signal.SIGKILL)
        out, _ = agent.communicate(timeout=240)
    finally:
        if agent.poll() is None:  # hung: its ranks (process groups of their own), the agent
            for pid in _workers(agent.pid).values():
                os.kill(pid, signal.SIGKILL)
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    assert agent.returncode == 0, out[-3000:]
    assert "restart 1 (torchrun)" in out and "resumed from" in out, out[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 30
