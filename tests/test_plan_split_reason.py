"""`meshtron plan` says why a pipelined plan's layers are split as they are (report.split_json,
search_explain.split_text): the stack's rule with the end stages' extra work, memory, or
Megatron-Core's account_for_embedding/loss split of the Llama 3 rows; in the text (an
"Uneven split:" line) and in --json (each plan's "split")."""

from __future__ import annotations

import json

from testkit.plan_cli import plan_cli  # noqa: F401  (fixture)

# pinned to 1F1B at micro-batch 1: a split that memory leaves alone (the open search picks a
# zero-bubble plan whose last stage holds p micro-batches' chunked loss: split for memory)
EIGHT_B = ("--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
           "--seq-len", "4096", "--layout", "tp=1,pp=8", "--schedule", "1f1b",
           "--micro-batch", "1", "--top", "1")
SEVENTY_B = ("--model", "llama3-70b", "--cluster", "dgx-h100:4", "--global-batch", "256",
             "--seq-len", "4096", "--layout", "tp=4,pp=4,dp=2", "--zero", "1", "--recompute",
             "half", "--micro-batch", "1", "--schedule", "1f1b", "--sp", "on", "--top", "1")


def _best(plan_cli, *argv):
    rc, out, err = plan_cli(*argv, "--json")
    assert rc == 0, err
    plan = json.loads(out)["plans"][0]
    pp, chunks = plan["pp"], plan["stage_layers"]  # pipeline order
    if plan["schedule"] == "zb" and plan["virtual_stages"] == 2:  # torch's V: r and 2pp-1-r
        per_rank = [chunks[r] + chunks[2 * pp - 1 - r] for r in range(pp)]
    else:
        per_rank = [sum(chunks[r::pp]) for r in range(pp)]
    assert plan["split"]["layers_per_stage"] == per_rank
    assert plan["split"]["even"] == (len(set(per_rank)) == 1)
    return plan, per_rank


def test_the_time_balanced_split_says_what_unbalances_the_end_stages(plan_cli):
    plan, per_rank = _best(plan_cli, *EIGHT_B)
    why = plan["split"]["why"]
    assert not plan["split"]["even"] and why.startswith("/".join(map(str, per_rank)))
    assert "time-balanced split" in why and "the output head and loss" in why
    # the head outweighs a layer, so the last stage holds fewer than the middle ones
    assert per_rank[-1] < max(per_rank[1:-1])
    rc, out, _ = plan_cli(*EIGHT_B)
    assert rc == 0
    text = " ".join(out.split())  # rich wraps the line
    assert f"Uneven split: {'/'.join(map(str, per_rank))} layers per stage" in text


def test_a_split_chosen_for_memory_names_the_split_that_did_not_fit(plan_cli):
    plan, per_rank = _best(plan_cli, *SEVENTY_B)
    why = plan["split"]["why"]
    assert "chosen for memory" in why, why
    # the rule's own split, named in the text, is even (80 layers, 4 stages); memory moved
    # layers off the stage it overfilled
    assert "gives 20/20/20/20, over the memory of stage 0" in why
    assert per_rank[0] < 20 and sum(per_rank) == 80


def test_an_even_split_prints_no_uneven_line(plan_cli):
    argv = ("--model", "llama3-70b", "--cluster", "dgx-h100:4", "--global-batch", "256",
            "--seq-len", "4096", "--layout", "tp=8,pp=4,dp=1", "--zero", "0", "--recompute",
            "none", "--micro-batch", "1", "--schedule", "1f1b", "--sp", "on", "--top", "1")
    plan, per_rank = _best(plan_cli, *argv)
    assert per_rank == [20] * 4 and plan["split"]["even"]
    assert plan["split"]["why"].endswith("time-balanced split (pipeline.partition_layers: "
                                         "meshtron's and torchtitan's stages take any layers), "
                                         "even")
    rc, out, _ = plan_cli(*argv)
    assert rc == 0 and "Uneven split" not in out and "Layers per pipeline rank" in out


def test_llama3s_end_stages_one_layer_short_are_explained(plan_cli, tmp_path):
    # Llama 3 paper section 3.3.2 (the row's split: Megatron-Core's
    # account_for_embedding/loss_in_pipeline_split, bench/published/rows_pytorch.py)
    import bench.planner_cli_table as table
    from bench.published.runs import published_runs

    run = next(r for r in published_runs() if r.name == "Llama3 405B 8192")
    plan, per_rank = _best(plan_cli, *table._args(run, tmp_path)[1:])
    assert per_rank == [7] + [8] * 14 + [7]
    why = plan["split"]["why"]
    assert "account_for_embedding/loss_in_pipeline_split" in why
    assert "the end stages hold one layer fewer" in why


def test_torchs_v_counts_each_ranks_two_stages_and_the_head_beside_the_embedding(plan_cli):
    # ScheduleZBVZeroBubble: rank r holds stages r and 2pp-1-r, the head on rank 0
    # (pipeline.stages_of_rank, head_rank)
    argv = ("--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
            "--seq-len", "4096", "--layout", "tp=2,pp=4", "--schedule", "zbv", "--top", "1")
    plan, per_rank = _best(plan_cli, *argv)
    assert plan["virtual_stages"] == 2 and sum(per_rank) == 32
    assert per_rank[0] < min(per_rank[1:])  # rank 0 runs the embedding and the head
    assert "on torch's V, the output head and loss" in plan["split"]["why"]
    rc, out, _ = plan_cli(*argv)
    text = " ".join(out.split())
    assert f"Layers per pipeline rank of the best plan: {per_rank}" in text
    assert "LM head + loss on the first stage (torch's V)" in text
