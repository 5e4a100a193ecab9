"""Host offload is part of the plan's one-line description (Plan.describe): the `plan` table's
zero cell and `simulate --step`'s plan field show it, so an offloaded plan never reads like
the same knobs without offload."""

from __future__ import annotations

import json

import pytest

from testkit.plan_cli import commands_fixture, plan_cli  # noqa: F401  (fixture)

cli = commands_fixture("meshtron.planner.cli", "meshtron.simulate.cli")
ARGS = ["--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
        "--seq-len", "4096", "--layout", "dp=8", "--zero", "2", "--micro-batch", "2",
        "--recompute", "none"]


def test_plan_table_shows_offload(plan_cli):
    rc, out, err = plan_cli(*ARGS, "--offload", "full", "--top", "1")
    assert rc == 0, err
    row = next(line for line in out.splitlines() if line.startswith("1  "))
    assert "2 offload=full" in row, row
    rc, out, err = plan_cli(*ARGS, "--offload", "none", "--top", "1")  # the control
    assert rc == 0, err
    row = next(line for line in out.splitlines() if line.startswith("1  "))
    assert "offload" not in row, row


def test_simulate_plan_field_shows_offload(cli, tmp_path):
    saved = tmp_path / "plan.toml"
    rc, _, err = cli("plan", *ARGS, "--offload", "full", "--save", str(saved))
    assert rc == 0, err
    rc, out, err = cli("simulate", "--step", "--plan", str(saved), "--json")
    assert rc == 0, err
    plan = json.loads(out)["plan"]
    assert plan.endswith(" offload=full") and "zero=2" in plan, plan


def test_mfu_convention_noted_at_long_context_only(plan_cli):
    rc, out, err = plan_cli("--model", "llama3-70b", "--cluster", "dgx-h100:64",
                            "--global-batch", "32", "--seq-len", "131072", "--top", "1")
    assert rc == 0, err
    text = " ".join(out.split())
    assert ("MFU column: model FLOPs count attention as the full 131072 x 131072 square "
            "(Megatron-LM's and PaLM's convention), 71% of them here; counting the causal "
            "half, the best plan's MFU is ") in text, text
    row = next(line for line in out.splitlines() if line.startswith("1  "))
    full = float(row.split("%")[0].split()[-1])
    causal = float(text.split("the best plan's MFU is ")[1].split("%")[0])
    # 71% of the FLOPs in the square: the causal count drops a 71/2 share of them
    assert causal == pytest.approx(full * (1 - 0.71 / 2), abs=0.3), (full, causal)
    rc, out, err = plan_cli("--model", "llama3-70b", "--cluster", "dgx-h100:64",
                            "--global-batch", "512", "--seq-len", "8192", "--top", "1")
    assert rc == 0, err
    assert "MFU column" not in out  # 13% at 8k: not said


def test_hfu_counts_the_causal_square_the_kernel_runs(plan_cli):
    """Audit 47 item 5: an attention-bound plan (the debug model at 4096 tokens) printed
    MFU 117.2% and HFU 117.2%; HFU now counts the half square causal flash executes."""
    rc, out, err = plan_cli("--model", "debug", "--cluster", "nominal-cpu:2", "--global-batch",
                            "4", "--seq-len", "4096", "--wide")
    assert rc == 0, err
    text = " ".join(out.split())
    rows = [line for line in out.splitlines() if line[:1].isdigit() and "%" in line]
    assert rows, out
    for row in rows:
        mfu, hfu = (float(cell.split()[-1]) for cell in row.split("%")[:2])
        assert mfu > 100 and hfu < 100, row  # MFU: the full square, by its convention
    causal = float(text.split("the best plan's MFU is ")[1].split("%")[0])
    best_hfu = float(rows[0].split("%")[1].split()[-1])
    assert best_hfu == pytest.approx(causal, abs=0.2)  # no recomputation: the causal count
    assert "the HFU column (--wide) counts the FLOPs the kernels execute" in text, text


def test_megatron_zero_2_3_named_as_megatron_fsdp_and_flags_refused_as_typed(plan_cli):
    """Audit 47 item 9: a Megatron-Core plan at zero 3 did not say it means Megatron-FSDP, and
    `--stack megatron` was refused under the field name `flag:`."""
    args = ["--model", "llama3-8b", "--cluster", "dgx-h100:2", "--global-batch", "64",
            "--seq-len", "4096", "--framework", "megatron", "--top", "1"]
    rc, out, err = plan_cli(*args, "--zero", "3")
    assert rc == 0, err
    assert "zero 2 and 3 mean Megatron-FSDP (--use-custom-fsdp" in " ".join(out.split()), out
    rc, out, err = plan_cli(*args, "--zero", "3", "--json")  # and a reader of --json is told
    assert rc == 0, err
    assert any("mean Megatron-FSDP" in n for n in json.loads(out)["conventions"]), out
    rc, out, err = plan_cli(*args, "--zero", "1")  # the distributed optimizer: no note
    assert rc == 0, err
    assert "Megatron-FSDP" not in out
    rc, out, err = plan_cli(*args, "--stack", "megatron")
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].endswith(
        "--stack=megatron: allowed values are eager, fused, compiled"), err


BIG = ["--model", "llama3-405b", "--cluster", "dgx-h100:2048", "--global-batch", "2048",
       "--seq-len", "8192", "--framework", "megatron@2024", "--top", "1"]


def test_tight_plan_is_noted(plan_cli):
    rc, out, err = plan_cli(*BIG)
    assert rc == 0, err
    text = " ".join(out.split())
    row = next(line for line in out.splitlines() if line.startswith("1  "))
    used = float(row.split("/80")[0].split()[-1])
    assert used > 80 - 0.07 * 70, row  # under the 7% spread of ~70 GiB of tensors
    assert ("Tight: plan(s) 1 leave less headroom than the allocator allowance's spread "
            "(plan 1: ") in text, text
    rc, out, err = plan_cli(*BIG, "--layout", "tp=8,pp=16,dp=128", "--recompute", "full",
                            "--schedule", "interleaved:8", "--zero", "1")
    assert rc == 0, err
    row = next(line for line in out.splitlines() if line.startswith("1  "))
    assert float(row.split("/80")[0].split()[-1]) < 40, row  # the control: room to spare
    assert "Tight" not in out
