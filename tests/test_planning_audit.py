"""Defects a user's audit of the planning commands found (session 52), each run as the user
typed it, through `meshtron.cli.main` in this process (no command here trains): before the fix
each answered without complaint, or with a traceback, what the test now expects."""

from __future__ import annotations

import json
import re

import pytest

from meshtron.cli import main
from testkit.plan_cli import refused

SMALL = ["--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
         "--seq-len", "4096"]


@pytest.fixture
def saved(tmp_path, capsys) -> str:
    """`meshtron plan ... --save plan.toml` for Llama-3-8B on one DGX H100 node."""
    path = tmp_path / "plan.toml"
    assert main(["plan", *SMALL, "--top", "1", "--save", str(path)]) == 0
    capsys.readouterr()
    return str(path)


@pytest.mark.parametrize("command", [["cost"], ["simulate", "--step"]])
@pytest.mark.parametrize("flag, value, saved_as", [("--global-batch", "32", "global_batch 64"),
                                                    ("--seq-len", "2048", "seq_len 4096")])
def test_a_batch_or_length_the_saved_plan_does_not_hold_is_refused(capsys, saved, command, flag,
                                                                    value, saved_as):
    """`cost --plan plan.toml --global-batch 32` priced a 32-sequence step under the plan's
    name (exit 0), and blamed the gap to the file's [predicted] on a missing --framework
    ("saved before plans recorded their stack?"); `rehearse --plan` refuses the same flag."""
    line = refused(capsys, *command, "--plan", saved, flag, value)
    assert f"{flag[2:]}={int(value)!r}: contradicts the plan" in line and saved_as in line, line


@pytest.mark.parametrize("command", [["cost"], ["simulate", "--step"]])
def test_restating_the_saved_batch_and_length_is_accepted(capsys, saved, command):
    assert main([*command, "--plan", saved, "--global-batch", "64", "--seq-len", "4096"]) == 0
    out, err = capsys.readouterr()
    assert "Plan: " in out and "re-priced" not in err, err


def _counting_walks(monkeypatch) -> list[int]:
    """The micro-batch count of every schedule walk the planner runs from now on (a walk of n
    micro-batches costs O(n): their sum is the walks' cost)."""
    from meshtron.planner import pipeline_zb

    walked: list[int] = []
    real = pipeline_zb._ends

    def ends(p, v, m, *args, **kwargs):
        walked.append(m)
        return real(p, v, m, *args, **kwargs)

    monkeypatch.setattr(pipeline_zb, "_ends", ends)
    for memo in (pipeline_zb._span_and_shift, pipeline_zb._rank_chains, pipeline_zb._program,
                 pipeline_zb.interleaved_bubble, pipeline_zb.stage_bubble,
                 pipeline_zb.chunk_bubble):
        memo.cache_clear()
    return walked


def test_an_unsettled_interleaved_idle_costs_a_few_walks_of_the_step(monkeypatch):
    """Llama-3-70B's chunks on pp=8 x interleaved:3 (the embedding on stage 0, the head on the
    last), 1024 micro-batches: the idle never settles, and the walks of 2p, 3p, ... p more at a
    time up to m cost 66,040 walked micro-batches (quadratic in m); doubling between checks
    cost a few walks of m; the idle grows by the same every round, carried to m from walks of
    a few rounds: fewer than m in all, for the same answer as the walk of all m."""
    from meshtron.planner import pipeline_zb

    walked = _counting_walks(monkeypatch)
    p, v, m = 8, 3, 1024
    layers = [2, 4, 4, 4, 4, 4, 4, 3, 2, 4, 4, 4, 4, 4, 4, 3, 1, 3, 3, 3, 3, 3, 3, 3]
    f = tuple(n * 0.0527 + (0.0008 if s == 0 else 0.0) + (0.2285 if s == p * v - 1 else 0.0)
              for s, n in enumerate(layers))
    b = tuple(2.084 * x for x in f)
    got = pipeline_zb.interleaved_bubble(m, f, b, p)
    assert sum(walked) <= m, walked  # rounds of p, the idle's growth per round carried to m
    worst = max(sum(f[s] + b[s] for s in range(r, p * v, p)) for r in range(p))
    full = pipeline_zb.walk(p, v, m, list(f), list(b), [0.0] * (p * v),
                            schedule="interleaved") - m * worst
    assert full > 100 and got == pytest.approx(full, rel=1e-12)


