"""`meshtron simulate`: the step-level simulation against the analytical planner on regular
plans, what it adds (slow GPUs, jitter), the GPU-count sweep, and bad input."""

from __future__ import annotations

import csv
import json
import re

import numpy as np
import pytest

from meshtron.model.spec import resolve_model
from meshtron.planner import resolve_cluster, search_plans
from meshtron.planner.estimate import Evaluator
from meshtron.simulate.schedule import device_orders
from meshtron.simulate.step import Perturbation, simulate_step


def _plan(model: str, cluster: str, batch: int, seq: int, fixed=None):
    m, c = resolve_model(model), resolve_cluster(cluster)
    est = search_plans(m, c, batch, seq, fixed, top_k=1, explain=False).best
    assert est is not None
    return Evaluator(m, c, batch, seq), est


REGULAR = [
    ("llama3-70b", "dgx-h100:16", 1024, 4096, {"tp": 8, "pp": 4, "schedule": "1f1b"}),
    ("llama3-70b", "dgx-h100:16", 1024, 4096, {"tp": 8, "pp": 4, "schedule": "zb"}),
    # GPipe at 256 sequences: at 1024 (64+ micro-batches) the last stage holds every
    # micro-batch's loss tensors (planner/memory_gpipe.py) and no GPipe plan fits
    ("llama3-70b", "dgx-h100:16", 256, 4096, {"tp": 8, "pp": 4, "schedule": "gpipe"}),
    ("llama3-70b", "dgx-h100:16", 1024, 4096,
     {"tp": 8, "pp": 8, "schedule": "interleaved", "virtual_stages": 2}),
    ("llama2-7b", "dgx-a100:4", 256, 4096, {"tp": 1, "pp": 1, "zero": 1}),
    ("llama3-8b", "dgx-h100:8", 512, 4096, {"tp": 2, "pp": 2, "zero": 1, "schedule": "1f1b"}),
    ("llama3-8b", "dgx-h100:8", 512, 4096, {"tp": 1, "pp": 1, "zero": 3}),
]


@pytest.mark.parametrize("model, cluster, batch, seq, fixed", REGULAR)
def test_simulation_agrees_with_planner_on_regular_plans(model, cluster, batch, seq, fixed):
    ev, est = _plan(model, cluster, batch, seq, fixed)
    res = simulate_step(ev, est)
    assert res.classes == 1 and res.events > est.num_microbatches
    assert abs(res.step_time_s / est.step_time_s - 1) < 0.10, (est.config.describe(),
                                                                 res.step_time_s, est.step_time_s)
    assert res.step_time_s >= res.compute_s  # the busiest device's own work is a lower bound


def test_schedules_run_every_operation_once():
    p, v, m = 4, 2, 8
    for sched, vv in (("1f1b", 1), ("gpipe", 1), ("interleaved", v), ("gpipe", v)):
        orders = device_orders(sched, p, vv, m)
        ops = [op for o in orders for op in o]
        assert len(ops) == len(set(ops)) == 2 * p * vv * m
        for s, o in enumerate(orders):
            assert all(j % p == s for _, j, _ in o)
    for vv in (1, 2, 3):  # zero bubble: torch's ZB1P, its V for v = 2 (tests/test_pipeline_zb.py)
        zb = device_orders("zb", p, vv, m)
        assert sorted(op for o in zb for op in o) == sorted(
            (k, j, mb) for k in "FBW" for j in range(p * vv) for mb in range(m))
    # ZB1P fills the last device's 1F1B bubble with weight gradients: W before its last B
    last = device_orders("zb", p, 1, m)[-1]
    assert last.index(("W", p - 1, 0)) < last.index(("B", p - 1, m - 1))


def test_straggler_in_synchronous_data_parallel_job():
    ev, est = _plan("llama2-7b", "dgx-a100:4", 256, 4096, {"tp": 1, "pp": 1, "zero": 1})
    base = simulate_step(ev, est)
    slow = simulate_step(ev, est, Perturbation(stragglers=((5, 1.2),)))
    assert slow.classes == 2 and list(slow.class_counts) == [est.config.dp - 1, 1]
    # every gradient bucket waits for the slow replica: the whole job runs its compute 1.2x
    extra = slow.step_time_s - base.step_time_s
    assert extra == pytest.approx(0.2 * base.compute_s, rel=0.05)
    # the fast replicas end when the slow one does (synchronous collectives)
    assert np.ptp(slow.class_step_s) < 0.01 * slow.step_time_s


