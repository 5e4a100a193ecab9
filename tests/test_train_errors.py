"""Errors: bad input is one line naming the flag/field and exit code 2, before any work; a
failure inside a step (a torch error) is a traceback and exit code 1, rank-prefixed on
multi-rank runs, never reported as bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron.cli import main

FAULTS = str(Path(__file__).parent / "faults")
RUN = ["--model", "debug", "--steps", "3", "--seq-len", "32", "--global-batch", "8",
       "--eval-every", "0"]


def _meshtron(*argv, env=None, timeout=300):
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "meshtron", *argv], capture_output=True,
                          text=True, timeout=timeout, env=full_env)


def _one_line(capsys, code, needle):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv,needle", [
    (["train", "--nproc", "0"], "argument --nproc: '0'"),
    (["train", "--nproc", "-1"], "argument --nproc: '-1'"),
    (["calibrate", "--nproc", "0"], "argument --nproc: '0'"),
    (["calibrate", "--nproc", "-1"], "argument --nproc: '-1'"),
    (["train", *RUN, "--global-batch", str(10**12)], "data.global_batch=1000000000000"),
    (["train", *RUN, "--set", "model.mlp=gelu", "--set", "model.norm_eps=[1]"],
     "model.norm_eps=[1]"),
    (["train", *RUN, "--set", "model.mlp=relu"], "model.mlp='relu'"),
    (["train", *RUN, "--lr", "nan"], "optim.lr=nan"),
    (["plan", "--model", "tiny", "--cluster", "dgx-h100:1", "--global-batch", "0"],
     "argument --global-batch: '0'"),
    (["nosuchcommand"], "invalid choice"),
    # an empty folder name was read as not given: the run trained and exported nothing
    # (audit s54; --run-dir '' was already refused)
    (["train", *RUN, "--export", ""], "train.export='': must name a folder"),
    (["train", *RUN, "--init-from", " "], "train.init_from=' ': must name a folder"),
    # no layout of 3 CPU ranks (the default batch of 16): the reason keeps its subject, and
    # a CPU run's ranks are not called GPUs (was: "no layout of 3 GPUs runs: ... left out:
    # must be divisible by plan.dp=3": user audit 48b)
    (["train", "--model", "debug", "--nproc", "3"],
     "no layout of 3 devices runs: pure data parallel / ZeRO (tp=1, pp=1) layouts left out: "
     "plan.global_batch=16 (the global batch, sequences per step): must be divisible by "
     "plan.dp=3"),
    # pp=2 on one micro-batch: every schedule refused, as `meshtron plan` says (was: "no plan
    # fits 2 ranks of 4.0 GiB", a memory verdict for a 126K-parameter model; audit s54)
    (["train", "--model", "debug", "--nproc", "2", "--plan", "pp=2", "--global-batch", "2",
      "--micro-batch", "2"],
     "plan='pp=2': no plan of 2 ranks runs for model debug: every schedule / knob point of the "
     "1 valid layout(s) was refused"),
])
def test_bad_flags_are_one_line(capsys, tmp_path, argv, needle):
    if argv[0] == "train":
        argv = argv + ["--run-dir", str(tmp_path / "r")]
    _one_line(capsys, main(argv), needle)
    assert not (tmp_path / "r").exists()


def test_run_dir_that_is_a_file_or_holds_a_run(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    _one_line(capsys, main(["train", *RUN, "--run-dir", str(f)]), "is a file")
    _one_line(capsys, main(["train", *RUN, "--run-dir", str(f / "sub")]), "is a file")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    _one_line(capsys, main(["train", *RUN, "--run-dir", str(run)]), "--overwrite")
    _one_line(capsys, main(["train", *RUN, "--nproc", "2", "--plan", "dp=2",
                            "--run-dir", str(run)]), "--overwrite")
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched


def test_output_paths_that_are_folders_are_refused_before_any_work(capsys, tmp_path):
    _one_line(capsys, main(["plan", "--model", "tiny", "--cluster", "dgx-h100:1",
                            "--save", str(tmp_path)]), "argument --save")
    _one_line(capsys, main(["calibrate", "--out", str(tmp_path)]), "argument --out")
    assert list(tmp_path.iterdir()) == []  # no DIR.tmp, nothing measured or written


@pytest.mark.parametrize("field,value", [
    ("rms_norm_eps", {"a": 1}), ("rms_norm_eps", [1e-5]), ("rms_norm_eps", None),
    ("rope_theta", {}), ("rope_theta", [1.0, 2.0]), ("rope_theta", None),
    ("num_hidden_layers", None), ("tie_word_embeddings", "yes"), ("hidden_act", ["silu"]),
])
def test_config_json_fields_of_the_wrong_type(capsys, tmp_path, field, value):
    doc = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
           "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 300,
           "max_position_embeddings": 128, field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    _one_line(capsys, main(["plan", "--model", str(path), "--cluster", "dgx-h100:1",
                            "--global-batch", "8", "--seq-len", "64"]), field)
    _one_line(capsys, main(["train", "--model", str(path), "--run-dir", str(tmp_path / "r")]),
              field)


def test_saved_plan_sets_the_batch_and_refuses_contradictions(capsys, tmp_path):
    from meshtron.cli import build_parser
    from meshtron.train.cli import job_from_args

    plan = tmp_path / "plan.toml"
    assert main(["plan", "--model", "debug", "--cluster", "dgx-h100:1", "--global-batch", "16",
                 "--seq-len", "64", "--layout", "dp=2", "--save", str(plan)]) == 0
    capsys.readouterr()
    args = build_parser().parse_args(["train", "--plan", str(plan), "--nproc", "2"])
    job = job_from_args(args)
    assert (job.cfg.data.global_batch, job.cfg.data.seq_len) == (16, 64)
    assert job.cfg.model.name == "debug" and job.parallel.plan == str(plan)
    restated = job_from_args(build_parser().parse_args(
        ["train", "--plan", str(plan), "--global-batch", "16", "--seq-len", "64"]))
    assert restated.cfg == job.cfg
    _one_line(capsys, main(["train", "--plan", str(plan), "--nproc", "2", "--seq-len", "32",
                            "--run-dir", str(tmp_path / "r")]), "data.seq_len=32")
    _one_line(capsys, main(["train", "--plan", str(plan), "--nproc", "2", "--set",
                            "data.global_batch=8", "--run-dir", str(tmp_path / "r")]),
              "data.global_batch=8")


@pytest.fixture(scope="module")
def failed_on_two_ranks(tmp_path_factory):
    """`meshtron train --nproc 2 --max-restarts 1` whose every attempt raises a torch error in
    its first step (bad targets, tests/faults): read by the two tests below (one 2-rank
    launch, not one each; suite time)."""
    env = {"PYTHONPATH": os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", "")]),
           "MESHTRON_TEST_BAD_TARGETS_AT": "1"}
    return _meshtron("train", *RUN, "--nproc", "2", "--plan", "dp=2", "--max-restarts", "1",
                     "--run-dir", str(tmp_path_factory.mktemp("failed") / "r"), env=env)


def test_torch_error_in_a_step_is_a_traceback_not_bad_input(tmp_path, failed_on_two_ranks):
    env = {"PYTHONPATH": os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", "")]),
           "MESHTRON_TEST_BAD_TARGETS_AT": "2"}
    single = _meshtron("train", *RUN, "--run-dir", str(tmp_path / "one"), env=env)
    assert single.returncode == 1, single.stderr[-2000:]
    # the fused loss's gather of the target logit raises torch's own index error
    assert "Traceback" in single.stderr and "out of bounds" in single.stderr
    assert "error:" not in single.stderr  # not reported as bad input
    ranks = failed_on_two_ranks
    assert ranks.returncode not in (0, 2), ranks.stderr[-3000:]
    lines = ranks.stderr.splitlines()
    assert any(line.startswith("[rank 0] Traceback") or line.startswith("[rank 1] Traceback")
               for line in lines), ranks.stderr[-3000:]
    assert any("out of bounds" in line and line.startswith("[rank ") for line in lines)
    # the run failed, not "the 2 ranks" (one rank raising is enough: torchrun stops the other)
    assert "meshtron train: the run on 2 ranks failed (exit code 1); the lines above say " \
        "which rank failed and why" in ranks.stderr, ranks.stderr[-3000:]


def test_a_checkpoint_the_disk_refuses_is_one_line_in_one_process(tmp_path):
    """`meshtron train` with its default one process, under a file-size limit below a
    checkpoint (RLIMIT_FSIZE, as `ulimit -f` or a batch system sets it; the kernel answers the
    save with EFBIG, as a full disk answers ENOSPC; no root needed): one line naming the
    OSError, exit 74 as the ranks of `--nproc N` end (was: DCP's tracebacks, exit 1)."""
    import resource

    def _limited() -> None:
        limit = 256 * 1024  # the debug model's checkpoint is ~1.5 MB; the logs stay below
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-m", "meshtron", "train", *RUN, "--checkpoint-every",
                           "2", "--run-dir", str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=300, preexec_fn=_limited,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 74, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "meshtron train: failed: OSError: [Errno 27] File too large (inside "
        "CheckpointException) (a storage error)"), proc.stderr[-3000:]


