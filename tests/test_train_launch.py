"""`meshtron train --nproc N` and `meshtron calibrate` end to end: real torchrun, real ranks.

The in-depth layout-by-layout equivalence lives in tests/test_parallel.py; here the whole CLI
path (plan resolution, launch, data sharding, metrics, reports) must reproduce the
single-process losses.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from meshtron.cli import main
from meshtron.config import config_from_dict
from meshtron.train.loop import train
from testkit import no_torch
from testkit.procs import left_after, run_processes
from testkit.rank_imports import refuse_in_ranks

RUN = ["--model", "debug", "--steps", "3", "--seq-len", "32", "--global-batch", "8",
       "--eval-every", "0"]


def _meshtron(*argv, timeout=240, environ=None):
    """`meshtron ARGV`; `train` in a process that fails on any torch import (testkit/no_torch.py):
    on this GPU-less node (conftest hides the devices) the launcher plans, checks the data and
    starts the ranks without torch."""
    env = dict(os.environ if environ is None else environ, OMP_NUM_THREADS="1")
    command = no_torch.COMMAND if argv[0] == "train" else [sys.executable, "-m", "meshtron"]
    return subprocess.run([*command, *argv], capture_output=True, text=True, timeout=timeout,
                          env=env)


def _losses(path, key="loss"):
    return [json.loads(line)[key] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("argv,needle", [
    (["--nproc", "1000"], "--nproc=1000"),
    (["--nproc", "4", "--plan", "tp=2,pp=2,dp=2"], "must equal the world size 4"),
    (["--nproc", "4", "--plan", "tp=3"], "tp=3"),
    (["--nproc", "4", "--plan", "pp=4"], "pp=4"),
    (["--nproc", "4", "--plan", "pp=2,dp=2", "--schedule", "zb", "--zero", "3"], "zero=3"),
    (["--nproc", "2", "--plan", "pp=2", "--model", "tiny-gpt"], "pp=2"),
    (["--nproc", "8", "--plan", "tp=8"], "tp=8"),
    (["--nproc", "2", "--plan", "/no/such/plan.toml"], "/no/such/plan.toml"),
    (["--nproc", "2", "--plan", "dp=2", "--data", "/no/such/corpus.txt"], "/no/such/corpus.txt"),
    (["--zero", "3", "--data", "/no/such/corpus.txt"], "/no/such/corpus.txt"),
])
def test_bad_plans_fail_before_any_rank_starts(capsys, tmp_path, argv, needle):
    args = ["train", *RUN, "--run-dir", str(tmp_path / "r"), *argv]
    if "--model" in argv:  # the case's own model wins
        i = args.index("--model")
        del args[i:i + 2]
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize("data,needle", [
    ("/no/such/corpus.txt", "data.source='/no/such/corpus.txt': does not exist"),
    ("short.txt", "data.seq_len=32: the held-out split of"),  # read and tokenised, too short
])
def test_the_launchers_data_check_is_one_line_without_torch(tmp_path, data, needle):
    """`meshtron train --nproc 2` as typed: the data is read, tokenised and split by the parent
    without importing torch (testkit/no_torch.py) and refused in one line before any rank."""
    (tmp_path / "short.txt").write_text("a short corpus\n" * 40)
    proc = _meshtron("train", *RUN, "--eval-every", "1", "--nproc", "2", "--data",
                     data if data.startswith("/") else str(tmp_path / data),
                     "--run-dir", str(tmp_path / "r"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The one-process run RUN describes (metrics.jsonl's folder), trained once for the module:
    the two launches below compare their own runs with it (read only)."""
    run_dir = tmp_path_factory.mktemp("single") / "single"
    train(config_from_dict({
        "model": "debug", "data": {"seq_len": 32, "global_batch": 8},
        "train": {"steps": 3, "eval_every": 0, "run_dir": str(run_dir)}}), show_progress=False)
    return run_dir


RANKS_NEED_NOT = ("matplotlib", "torch.distributed.checkpoint")
"""What a rank of a run without checkpoints never imports: the launcher draws curves.png after
the ranks exit (train/outputs.py `prefetch_curves`), DCP comes with the first checkpoint
(checkpoint/checkpointer.py)."""


