"""The run's records (meshtron/train/job.py `write_run_records`) on real files: a write that
fails part-way leaves the earlier run.toml whole, and an elastic job's first round writes its
own run.toml over an --overwrite-n run's (no process group: rank 0's part of the round)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from meshtron.cli import build_parser
from meshtron.config import load_toml
from meshtron.train.cli import job_from_args
from meshtron.train.job import write_run_file

TINY = ["--seq-len", "32", "--global-batch", "4", "--eval-every", "0", "--steps", "2"]


def _job(*argv):
    return job_from_args(build_parser("train").parse_args(["train", *TINY, *argv]))


def test_a_failed_write_leaves_the_earlier_run_toml_whole(tmp_path):
    """The process may write 64 bytes a file (RLIMIT_FSIZE; SIGXFSZ ignored, so the write
    fails with EFBIG as on a full disk): the new run.toml cannot be written, and the folder
    keeps the earlier run's, whole, with no partial file beside it."""
    run = tmp_path / "run"
    run.mkdir()
    write_run_file(_job("--model", "debug", "--run-dir", str(run)), run / "run.toml")
    before = (run / "run.toml").read_text()
    script = textwrap.dedent(f"""
        import errno, resource, signal
        from meshtron.cli import build_parser
        from meshtron.train.cli import job_from_args
        from meshtron.train.job import write_run_records
        argv = ["train", *{TINY!r}, "--model", "tiny", "--run-dir", {str(run)!r}]
        job = job_from_args(build_parser("train").parse_args(argv))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
        try:
            write_run_records(job, None)
        except OSError as exc:
            print("refused", exc.errno == errno.EFBIG)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["refused", "True"]
    assert (run / "run.toml").read_text() == before
    assert sorted(p.name for p in run.iterdir()) == ["run.toml"]


def test_elastic_first_round_writes_its_run_toml_over_an_earlier_runs(tmp_path, monkeypatch):
    """An elastic job started with --overwrite on a folder of another model's run: rank 0's
    claim of the folder (elastic.py `_claim_run_dir`, the first round) leaves this job's
    run.toml (what export and --resume read) and no plan.toml of the earlier run."""
    from meshtron.train import elastic

    run = tmp_path / "run"
    run.mkdir()
    write_run_file(_job("--model", "debug", "--run-dir", str(run)), run / "run.toml")
    (run / "plan.toml").write_text('tp = 1\npp = 1\ndp = 4\n')
    node = _job("--model", "tiny", "--run-dir", str(run), "--nnodes", "1:2", "--nproc", "1",
                "--overwrite")
    write_run_file(node, tmp_path / "run_file.toml")  # the node's (elastic.launch_node)
    rank = job_from_args(build_parser("train").parse_args(
        elastic.rank_argv(node, tmp_path / "run_file.toml", node.elastic)))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "review44")
    assert elastic._claim_run_dir(rank) is False  # a new job, not a later round
    assert load_toml(run / "run.toml", "run.toml")["model"]["name"] == "tiny"
    assert not (run / "plan.toml").exists()
    assert elastic._claim_run_dir(rank) is True  # the next round of the same job