def test_straggler_in_a_pipeline_and_jitter():
    ev, est = _plan("llama3-70b", "dgx-h100:16", 1024, 4096, {"tp": 8, "pp": 4, "schedule": "1f1b"})
    base = simulate_step(ev, est)
    stage2 = 2 * est.config.tp * est.config.dp  # first rank of pipeline stage 2
    slow = simulate_step(ev, est, Perturbation(stragglers=((stage2, 1.2),)))
    # the slow stage becomes the pipeline's bottleneck: ~1.2x its m micro-batches
    assert 1.12 < slow.step_time_s / base.step_time_s < 1.22
    means = []
    for sigma in (0.02, 0.1):
        runs = [simulate_step(ev, est, Perturbation(jitter=sigma, seed=k)).step_time_s
                for k in range(3)]
        means.append(np.mean(runs))
    assert base.step_time_s < means[0] < means[1]  # noise costs time, more noise more


def test_sixteen_thousand_ranks_by_symmetry():
    ev, est = _plan("llama3-405b", "dgx-h100:2048", 2048, 8192)
    assert est.config.gpus == 16384
    base = simulate_step(ev, est)
    slow = simulate_step(ev, est, Perturbation(stragglers=((12345, 1.5),)))
    assert base.classes == 1 and slow.classes == 2
    assert slow.step_time_s > base.step_time_s
    # uneven interleaved chunks (126 layers over 96 virtual stages) cost more than the
    # analytical bubble formula's even split assumes, but stay close
    assert 0.95 < base.step_time_s / est.step_time_s < 1.25


# ---- sweep and CLI -----------------------------------------------------------------------------
@pytest.fixture
def sim_cli(monkeypatch, capsys):
    import meshtron.cli as top

    monkeypatch.setattr(top, "COMMAND_MODULES", ["meshtron.simulate.cli"])

    def run(*argv: str) -> tuple[int, str, str]:
        rc = top.main(["simulate", *argv])
        out = capsys.readouterr()
        return rc, out.out, out.err
    return run


