"""The zero-bubble W gradients a stack holds to its next B, or not (MemoryOptions.
fold_after_weight_pass): meshtron's runtime folds them into FSDP2's fp32 accumulator at W's end
(parallel/pipeline.py `fold_weight_grads`), torchtitan runs torch's schedule unchanged and holds
them until the next B's post_backward (planner/memory_zb.py `pending`)."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.errors import UserError
from meshtron.model.spec import PRESETS as MODELS
from meshtron.planner import memory_zb
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import preset
from meshtron.planner.memory import MemoryOptions
from meshtron.planner.memory_states import layer_params_local
from meshtron.planner.plan import Plan

PLAN = dict(tp=2, pp=2, dp=8, zero=1, micro_batch=1, recompute="none", sp=True, dtype="bf16",
            schedule="zbv")
MODEL = MODELS["llama3-8b"]
PENDING = 2.0 * layer_params_local(MODEL, 2, 1)  # W's bf16 gradients per layer, tp 2
# FSDP2's largest unit on the V's rank 0 at tp 2, [final norm, head]: its bf16 gradient
HEAD_UNIT = 2.0 * (MODEL.vocab // 2 + 1) * MODEL.hidden


def _rank0(fw, fold: bool) -> tuple[float, int]:
    """(bytes in flight the planner puts on the V's rank 0 (stages 0 and 3) of Llama 3 8B,
    32 x 4096 on 32 H100s, under preset `fw` with fold_after_weight_pass = `fold`; the layers
    of stage 3)."""
    mem = dataclasses.replace(fw.memory, fold_after_weight_pass=fold)
    ev = Evaluator(MODEL, resolve_cluster("dgx-h100:4"), 64, 4096, fw.kernel, mem=mem)
    r = ev.evaluate(Plan(**PLAN), stage=0)
    return r.memory.in_flight * 2**30, r.stage_layers[3]


def test_presets_say_which_stack_folds_after_w():
    assert preset("meshtron").memory.fold_after_weight_pass is True
    assert preset("torchtitan").memory.fold_after_weight_pass is False


def test_meshtron_and_torchtitan_differ_by_the_pending_gradients():
    """The V's rank 0 peaks as stage 3's B starts (its loss): torch's schedule still holds
    stage 3's bf16 weight gradients from its previous W there (FSDP2 folds them in that B's
    post_backward), meshtron's runtime folded them at that W's end. Each preset with the
    other's option: the figure moves by those gradients, 2 bytes per local parameter of
    stage 3's layers, and by the head unit's, which the previous W left beside them
    unfolded and no B makes (memory_zb.held's `idle`), less what the receive buffers' count
    and the next moment take back (under 1%); the same for both presets."""
    moved = []
    for name in ("meshtron", "torchtitan"):
        fw = preset(name)
        held, layers = _rank0(fw, False)
        folded, _ = _rank0(fw, True)
        dropped = layers * PENDING + HEAD_UNIT
        assert 0.99 * dropped < held - folded <= dropped * (1 + 1e-12), name
        moved.append(held - folded)
    assert moved[0] == pytest.approx(moved[1], rel=1e-3)


def test_walk_drops_exactly_the_pending_gradients_at_the_loss():
    """On the walk itself (memory_zb.held, Llama 3 8B's terms at tp 2, 8 micro-batches, 8
    layers per stage): a rank holding the last stage peaks as its B starts (the logits' loss
    moment: 3 GiB of logits beyond a block's working set, as the memory model's at long
    sequences), torch's schedule beside that stage's waiting
    gradients; folded, the same moment without them: exactly 8 layers' pending gradients
    less, nothing else, on the V's rank 0 and on ZB1P's last rank."""
    from meshtron.planner import memory_pipeline

    ev = Evaluator(MODEL, resolve_cluster("dgx-h100:4"), 64, 4096)
    act = ev._memory_pieces(2, 1, True, "none", "bf16", 1, 1, 2)[1]
    grad = memory_zb.captured_grad_bytes(MODEL, 2, True, 4096, 2.0)
    out = memory_pipeline.stage_output_bytes(MODEL.hidden, 2, True, 1, 4096, 2.0)
    head = memory_zb.head_grad_bytes(MODEL, 2, 4096, 2.0)
    work = memory_zb.input_backward_bytes(MODEL, 2, True, 4096, 2.0)
    loss = 3.0 * 2**30
    for p, v, rank in ((2, 2, 0), (4, 1, 3)):
        args = (p, v, 8, rank, (8,) * (p * v), act, grad, out, head, loss, PENDING, work)
        lay, oth = memory_zb.held(*args)
        lay_f, oth_f = memory_zb.held(*args, folds=True)
        assert lay - lay_f == pytest.approx(8 * PENDING, rel=1e-12) and oth == oth_f, (p, v)

def test_unfolded_gradients_wait_through_the_next_forward():
    """torch's schedule as it is: a ZB1P middle stage (pp 3, rank 1) keeps W's gradients
    through its next F until its next B folds them, so its peak can be that F's end: 3
    micro-batches in flight, 1 waiting, 1 stage of gradients (3 + 0.3 + 1, per-layer units);
    folded at W's end, the largest is a B's end (3 in flight, 2 waiting: 3.6) and W's end
    (2 + 0.3 + 1) is below it."""
    args = (3, 1, 9, 1, (1, 1, 1), 1.0, 0.3, 0.0, 0.0)
    assert memory_zb.held(*args, pending=1.0) == (pytest.approx(4.3), 0.0)
    assert memory_zb.held(*args, pending=1.0, folds=True) == (pytest.approx(3.6), 0.0)


def test_the_fold_option_is_a_bool():
    with pytest.raises(UserError, match=r"^memory.fold_after_weight_pass='yes': allowed "):
        MemoryOptions(fold_after_weight_pass="yes")


# ---- planner against the rehearsal of meshtron's runtime, which folds after each W ----------

RUN_RANKS = """
import json, sys
from meshtron.model.spec import ModelSpec
from meshtron.planner.cluster import resolve_cluster
from meshtron.planner.plan import as_plan
from meshtron.rehearse import compare
from meshtron.rehearse.run import rehearse
model, base, cases = json.loads(sys.argv[1])
out = {}
for name, (knobs, pp_rank) in cases.items():
    spec = ModelSpec(**dict(model, layers=knobs.pop("layers")))
    plan = as_plan({**base, **knobs}).validate(8, spec)
    rank = compare.first_rank_of_stage(compare.with_layer_split(plan, spec), pp_rank)
    report = rehearse(spec, plan, resolve_cluster("dgx-h100:1"), "cpu", rank=rank)
    out[name] = {r["row"]: [r["rehearsal_gib"], r["planner_gib"]] for r in report["memory"]}
print("RESULT" + json.dumps(out))
"""
MID = dict(name="mid", layers=2, hidden=2048, heads=16, kv_heads=4, ffn_hidden=5632,
           vocab=32000, max_seq=4096)
MID_BASE = dict(tp=1, pp=1, dp=8, zero=1, micro_batch=2, recompute="none", sp=False,
                dtype="bf16", global_batch=32, seq_len=2048, model="mid")
ZB2 = dict(pp=2, dp=4, schedule="zb", layers=6)
ZBV = dict(pp=2, dp=4, schedule="zbv", layers=6)
ZB4 = dict(pp=4, dp=2, schedule="zb", layers=8)
# name: (knobs, pipeline rank); measured 2026-12-06 (planned / rehearsed - 1), before the
# fold's idle terms and the V's handed tensors (memory_zb.held) -> now
RANKS = {
    # the head's group last in W: the 8B's peak there, the 'mid' model's not
    "pp=4 zbv full, rank 0": (dict(ZBV, pp=4, dp=2, layers=8, recompute="full"), 0),  # +0.8%
    "zbv, rank 1": (ZBV, 1),                      # +4.2% -> +0.7% (the V's fullest rank)
    "pp=4 zb, rank 2": (ZB4, 2),                  # +2.6% -> +0.5%
    "zb, rank 0": (ZB2, 0),                       # +0.7% -> +0.7% (a whole backward)
    "zb, rank 1": (ZB2, 1),                       # +2.1% -> -0.2%
    "zbv, rank 0": (ZBV, 0),                      # +2.9% -> -0.4%
    "pp=4 zb, rank 1": (ZB4, 1),                  # +2.2% -> -0.1%
    "pp=4 zb, rank 3": (ZB4, 3),                  # +1.2% -> -0.6%
    "zb full, rank 1": (dict(ZB2, recompute="full"), 1),    # +1.0% -> +1.0%
    "zbv full, rank 1": (dict(ZBV, recompute="full"), 1),   # +3.3% -> +1.3%
    "zbv full, rank 0": (dict(ZBV, recompute="full"), 0),   # +1.8% -> +1.8%
    "zb half, rank 1": (dict(ZB2, recompute="half"), 1),    # +1.1% -> +1.1%
}
FAST_RANKS = ("zbv, rank 1", "pp=4 zb, rank 2")


def _off(got: dict, bound: float) -> dict:
    return {n: rows["total"] for n, rows in got.items()
            if abs(rows["total"][1] / rows["total"][0] - 1) > bound}


def _live(names) -> dict:
    from testkit.rehearsal import run_kinds

    return run_kinds(RUN_RANKS, [MID, MID_BASE, {n: RANKS[n] for n in names}])


def _case(knobs: dict, pp_rank: int) -> dict:
    from testkit.recorded_rehearsal import case

    knobs = dict(knobs)
    return case(dict(MID, layers=knobs.pop("layers")), {**MID_BASE, **knobs}, pp_rank)


RECORDED_TABLES = {"zb-fold-fast": {n: _case(*RANKS[n]) for n in FAST_RANKS}}


def test_folded_zero_bubble_peaks_agree_with_the_rehearsal():
    """The V's middle rank and a ZB1P middle rank peak in a B, where the runtime holds no
    bf16 weight gradient (each W's folded at its end) and no backward's working set but B's
    own: the planner within 1.5% of the rehearsal (the table's bound is 5%). The planner is
    priced now against the rehearsal recorded in tests/data/rehearsals/zb-fold-fast.json
    (testkit/recorded_rehearsal.py; re-rehearsed live by the slow test below): +0.9% and
    +0.7% at the recording (2026-12-07)."""
    from testkit.recorded_rehearsal import recorded_table

    got = recorded_table("tests/test_memory_zb_fold.py", "zb-fold-fast",
                         RECORDED_TABLES["zb-fold-fast"])
    assert set(got) == set(FAST_RANKS)
    assert not _off(got, 0.015)


@pytest.mark.slow
def test_recorded_zero_bubble_ranks_are_what_the_rehearsal_measures(tmp_path):
    """zb-fold-fast.json's regeneration command, run live, writes what is committed."""
    from testkit.recorded_rehearsal import live_check

    live_check("tests/test_memory_zb_fold.py", "zb-fold-fast", tmp_path)


@pytest.mark.slow
def test_every_folded_zero_bubble_rank_agrees_with_the_rehearsal():
    """Every rank above within 2% (the table's 5%): the last stage's W under recomputation
    is priced with its head's gradient at W's peak, which the 'mid' model's peak (inside its
    last block's groups) does not hold yet: +1.8% on the V's rank 0."""
    assert not _off(_live([n for n in RANKS if n not in FAST_RANKS]), 0.02)
