"""DeepSpeed's pipeline engine as the planner prices it: the instruction streams of its
TrainSchedule (microsoft/DeepSpeed deepspeed/runtime/pipe/schedule.py, unchanged from v0.3.15
to v0.8.2, each step's two transfers swapped from v0.8.3) re-derived here and walked with
blocking sends and receives, against pipeline.bubble_time and pipeline.p2p_time; and the old
engine's gradient receive, which re-gathers the sender's split output first (pipe/engine.py
`_exec_recv_grads`)."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.model.spec import ModelSpec
from meshtron.planner import comm, pipeline, placement
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.compute import KernelOptions
from meshtron.planner.estimate import Evaluator
from meshtron.planner.plan import Plan
from testkit.pipeline_walk import drain

MATCH = {"RA": "SA", "SA": "RA", "SG": "RG", "RG": "SG"}


def _slot(p: int, s: int, step: int) -> tuple[int, bool]:
    """(micro-batch, forward?) of stage s at `step`: TrainSchedule._step_to_micro_batch."""
    forward = step % 2 == s % 2
    base = step // 2 if step % 2 == 0 else (step - 1) // 2
    if forward:
        return base - s // 2, True
    if step % 2 == 0:
        return base - p + (s + 1) // 2, False
    return base - p + 1 + s // 2, False


def train_schedule(p: int, m: int, s: int, swapped: bool = False) -> list[tuple[str, int, int]]:
    """Stage s's instructions (kind, peer stage, micro-batch) in TrainSchedule.steps order:
    a forward step receives the activation then sends the previous step's gradient, a
    backward step sends the previous step's activation then receives the gradient.
    `swapped`: each step's two transfers the other way round, as DeepSpeed orders them from
    v0.8.3 on (schedule.py, #2862 of 2023-03: SendGrad before RecvActivation, RecvGrad
    before SendActivation), the engine the deepspeed@2024 preset prices."""
    ops, prev = [], -1

    def valid(b: int) -> bool:
        return 0 <= b < m

    for step in range(2 * (m + p - 1)):
        mb, forward = _slot(p, s, step)
        pair = []
        if forward and s > 0:
            pair += [("RA", s - 1, mb)] if valid(mb) else []
            pair += [("SG", s - 1, prev)] if valid(prev) else []
        elif not forward and s < p - 1:
            pair += [("SA", s + 1, prev)] if valid(prev) else []
            pair += [("RG", s + 1, mb)] if valid(mb) else []
        ops += pair[::-1] if swapped else pair
        if valid(mb):
            ops.append(("F" if forward else "B", s, mb))
        prev = mb
    return ops


def walk(p: int, m: int, fwd: list[float], bwd: list[float], hop: float,
         swapped: bool = False) -> float:
    """Makespan of the p instruction streams, each send or receive a rendezvous with its
    peer's matching instruction that occupies both for `hop` seconds (p2p.send / p2p.recv
    are blocking calls: the stream goes on once the transfer is done)."""
    streams = [train_schedule(p, m, s, swapped) for s in range(p)]
    clock = [0.0] * p

    def step(s: int, op: tuple[str, int, int], pos: list[int]) -> bool:
        kind, peer, mb = op
        if kind in ("F", "B"):
            clock[s] += fwd[s] if kind == "F" else bwd[s]
        elif (pos[peer] < len(streams[peer])
              and streams[peer][pos[peer]] == (MATCH[kind], s, mb)):
            clock[s] = clock[peer] = max(clock[s], clock[peer]) + hop
            pos[peer] += 1
        else:
            return False
        return True

    drain(streams, step)  # asserts that the streams did not deadlock
    return max(clock)


def test_each_stage_runs_every_micro_batch_once_in_1f1b_order():
    p, m = 5, 7
    for s in range(p):
        work = [(k, mb) for k, _, mb in train_schedule(p, m, s) if k in ("F", "B")]
        assert sorted(work) == sorted([("F", b) for b in range(m)] + [("B", b) for b in range(m)])
        first_b = next(i for i, (k, _) in enumerate(work) if k == "B")
        assert first_b == min(m, p - s)  # p - s forwards in flight: 1F1B's warm-up + 1


@pytest.mark.parametrize("p", [2, 3, 4, 8, 12])
def test_train_schedule_has_the_1f1b_bubble(p):
    """Without transfer time the engine's step is 1F1B's, (m - 1) max t + sum t."""
    for m in (1, p - 1, p, 2 * p + 1):
        for f, b in ((1.0, 2.0), (1.0, 3.0), (2.0, 1.0)):
            stage_t = [f + b] * p
            makespan = walk(p, max(1, m), [f] * p, [b] * p, 0.0)
            ideal = (max(1, m) - 1) * max(stage_t) + sum(stage_t)
            assert makespan == pytest.approx(ideal)
            assert pipeline.bubble_time("1f1b", 1, stage_t, [0.0] * p, m) == pytest.approx(
                sum(stage_t) - max(stage_t))


def test_heavier_end_stages_never_exceed_the_planners_bubble():
    fwd, bwd = [1.3, 1, 1, 1, 1, 1.2], [3.4, 3, 3, 3, 3, 3.9]
    stage_t = [f + b for f, b in zip(fwd, bwd)]
    for m in (6, 13, 40):
        bound = m * max(stage_t) + pipeline.bubble_time("1f1b", 1, stage_t, [0.0] * 6, m)
        assert walk(6, m, fwd, bwd, 0.0) <= bound + 1e-9


@pytest.mark.parametrize("swapped", [False, True])
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 35])
def test_blocking_transfers_on_the_critical_path(p, swapped):
    """The walk's extra time over the transfer-free walk, per hop, is p2p_time's count (the
    old 4 (m + p - 1) over-counted the fill and drain chains), in either order of a step's
    two transfers (v0.3.15 to v0.8.2, and v0.8.3 on: `train_schedule` swapped)."""
    hop = 1e-4
    for m in sorted({1, 2, 3, p, p + 1, 2 * p + 3}):
        for f, b in ((1.0, 3.0), (1.0, 1.0), (2.0, 1.0)):
            extra = (walk(p, m, [f] * p, [b] * p, hop, swapped)
                     - walk(p, m, [f] * p, [b] * p, 0.0, swapped))
            assert pipeline.p2p_time(hop, p, 1, m, blocking=True) == pytest.approx(extra), (m, f, b)
    assert pipeline.train_schedule_hops(35, 160) == 702  # MT-NLG at 3,360 GPUs: 776 before


def test_old_engine_regathers_before_the_gradient_receive():
    """With activations split over the tensor group and gradients sent whole (DeepSpeed
    before v0.5.4), the gradient's receiver re-gathers its split output before the receive
    (`_exec_recv_grads`: PartitionedTensor.full()): both directions pay the gather."""
    model = ModelSpec(name="t", layers=8, hidden=4096, heads=32, kv_heads=32, ffn_hidden=16384,
                      vocab=32000, max_seq=2048)
    cluster = preset_cluster("dgx-a100", 4)
    plan = Plan(tp=8, pp=4, dp=1, zero=0, micro_batch=1, recompute="full", sp=False,
                schedule="1f1b", dtype="bf16")
    base = KernelOptions(p2p_blocking=True)

    def pp_comm(opts: KernelOptions) -> float:
        return Evaluator(model, cluster, 32, 2048, opts).evaluate(plan).time.pp_comm

    split = pp_comm(base)
    whole = pp_comm(dataclasses.replace(base, p2p_scatter_gather=False))
    mixed = pp_comm(dataclasses.replace(base, p2p_grads_whole=True))
    hops = pipeline.train_schedule_hops(4, 32)
    act = 2.0 * 2048 * 4096  # bytes of one micro-batch's activation, bf16
    gather = comm.all_gather(act, placement.tp_group(8, cluster.gpus_per_node),
                             comm.Fabric.of(cluster))
    assert gather > 0
    assert split == pytest.approx(hops * (comm.send(act / 8, True, comm.Fabric.of(cluster))
                                          + gather))
    assert mixed == pytest.approx(0.5 * (split + whole) + 0.5 * hops * gather)


def _pp_comm(capsys, tmp_path, blocking: bool) -> float:
    """`meshtron plan` with DeepSpeed 2024's preset (split activations and gradients) on a
    pinned pipeline, its p2p_blocking as stated through an options file."""
    import json

    from meshtron.cli import main

    opts = tmp_path / f"ds_{blocking}.toml"
    opts.write_text(f'framework = "deepspeed@2024"\n[options]\np2p_blocking = '
                    f'{str(blocking).lower()}\n')
    rc = main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:4", "--global-batch",
               "64", "--seq-len", "4096", "--layout", "tp=4,pp=8,dp=1", "--zero", "1",
               "--recompute", "full", "--sp", "off", "--micro-batch", "1", "--schedule",
               "1f1b", "--options", str(opts), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)["plans"][0]["time_s"]["pp_comm"]


def test_the_command_prices_the_engines_walk(capsys, tmp_path):
    """Through the user's path: the same hop, DeepSpeed's blocking engine against Megatron's
    batched exchange (2 (m + p - 1) transfers): the ratio of their counts, m = 64, p = 8."""
    blocking = _pp_comm(capsys, tmp_path, True)
    batched = _pp_comm(capsys, tmp_path, False)
    assert blocking / batched == pytest.approx(
        pipeline.train_schedule_hops(8, 64) / (2 * (64 + 8 - 1)))  # 264 / 142