def test_saved_plan_without_nproc_takes_its_world_size(capsys, tmp_path):
    from meshtron.cli import build_parser
    from meshtron.planner.plan import Plan
    from meshtron.train.cli import job_from_args
    from meshtron.train.planning import local_world_size

    plan = tmp_path / "plan.toml"
    Plan(model="debug", global_batch=16, seq_len=64, tp=1, pp=1, dp=2, zero=0, micro_batch=8,
         recompute="none", sp=False, dtype="fp32").save(plan)
    job = job_from_args(build_parser().parse_args(["train", "--plan", str(plan)]))
    assert job.parallel.nproc is None and local_world_size(job.parallel) == 2
    capsys.readouterr()
    # an explicit --nproc that contradicts the plan is still one clear line
    _one_line(capsys, main(["train", "--plan", str(plan), "--nproc", "4",
                            "--run-dir", str(tmp_path / "r")]), "world size")


def test_unwritable_output_paths_are_one_line_and_write_nothing(capsys, tmp_path):
    import tomli_w

    from meshtron.config import config_from_dict

    _one_line(capsys, main(["train", *RUN, "--run-dir", "/proc/nope"]), "train.run_dir")
    _one_line(capsys, main(["calibrate", "--out", "/proc/x.toml"]), "--out")
    run = tmp_path / "run"
    run.mkdir()
    cfg = config_from_dict({"model": "debug", "data": {"seq_len": 32}})
    (run / "run.toml").write_text(tomli_w.dumps(cfg.to_toml_dict()))
    _one_line(capsys, main(["export", str(run), "--to", "/proc/x"]), "export --to")
    assert not Path("/proc/nope").exists() and not Path("/proc/x").exists()
    assert sorted(p.name for p in run.iterdir()) == ["run.toml"]