def test_two_ranks_through_the_cli_match_single_process(tmp_path, single):
    proc = _meshtron("train", *RUN, "--nproc", "2", "--plan", "dp=2", "--zero", "3",
                     "--run-dir", str(tmp_path / "dp2"),
                     environ=refuse_in_ranks(tmp_path / "guard", RANKS_NEED_NOT, os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for key in ("loss", "grad_norm", "lr"):
        want = _losses(single / "metrics.jsonl", key)
        got = _losses(tmp_path / "dp2" / "metrics.jsonl", key)
        assert len(got) == 3
        for a, b in zip(want, got):
            assert abs(a - b) <= 1e-5 * abs(a), (key, want, got)
    summary = json.loads((tmp_path / "dp2" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["plan"]["zero"] == 3
    # Steps 1..N in the console, metrics.jsonl and summary.json; one steady tokens/s.
    records = [json.loads(line) for line in (tmp_path / "dp2" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and summary["steps"] == 3
    assert "step 3/3" in proc.stderr and "step 0" not in proc.stderr
    assert records[-1]["tokens_per_s"] == summary["tokens_per_s"] > 0
    assert summary["measured_step_time_s"] == summary["step_time_s"]
    assert (tmp_path / "dp2" / "curves.png").stat().st_size > 0  # drawn by the launcher
    assert summary["predicted_step_time_s"] > 0 and summary["measured_step_time_s"] > 0
    memory = json.loads((tmp_path / "dp2" / "memory.json").read_text())
    ranks = memory["measured_bytes_per_rank"]
    assert len(ranks) == 2
    # ZeRO-3 over 2 ranks: each holds about half of the fp32 parameters.
    total_param_bytes = 4 * 125_632
    assert all(0.4 < r["params"] / total_param_bytes < 0.6 for r in ranks)
    # The planner's per-rank model states equal the measured bytes exactly, in the run's dtype.
    predicted = {r["rank"]: r for r in memory["predicted"]["bytes_per_rank"]}
    for rank, measured in enumerate(ranks):
        for key in ("params", "grads", "optimizer"):
            assert predicted[rank][key] == measured[key], (rank, key)
    assert memory["predicted"]["fullest_rank_gib"]["total"] > 0
    plan = (tmp_path / "dp2" / "plan.toml").read_text()
    assert "dp = 2" in plan and "zero = 3" in plan
    assert "vs planner" in proc.stdout


def test_calibrate_writes_a_cluster_file_the_planner_reads(tmp_path):
    out = tmp_path / "local.toml"
    proc = _meshtron("calibrate", "--nproc", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    from meshtron.planner.cluster import resolve_cluster

    cluster = resolve_cluster(str(out))
    assert cluster.num_gpus == 2 and cluster.peak_tflops > 0
    assert cluster.intra_node_gb_per_s > 0 and cluster.intra_node_latency_us >= 0
    raw = json.loads(out.with_suffix(".json").read_text())
    assert {"all_reduce", "all_gather", "reduce_scatter", "send_recv"} <= raw["samples"].keys()
    assert all(t > 0 for _, t in raw["samples"]["all_reduce"])
    # The planner plans for it.
    code = main(["plan", "--model", "debug", "--cluster", str(out), "--global-batch", "8",
                 "--seq-len", "32", "--top", "1"])
    assert code == 0


def test_public_api_reexports():
    import meshtron
    import meshtron.parallel
    import meshtron.planner.search

    assert meshtron.parallelize is meshtron.parallel.parallelize
    assert meshtron.build_mesh is meshtron.parallel.build_mesh
    assert meshtron.search_plans is meshtron.planner.search.search_plans


def test_inside_an_existing_torchrun_world(tmp_path, single):
    """`torchrun ... -m meshtron train` (how multi-node jobs start): the ranks take torchrun's
    world, resolve the same plan each, and rank 0 reports. The folder holds what a killed
    earlier launch left (its ABORT.json, an hour old): rank 0 removes it after the rendezvous
    (train/earlier.py `set_aside_in_place`; without it the doctor read the old launch's abort
    as this one's), and `meshtron doctor` finds nothing wrong. tests/test_doctor_earlier_outside.py
    (slow) resumes a hung torchrun launch and keeps its files in earlier/1."""
    stale = tmp_path / "tr" / "trace" / "ABORT.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"reason": "watchdog", "rank": 1}))
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "meshtron", "train", *RUN, "--plan", "tp=2", "--run-dir", str(tmp_path / "tr")],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: debug (125,632 params) on 2 ranks" in proc.stdout
    assert "tp = 2" in (tmp_path / "tr" / "plan.toml").read_text()
    assert not stale.exists() and not (tmp_path / "tr" / "earlier").exists()
    doctor = _meshtron("doctor", str(tmp_path / "tr"))
    assert doctor.returncode == 0 and "kind: none" in doctor.stdout, doctor.stdout
    want, got = _losses(single / "metrics.jsonl"), _losses(tmp_path / "tr" / "metrics.jsonl")
    assert len(got) == len(want) == 3
    for a, b in zip(want, got):
        assert abs(a - b) <= 1e-5 * abs(a)


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_pipeline_and_tensor_parallel_eval_matches_single_process(tmp_path):
    """Forward-only evaluation through the pipeline schedules' eval path and loss_parallel."""
    single = config_from_dict({
        "model": "debug", "data": {"seq_len": 32, "global_batch": 8, "eval_batches": 2},
        "train": {"steps": 3, "eval_every": 3, "run_dir": str(tmp_path / "single")}})
    want = train(single, show_progress=False)
    argv = [a if a != "0" else "3" for a in RUN]  # --eval-every 3
    proc = _meshtron("train", *argv, "--set", "data.eval_batches=2", "--nproc", "4",
                     "--plan", "tp=2,pp=2", "--schedule", "1f1b", "--run-dir", str(tmp_path / "p"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads((tmp_path / "p" / "metrics.jsonl").read_text().splitlines()[-1])
    assert abs(last["eval_loss"] - want.eval_loss) <= 1e-5 * want.eval_loss
    assert abs(last["loss"] - want.final_loss) <= 1e-5 * want.final_loss


# suite time: tests/test_cli_issue28.py test_saved_bf16_plan_states_its_dtype_on_cpu trains a
# one-rank saved bf16 plan through the same path and asserts the same three files
@pytest.mark.slow
def test_one_rank_saved_plan_runs_in_its_dtype(capsys, tmp_path):
    """A saved plan's dtype is what the ranks run (issue 23: it was silently replaced by the
    run's default), and RUN_DIR/plan.toml and run.toml agree on it. One rank: the command's
    entry point in this process (a child process only added a torch import)."""
    import tomllib

    from meshtron.planner.plan import Plan

    saved = tmp_path / "p.toml"
    Plan(model="debug", global_batch=8, seq_len=32, dtype="bf16").save(saved)
    code = main(["train", *RUN, "--nproc", "1", "--plan", str(saved),
                 "--run-dir", str(tmp_path / "one")])
    assert code == 0, capsys.readouterr().err[-3000:]
    assert len(_losses(tmp_path / "one" / "metrics.jsonl")) == 3
    run = tomllib.loads((tmp_path / "one" / "run.toml").read_text())
    plan = tomllib.loads((tmp_path / "one" / "plan.toml").read_text())
    assert run["train"]["dtype"] == plan["dtype"] == "bf16"


@pytest.mark.slow  # suite time (session 51): a launch of its own for what a default test checks
def test_sigterm_to_the_parent_stops_every_rank(tmp_path):
    """default coverage: tests/test_survive_causes.py::
    test_sigterm_without_checkpoint_returns_what_it_says (SIGTERM to the launcher of a 2-rank
    run: its agent and both ranks found running before, none left after)."""
    import signal
    import time

    run_dir = tmp_path / "long"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    parent = subprocess.Popen(
        [sys.executable, "-m", "meshtron", "train", "--model", "debug", "--steps", "100000",
         "--seq-len", "32", "--global-batch", "8", "--eval-every", "0", "--nproc", "2",
         "--plan", "dp=2", "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        assert parent.poll() is None, "training ended early"
        time.sleep(0.5)
    ranks = run_processes(run_dir)
    assert len(ranks) >= 3  # torchrun + 2 ranks
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=90) != 0
    assert not left_after(run_dir, 60), "ranks left running after SIGTERM"


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_looped_bfs_from_the_command_line_matches_single_process(tmp_path):
    """`--schedule gpipe:2` (torch's ScheduleLoopedBFS: two chunks per rank, every forward of a
    chunk before the next chunk's) trains through the CLI to the single-process losses; the
    planner names it in the run's plan."""
    args = [a if a != "debug" else "tiny" for a in RUN]
    proc = _meshtron("train", *args, "--nproc", "2", "--plan", "pp=2", "--schedule", "gpipe:2",
                     "--run-dir", str(tmp_path / "lb"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = (tmp_path / "lb" / "plan.toml").read_text()
    assert 'schedule = "gpipe"' in plan and "virtual_stages = 2" in plan, plan
    single = config_from_dict({
        "model": "tiny", "data": {"seq_len": 32, "global_batch": 8},
        "train": {"steps": 3, "eval_every": 0, "run_dir": str(tmp_path / "single")}})
    train(single, show_progress=False)
    got = _losses(tmp_path / "lb" / "metrics.jsonl")
    want = _losses(tmp_path / "single" / "metrics.jsonl")
    assert len(got) == len(want) == 3
    for a, b in zip(want, got):
        assert abs(a - b) <= 1e-5 * abs(a)


@pytest.mark.parametrize("schedule, needle", [
    ("1f1b:2", "only 'interleaved' and 'gpipe'"), ("gpipe:1", "at least 2"),
    ("gpipe:x", "gpipe:V")])
def test_a_bad_virtual_stage_count_is_one_line(capsys, schedule, needle):
    code = main(["plan", "--model", "tiny", "--cluster", "dgx-h100:1", "--global-batch", "8",
                 "--seq-len", "32", "--layout", "pp=2", "--schedule", schedule])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err, err