def test_sweep_writes_csv_plots_and_finds_the_limit(sim_cli, tmp_path):
    rc, out, err = sim_cli("--model", "llama2-7b", "--cluster", "dgx-a100", "--gpus", "8..256",
                           "--global-batch", "16", "--seq-len", "4096", "--out", str(tmp_path),
                           "--batch-growth", "256", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert {r["series"] for r in rows} == {"fixed", "growing"} and len(rows) == 12
    for name in ("throughput", "scaling_efficiency", "mfu", "marginal"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    fixed = doc["series"]["fixed"]["points"]
    assert fixed[0]["scaling_efficiency"] == 1.0
    # 16 sequences cannot feed 256 GPUs (dp x pp <= 16 with tp <= 8): no plan, nothing gained
    assert fixed[-1]["plan"] == "" and fixed[-1]["marginal"] == 0.0
    assert "batch too small" in fixed[-1]["cause"]
    assert doc["series"]["fixed"]["below_threshold_at"] <= 256
    grow = doc["series"]["growing"]["points"]
    assert grow[-1]["global_batch"] == 256 and grow[-1]["tokens_per_s"] > fixed[-2]["tokens_per_s"]
    # a cause is named wherever per-GPU throughput fell
    for a, b in zip(fixed, fixed[1:]):
        if b["plan"] and b["scaling_efficiency"] < a["scaling_efficiency"] - 0.01:
            assert b["cause"] and not b["cause"].startswith("scales")


def _moves(cause: str) -> dict[str, float]:
    """'name +1.2%' pieces an explanation names (why.py PIECES), as fractions."""
    from meshtron.simulate.why import PIECES

    out = {}
    for key, name in PIECES.items():
        m = re.search(re.escape(name) + r" ([+-]\d+\.\d)%", cause)
        if m:
            out[key] = float(m.group(1)) / 100
    return out


def test_sweep_explains_each_size_from_the_two_plans_priced_pieces(sim_cli, tmp_path):
    """The audit's sweep: at 16 GPUs (efficiency 1.000 -> 1.019, plan tp 2->1) the text blamed
    'batch per GPU too small ... recomputation' for a recompute=none plan, at 32 (up again)
    tensor-parallel communication; a size that scales better now says so and why, and every
    piece named moved as stated between the two plans' priced pieces."""
    argv = ("--model", "llama3-8b", "--gpus", "8..32", "--global-batch", "512", "--seq-len",
            "8192", "--out", str(tmp_path))
    rc, out, err = sim_cli(*argv, "--json")
    assert rc == 0, err
    points = json.loads(out)["series"]["fixed"]["points"]
    for prev, p in zip(points, points[1:]):
        def per_token(q, k):
            return q["pieces_s"].get(k, 0.0) * q["gpus"] / (q["global_batch"] * 8192)

        base = sum(per_token(prev, k) for k in prev["pieces_s"])
        moves = _moves(p["cause"])
        assert moves, p["cause"]
        for key, share in moves.items():
            assert (per_token(p, key) - per_token(prev, key)) / base == pytest.approx(
                share, abs=0.0006), (key, p["cause"])
        head, _, named = p["cause"].partition("): ")
        causes = _moves(named.split(" (against: ")[0])
        better = p["scaling_efficiency"] > prev["scaling_efficiency"]
        assert head.startswith("scales better" if better else "slower per token"), p["cause"]
        assert all((v < 0) == better for v in causes.values()), p["cause"]
        assert "recomputation" not in p["cause"] and "worse" not in p["cause"]
    assert points[1]["plan"].startswith("tp=1") and "plan tp 2->1" in points[1]["cause"]
    assert "tensor-parallel communication -" in points[1]["cause"]
    rc, out, err = sim_cli(*argv)
    assert rc == 0 and "worse" not in out, out


def test_step_cli(sim_cli):
    rc, out, err = sim_cli("--step", "--model", "llama3-8b", "--cluster", "dgx-h100:8",
                           "--global-batch", "512", "--seq-len", "4096", "--straggler", "0:1.3",
                           "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["slowdown"] > 1.05 and doc["perturbed"]["classes"] == 2


def test_step_of_a_saved_plan_needs_nothing_else(sim_cli, tmp_path):
    """`meshtron simulate --step --plan plan.toml` (plan.md, economize.md) takes the model,
    cluster, batch and sequence length from the plan file, as `meshtron cost --plan` does; a
    flag that contradicts the file, a missing size without --plan, and --plan on a sweep are
    one line each, exit 2."""
    path = tmp_path / "plan.toml"
    best = search_plans(resolve_model("llama3-8b"), resolve_cluster("dgx-h100:2"), 64, 4096,
                        None, top_k=1).best  # what `meshtron plan ... --save` writes
    best.to_plan("llama3-8b", "dgx-h100:2", 16, 64, 4096, "flash").save(path)
    rc, out, err = sim_cli("--step", "--plan", str(path), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["ranks"] == 16 and doc["unperturbed"]["step_time_s"] > 0
    for argv, field in ((["--step", "--plan", str(path), "--model", "llama3-70b"], "model="),
                        (["--step", "--model", "llama3-8b", "--cluster", "dgx-h100:1",
                          "--seq-len", "4096"], "--global-batch"),
                        (["--step", "--model", "llama3-8b", "--global-batch", "64",
                          "--seq-len", "4096"], "--cluster"),
                        (["--plan", str(path), "--out", str(tmp_path / "s")], "--step only")):
        rc, out, err = sim_cli(*argv)
        assert rc == 2 and err.count("\n") == 1 and field in err, (argv, err)


def test_step_of_a_plan_that_does_not_fit_is_refused_in_one_line(sim_cli, tmp_path):
    # `meshtron cost --plan` prices it anyway; simulate refuses, and says why and where to go
    from meshtron.planner.plan import Plan

    path = tmp_path / "plan.toml"
    Plan.trusted(1, 1, 16, 0, 1, "none", False, None, 1, "bf16", 1).save(path)
    rc, out, err = sim_cli("--step", "--model", "llama2-7b", "--cluster", "dgx-a100:2",
                           "--global-batch", "256", "--seq-len", "4096", "--plan", str(path))
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "predicted not to fit on dgx-a100:2 (needs " in err and "GiB per GPU > 80 GiB" in err
    assert "simulate refuses a plan that does not fit" in err


def test_step_of_a_plan_the_stack_cannot_split_is_simulated_with_a_warning(sim_cli, tmp_path):
    # 126 layers over pp=32 is not a Megatron-LM 2021 split: priced (and simulated) on
    # Megatron-Core's uneven end stages, one warning on stderr (planner/search_space.py)
    from meshtron.planner.plan import Plan

    path = tmp_path / "plan.toml"
    # zero 0, sp off and pp=32: Megatron-LM 2021 runs no ZeRO (plan_rules_zero) nor sequence
    # parallelism (plan_rules_stack); without sp its states fit at pp=32
    Plan.trusted(8, 32, 2, 0, 1, "full", False, "1f1b", 1, "bf16", 1).save(path)
    rc, out, err = sim_cli("--step", "--model", "llama3-405b", "--cluster", "dgx-h100:64",
                           "--global-batch", "512", "--seq-len", "8192", "--plan", str(path),
                           "--framework", "megatron@2021", "--json")
    assert rc == 0 and json.loads(out)["unperturbed"]
    # the file names no stack (meshtron's runtime): the --framework asked is said, then the split
    stack, split = err.splitlines()
    assert stack.startswith("warning: plan=") and "priced here as megatron@2021" in stack
    assert split.startswith("warning: plan=")
    assert "cannot split" in split and "3," + "4," * 30 + "3" in split


@pytest.mark.parametrize("extra, field", [
    (("--gpus", "abc", "--out", "x"), "gpus='abc'"),
    (("--gpus", "0..8", "--out", "x"), "gpus='0..8'"),
    (("--gpus", "12", "--out", "x"), "gpus=12"),
    (("--step", "--cluster", "dgx-h100:8", "--straggler", "x"), "--straggler"),
    (("--step", "--cluster", "dgx-h100:8", "--straggler", "99999:1.2"), "rank=99999"),
    (("--step", "--cluster", "dgx-h100:8", "--straggler", "0:0.5"), "factor=0.5"),
    (("--step", "--cluster", "dgx-h100:8", "--straggler", "0:1e9"), "factor=1000000000.0"),
    (("--step", "--cluster", "dgx-h100:8", "--jitter", "-1"), "--jitter"),
    (("--gpus", "8..16"), "out"),
    (("--gpus", "-8..16", "--out", "x"), "gpus='-8..16'"),  # was argparse's "expected one"
])
def test_bad_input_is_one_line(sim_cli, extra, field):
    rc, _, err = sim_cli("--model", "llama3-8b", "--global-batch", "512", "--seq-len", "4096",
                         *extra)
    assert rc == 2 and err.count("\n") == 1 and field in err and "Traceback" not in err


def test_a_sweep_where_no_size_gets_a_plan_is_one_line_and_writes_nothing(sim_cli, tmp_path):
    """8 sequences over 64..512 GPUs: no plan at any size. Was a matplotlib traceback (a log
    axis with nothing above 0) after sweep.csv was written."""
    out = tmp_path / "sweep"
    rc, _, err = sim_cli("--model", "tiny", "--global-batch", "8", "--seq-len", "128",
                         "--gpus", "64..512", "--out", str(out))
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "global_batch=8" in err and "64 to 512" in err and "batch too small" in err
    assert not out.exists()


def test_the_sweep_table_prints_a_dash_where_there_is_no_ratio(sim_cli, tmp_path):
    rc, out, err = sim_cli("--model", "tiny", "--global-batch", "16", "--seq-len", "128",
                           "--gpus", "8,16,32", "--out", str(tmp_path))
    assert rc == 0, err
    header = next(line for line in out.splitlines() if "marginal" in line and "GPUs" in line)
    col = header.index("marginal") + len("marginal")  # the column's right edge
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r.split()[0] for r in rows] == ["8", "16", "32"] and "nan" not in out
    assert rows[0][:col].split()[-1] == "-"  # the first size has no previous one
    assert all(float(r[:col].split()[-1]) < 1 for r in rows[1:])