def test_folders_and_missing_files_are_named_as_such(capsys, tmp_path):
    _one_line(capsys, main(["train", "--config", str(tmp_path)]), "is a folder")
    _one_line(capsys, main(["plan", "--model", "tiny", "--cluster", str(tmp_path)]),
              "is a folder")
    _one_line(capsys, main(["plan", "--model", str(tmp_path), "--cluster", "dgx-h100:1"]),
              "holds no config.json")
    _one_line(capsys, main(["plan", "--model", str(tmp_path / "c.json"), "--cluster",
                            "dgx-h100:1"]), "file does not exist")
    _one_line(capsys, main(["plan", "--model", "tiniest", "--cluster", "dgx-h100:1"]),
              "unknown preset")


@pytest.mark.parametrize("name", ["debug", "tiny", "tiny-gpt", "llama3-8b"])
def test_every_preset_runs_with_the_defaults_and_with_bpe(name, tmp_path):
    from meshtron.cli import build_parser
    from meshtron.config import DataConfig
    from meshtron.model.spec import PRESETS
    from meshtron.train.cli import job_from_args

    job = job_from_args(build_parser().parse_args(["train", "--model", name]))
    assert job.cfg.data.seq_len == min(DataConfig.seq_len, PRESETS[name].max_seq)
    bpe = job_from_args(build_parser().parse_args(["train", "--model", name, "--tokenizer",
                                                   "bpe"])).cfg
    assert bpe.model.vocab == max(PRESETS[name].vocab, bpe.data.bpe_vocab)
    assert {**bpe.model.to_dict(), "vocab": 0} == {**PRESETS[name].to_dict(), "vocab": 0}