def test_a_pinned_interleaved_layout_of_many_micro_batches_answers_in_seconds(monkeypatch,
                                                                              capsys):
    """`meshtron plan --model llama3-70b --cluster dgx-h100:2 --global-batch 1024 --seq-len
    8192` ran for minutes (16 GPUs, up to 1024 micro-batches per step); this pinned layout of
    it took 48 s on a loaded 2-core machine (694,680 walked micro-batches), 4 s after doubling
    the walks (session 48: 142,000 walked micro-batches); 21,424 once the walk of a few rounds
    is carried to m by the shift a round adds (session 54)."""
    walked = _counting_walks(monkeypatch)
    assert main(["plan", "--model", "llama3-70b", "--cluster", "dgx-h100:2", "--global-batch",
                 "1024", "--seq-len", "8192", "--layout", "tp=2,pp=8,dp=1", "--schedule",
                 "interleaved:5", "--micro-batch", "1", "--json"]) == 0
    assert '"step_time_s"' in capsys.readouterr().out
    # no walk of the step's 1024 micro-batches: 6 rounds of p = 8, doubled while a round
    # does not yet shift every operation alike (21,424 in all, the longest 384)
    assert max(walked) < 1024 and sum(walked) < 30_000, (len(walked), sum(walked))


def test_a_multimodal_config_points_at_its_text_model(capsys, tmp_path):
    """google/gemma-3-27b-pt's config.json is model_type 'gemma3' with the language model under
    text_config ('gemma3_text', a type meshtron reads): it was refused as an unknown type, with
    the list of supported types (gemma3_text among them) and no word of text_config."""
    import json

    text = {"model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
            "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
            "num_hidden_layers": 62, "query_pre_attn_scalar": 168, "sliding_window": 1024,
            "vocab_size": 262208}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                "model_type": "gemma3", "text_config": text,
                                "vision_config": {"model_type": "siglip_vision_model"}}))
    line = refused(capsys, "plan", "--model", path, "--cluster", "dgx-h100:8")
    assert "model_type='gemma3': a multimodal model" in line and "text_config" in line, line
    alone = tmp_path / "text" / "config.json"
    alone.parent.mkdir()
    alone.write_text(json.dumps(text))  # what the line says to do: planned
    assert main(["plan", "--model", str(alone), "--cluster", "dgx-h100:8", "--global-batch",
                 "512", "--seq-len", "8192", "--top", "1"]) == 0
    assert "27B params" in capsys.readouterr().out


def test_a_batch_no_layout_takes_names_the_smallest_one_that_runs(capsys):
    """`plan --global-batch 8` on 4096 GPUs advised, for 3D layouts, "use a multiple of 1024":
    the dp of the first layout tried (pp=2), while pp=32 leaves dp=16. The advice is now the
    smallest global batch a layout of each family takes, and that batch runs there."""
    line = refused(capsys, "plan", "--model", "llama3-8b", "--cluster", "dgx-h100:512",
                   "--global-batch", "8")
    assert "use a multiple of 1024" not in line, line
    notes = dict(part.split(" layouts left out: ", 1) for part in re.split(
        r"; (?=[^;]* layouts left out: )", line.split("runs: ", 1)[1]))
    smallest = {"3D: tensor x pipeline x data": "16 (tp=8, pp=32, dp=16: the smallest",
                "pipeline + data parallel (tp=1)": "128 (tp=1, pp=32, dp=128: the smallest",
                "tensor + data parallel (pp=1)": "512 (tp=8, pp=1, dp=512: the smallest",
                "pure data parallel / ZeRO (tp=1, pp=1)": "4096"}  # one layout: its own dp
    for family, advice in smallest.items():
        assert f"use a multiple of {advice}" in notes[family], (family, line)
    assert "plan.dp (16 to 1024 in these layouts)" in notes["3D: tensor x pipeline x data"]
    # the advice holds: that batch on that layout is priced (gpipe: 1F1B would need 32
    # micro-batches of one sequence per step)
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:512", "--global-batch",
                 "16", "--layout", "tp=8,pp=32,dp=16", "--schedule", "gpipe", "--top", "1"]) == 0


