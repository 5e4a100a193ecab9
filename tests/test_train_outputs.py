"""Run outputs: steps numbered 1..N everywhere, one steady tokens/s figure, median step time,
curves.png, TensorBoard events, the warm-up warning, and no silent reuse of a run folder."""

import json
import re
import statistics

from meshtron.cli import main

RUN = ["--model", "debug", "--steps", "7", "--seq-len", "32", "--global-batch", "4",
       "--eval-every", "3", "--warmup-steps", "2"]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_one_step_run_says_one_step_and_why_it_has_no_rate(capsys, tmp_path):
    """Audit s54: the closing line of a one-step run read "1 steps" and "n/a (one step)
    tok/s"; the rate is the steady steps' (step 1 excluded), so a one-step run has none."""
    run = tmp_path / "r"
    assert main(["train", "--model", "debug", "--steps", "1", "--seq-len", "32",
                 "--global-batch", "4", "--eval-every", "0", "--run-dir", str(run)]) == 0
    console = "".join(capsys.readouterr())
    assert "1 step, loss" in console and "no steady tok/s (one step)" in console, console


def test_step_numbering_and_throughput_agree_everywhere(capsys, tmp_path):
    run = tmp_path / "r"
    assert main(["train", *RUN, "--run-dir", str(run)]) == 0
    captured = capsys.readouterr()
    console = captured.out + captured.err
    records = _records(run)
    summary = json.loads((run / "summary.json").read_text())
    steps = [r["step"] for r in records]
    assert steps == list(range(1, 8)) and summary["steps"] == 7 == steps[-1]
    # Console: "step K/7" lines (evaluations at 3, 6 and the last step), each step once.
    printed = [int(m) for m in re.findall(r"step (\d+)/7", console)]
    assert {3, 6, 7} <= set(printed) and len(printed) == len(set(printed))
    assert all(1 <= k <= 7 for k in printed)
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6, 7]
    # One tokens/s: steady state (step 1 excluded), the same in the last record, the summary
    # and the closing console line.
    assert records[0]["tokens_per_s"] is None
    assert records[-1]["tokens_per_s"] == summary["tokens_per_s"] > 0
    assert f"{summary['tokens_per_s']:,.0f} tok/s" in console
    # Evaluation is timed apart from training; the step time is the median of steady steps.
    assert all(r["eval_time_s"] > 0 for r in records if "eval_loss" in r)
    assert summary["step_time_s"] == statistics.median(r["step_time_s"] for r in records[1:])
    tokens = 4 * 32
    steady = sum(r["step_time_s"] for r in records[1:])
    assert abs(summary["tokens_per_s"] - tokens * 6 / steady) <= 1e-6 * summary["tokens_per_s"]
    assert summary["first_loss"] == records[0]["loss"] and summary["final_loss"] == records[-1]["loss"]
    png = (run / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_log_every_keeps_numbering_and_logs_the_last_step(tmp_path):
    run = tmp_path / "r"
    assert main(["train", *RUN, "--log-every", "4", "--eval-every", "0",
                 "--run-dir", str(run)]) == 0
    records = _records(run)
    assert [r["step"] for r in records] == [1, 4, 7]
    summary = json.loads((run / "summary.json").read_text())
    assert records[-1]["tokens_per_s"] == summary["tokens_per_s"]


def test_warmup_longer_than_run_warns_and_overwrite(capsys, tmp_path):
    run = tmp_path / "r"
    assert main(["train", *RUN, "--warmup-steps", "50", "--run-dir", str(run)]) == 0
    err = capsys.readouterr().err
    assert "warning: optim.warmup_steps=50 is longer than train.steps=7" in err
    first = _records(run)
    assert main(["train", *RUN, "--run-dir", str(run)]) == 2
    assert "holds a run" in capsys.readouterr().err
    assert _records(run) == first
    assert main(["train", *RUN, "--seed", "3", "--overwrite", "--run-dir", str(run)]) == 0
    assert [r["step"] for r in _records(run)] == list(range(1, 8))
    assert _records(run)[0]["loss"] != first[0]["loss"]


def test_tensorboard_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "r"
    assert main(["train", *RUN, "--tensorboard", "--run-dir", str(run)]) == 0
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 8))
    assert abs(loss[-1].value - _records(run)[-1]["loss"]) < 1e-5
    assert [e.step for e in acc.Scalars("eval/loss")] == [3, 6, 7]


def test_a_dry_run_at_lr_0_is_not_warned_about_its_warm_up(tmp_path, capsys):
    """Session-50 user audit: huggingface.md's dry run (`--lr 0`, a step that changes no weight)
    printed "the learning rate never reaches optim.lr=0"; the command's argv through
    `meshtron.cli.main` in this process, as is the control (a rate to reach is still warned
    about): the warning is the config's (config.py), printed on the command's stderr (suite
    time: no child importing torch)."""
    argv = ["train", *RUN, "--warmup-steps", "50"]
    capsys.readouterr()
    assert main([*argv, "--lr", "0", "--run-dir", str(tmp_path / "dry")]) == 0
    err = capsys.readouterr().err
    assert "warmup_steps" not in err, err
    # a rate to reach is still warned about
    capsys.readouterr()
    assert main([*argv, "--lr", "1e-3", "--run-dir", str(tmp_path / "real")]) == 0
    err = capsys.readouterr().err
    assert "never reaches optim.lr=0.001" in err, err


def test_a_resumed_launch_compares_its_own_steps_with_its_plan(resumed_launch):
    """Audit s54: after `--resume` (possibly on another --plan) the closing line's "step time
    (median of steady steps) X s vs planner Y s" and summary.json's measured_step_time_s took
    the median over every attempt's steps, earlier layouts' included, against this launch's
    plan. Now the launch's own steady steps (the resumed one's first step is warm-up);
    step_time_s still spans the run's steps 1..N. The run: conftest.py `resumed_launch`
    (3 steps of a planned 1-rank launch, resumed to 6; also read by test_doctor_timeline.py)."""
    run, said = resumed_launch
    seconds = {r["step"]: r["step_time_s"] for r in _records(run) if "step" in r}
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == 3
    own = statistics.median([seconds[5], seconds[6]])
    assert summary["measured_step_time_s"] == own
    assert summary["step_time_s"] == statistics.median([seconds[s] for s in (2, 3, 5, 6)])
    assert f"step time (median of steady steps) {own:.3f} s vs planner" in said