@pytest.mark.slow
def test_a_killed_rank_is_one_line_per_rank_not_tracebacks(tmp_path):
    """SIGKILL one rank of a 2-rank run without restarts: the survivor says its peer is gone,
    torchrun names each rank's end, no traceback (a real bug keeps its traceback: above)."""
    import signal
    import time

    run_dir = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-m", "meshtron", "train", *RUN[:2], "--steps",
                             "2000", *RUN[4:], "--nproc", "2", "--plan", "dp=2", "--run-dir",
                             str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    victim = None
    for d in Path("/proc").iterdir():
        try:
            env = dict(x.split(b"=", 1) for x in (d / "environ").read_bytes().split(b"\0")
                       if b"=" in x)
        except OSError:
            continue
        if str(run_dir).encode() in env.get(b"MESHTRON_RANK_ARGV", b"") \
                and env.get(b"RANK") == b"1":
            victim = int(d.name)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "torchrun: rank 1" in out and "killed by SIGKILL" in out, out[-3000:]
    assert "closing signal" not in out and "failed (exitcode" not in out, out[-3000:]
    # rank 0 notices first (one line), or torchrun stops it first (its line names rank 0)
    assert ("meshtron train (rank 0): stopped: a peer rank is gone" in out
            or "torchrun: rank 0" in out), out[-3000:]
    for line in out.splitlines():  # the cause cut at a sentence, the run folder named
        if "stopped: a peer rank is gone" in line:
            assert line.endswith(f"(trace: meshtron doctor {run_dir})"), line


def test_a_model_that_cannot_fit_one_process_is_refused_before_the_run_folder(capsys, tmp_path):
    """Audit s54: `meshtron train --model llama3-8b` in one process on a 23 GiB CPU machine
    built the model until the allocator failed (a traceback, run.toml and config.json left in
    the run folder; without a memory limit, the OOM killer). Weights, gradients and AdamW
    state alone (16 B a parameter in fp32) above the device's memory: one line, nothing
    written. A vocabulary of 1e12 makes 1.9 PiB: more than any machine this runs on (and
    without the check its first tensor fails at once, never filling the memory)."""
    run = tmp_path / "r"
    line = _one_line(capsys, main(["train", "--model", "debug", "--set",
                                   "model.vocab=1000000000000", "--steps", "1", "--run-dir",
                                   str(run)]),
                     "model=debug-custom: one process needs at least 1,907,348.6 GiB for its "
                     "weights, gradients and AdamW state (128,000,000,092,480 parameters x 16 B")
    assert not run.exists()
    if Path("/proc/meminfo").is_file():  # what it compares with: the memory available now
        assert " GiB available (MemAvailable, /proc/meminfo) of " in line, line


def test_the_memory_floor_reads_a_gpus_free_memory_and_counts_the_bf16_copy():
    """The CUDA branch by injection (the device API local_device injects too): a GPU's free
    memory (cudaMemGetInfo) is the limit, not its total (audit s54, finding 5), and a bf16
    run's compute copy adds 2 B a parameter."""
    import types

    import torch

    from meshtron.config import config_from_dict
    from meshtron.errors import UserError
    from meshtron.train.local_memory import DeviceMemory, check_fits, device_memory

    gpu = types.SimpleNamespace(mem_get_info=lambda device: (30 * 2**30, 80 * 2**30))
    got = device_memory(torch.device("cuda", 0), gpu=gpu)
    assert (got.available, got.total) == (30 * 2**30, 80 * 2**30)
    assert got.source == "free (torch.cuda.mem_get_info)"
    cfg = config_from_dict({"model": "debug", "train": {"dtype": "bf16"}})
    need = cfg.model.num_params() * 18
    check_fits(cfg, torch.device("cpu"), DeviceMemory(need, None, "x"))  # exactly enough
    with pytest.raises(UserError, match=r"x 18 B, train.dtype=bf16\), more than this cpu's"):
        check_fits(cfg, torch.device("cpu"), DeviceMemory(need - 1, None, "x"))
    with pytest.raises(UserError, match=r"more than this cuda's 0\.0 GiB free "
                                        r"\(torch\.cuda\.mem_get_info\) of 80\.0 GiB"):
        check_fits(cfg, torch.device("cuda", 0),
                   device_memory(torch.device("cuda", 0), gpu=types.SimpleNamespace(
                       mem_get_info=lambda device: (need - 1, 80 * 2**30))))