def _tflops_cells(out: str) -> list[str]:
    """The 'TFLOP/s mdl/hw' cells of `plan --wide`'s table (the third last column)."""
    rows = [line.split() for line in out.splitlines() if line[:2] in ("1 ", "2 ", "3 ")]
    return [row[-3] for row in rows if "/" in row[-3]]


def test_a_cpu_clusters_tflops_are_not_cut_to_zero(capsys):
    """`plan --wide` on a CPU cluster printed TFLOP/s mdl/hw as '0/0' (0.05 rounded to a whole
    number); GPU figures keep their whole numbers."""
    argv = ["plan", "--model", "tiny", "--cluster", "nominal-cpu:2", "--global-batch", "8"]
    assert main([*argv, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]
    assert main([*argv, "--wide"]) == 0
    cells = _tflops_cells(capsys.readouterr().out)
    assert cells[0] == (f"{best['model_tflops_per_gpu']:.2g}/"
                        f"{best['hardware_tflops_per_gpu']:.2g}"), cells
    assert all(c != "0/0" for c in cells)
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch",
                 "64", "--seq-len", "4096", "--wide"]) == 0
    gpu = _tflops_cells(capsys.readouterr().out)
    assert gpu and all(re.fullmatch(r"\d{2,3}/\d{2,3}", c) for c in gpu), gpu


def test_a_small_models_memory_columns_are_not_cut_to_zero(capsys):
    """`plan --wide`'s memory cells p/g/o/act/total printed '0.0' for a small model's
    parameters (0.00047 GiB); they keep two significant digits below 0.1 GiB, one decimal
    above, the same values as --json's."""
    argv = ["plan", "--model", "debug", "--cluster", "dgx-h100:1", "--global-batch", "8",
            "--seq-len", "32"]
    assert main([*argv, "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["plans"][0]["memory_gib"]
    assert main([*argv, "--wide"]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines()
               if line.startswith("1 "))
    cell = next(c for c in row if c.count("/") == 5)
    params, grads, optimizer = (float(x) for x in cell.split("/")[:3])
    assert params == pytest.approx(memory["params"], rel=0.05) and params > 0, (cell, memory)
    assert optimizer == pytest.approx(memory["optimizer"], rel=0.05), (cell, memory)


def test_a_gemma3_text_config_without_vocab_size_reads_the_class_default(capsys, tmp_path):
    """transformers' Gemma3TextConfig defaults vocab_size to 262208; a config.json of model_type
    gemma3_text without the key was refused ("vocab_size: missing")."""
    text = {"model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
            "num_hidden_layers": 26, "query_pre_attn_scalar": 256, "sliding_window": 512}
    answers = []
    for cfg in (text, dict(text, vocab_size=262208)):
        path = tmp_path / str(len(cfg)) / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(cfg))
        assert main(["plan", "--model", str(path), "--cluster", "dgx-h100:1", "--global-batch",
                     "64", "--seq-len", "4096", "--top", "1", "--json"]) == 0, \
            capsys.readouterr().err
        answer = json.loads(capsys.readouterr().out)
        answer["model"].pop("name")  # the folder's name
        answers.append((answer["model"], answer["plans"]))
    assert answers[0] == answers[1] and answers[0][0]["vocab"] == 262208, answers[0][0]