def test_the_memory_floor_reads_memavailable_not_the_total(tmp_path):
    """On a CPU the limit is the kernel's MemAvailable (a shared machine's other jobs hold the
    rest; audit s54, finding 5), read from the file the kernel writes in kB."""
    import torch

    from meshtron.train.local_memory import device_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\n"
                       "MemAvailable:    5000000 kB\nBuffers:          100 kB\n")
    no_cgroup = (tmp_path / "no-cgroup", tmp_path)  # this machine's own limit left out
    got = device_memory(torch.device("cpu"), meminfo=meminfo, cgroup=no_cgroup)
    assert got.available == 5000000 * 1024 and got.source == f"available (MemAvailable, {meminfo})"
    assert got.total == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    none = device_memory(torch.device("cpu"), meminfo=tmp_path / "absent",
                         cgroup=no_cgroup)  # not Linux
    assert none.available == none.total and none.source == "physical (no MemAvailable)"


def test_the_memory_floor_is_at_most_the_control_groups_limit(tmp_path):
    """Review s55: in a container run with a memory limit (a Slurm job's cgroup) MemAvailable
    is the host's: a one-process run the group cannot hold passed the floor and met the OOM
    killer. The group's limit (cgroup v2's memory.max here) caps what is available, and the
    refusal says which figure it read."""
    import torch

    from meshtron.config import config_from_dict
    from meshtron.errors import UserError
    from meshtron.train.local_memory import check_fits, device_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    5000000 kB\n")
    (tmp_path / "cgroup").write_text("0::/job\n")
    (tmp_path / "sys" / "job").mkdir(parents=True)
    (tmp_path / "sys" / "job" / "memory.max").write_text("1048576\n")  # 1 MiB
    got = device_memory(torch.device("cpu"), meminfo=meminfo,
                        cgroup=(tmp_path / "cgroup", tmp_path / "sys"))
    assert got.available == 2**20, got
    assert got.source == "allowed by this process's control group (its memory limit)"
    cfg = config_from_dict({"model": "debug"})  # 125,632 parameters x 16 B: 1.9 MiB
    with pytest.raises(UserError, match=r"more than this cpu's 0\.0 GiB allowed by this "
                                        r"process's control group \(its memory limit\)"):
        check_fits(cfg, torch.device("cpu"), got)


def test_a_restart_before_any_logged_step_says_so(failed_on_two_ranks):
    """Audit s55: a rank that failed before its first step under --max-restarts made the
    restart line read 'resumed from step 0, None logged step(s) lost'. The fault (bad targets
    in every attempt's first batch: torch raises in the step) fails both attempts."""
    ranks = failed_on_two_ranks
    assert ranks.returncode == 1, ranks.stderr[-3000:]
    # and said before the run: restarts without checkpoints start over (audit s55)
    assert ("meshtron train: warning: --max-restarts 1 without --checkpoint-every: a restart "
            "starts over from step 0 (no checkpoint to resume from)") in ranks.stderr
    line = next((x for x in ranks.stderr.splitlines() if "restart 1 (torchrun):" in x), "")
    assert line.endswith("; started again from step 0 (no step had been logged)"), \
        ranks.stderr[-3000:]
    assert "None" not in ranks.stderr, ranks.stderr[-3000:]
