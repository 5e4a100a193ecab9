"""Expert parallelism inside a pipeline (ep x pp) against one process, on real gloo ranks.

Why it hung before (torch 2.13, read in torch/distributed/pipelining/stage.py): with no static
`input_args`/`output_args`, `PipelineStage` runs a metadata forward and backward at the first
step (`_forward_metadata_inference` / `_backward_metadata_inference`); every stage but the first
gets `torch.empty_strided` inputs (uninitialized memory, different on every rank). The routers
of a last stage then sent every token to the experts of one ep rank (measured: counts
[0,0,0,0,0,16,16,0] on both ranks of an ep pair); the other rank's experts got 0 tokens, and
`GroupedExperts` returned a fresh tensor with no autograd edge to its input, so that rank's
backward never reached the dispatch / combine all-to-alls' backwards its peer was waiting in.
The fix is in meshtron/model/moe.py (an expert group with no token still hangs off its input
and weights); it also covers a router that sends a rank no token in real training, which the
default launch forces with the balancing bias (`no_token_rank_fn`).

Default: one 4-rank launch, dp=2 x ep=2 x pp=2 (ep folded over dp_shard) with 1F1B (sigmoid
router, ZeRO-3) and the interleaved schedule (softmax router + auxiliary loss, ZeRO-2), and
without a pipeline ep=2 x dp=4 under ZeRO-0 (softmax) and ZeRO-1 (sigmoid), the experts over
"dp_mod_ep" (issue 21: ep with every ZeRO stage): losses,
gradient norms and every parameter equal the single-process run within 1e-5, and every
collective of the second step equals `meshtron.planner.step_collectives` for the rank's
pipeline rank (dp_shard, dp_replicate, dp_mod_ep, pp send/recv, the experts' counts
all-to-all, exactly; the uneven token all-to-alls by calls per rank and bytes summed over the
ep group). Slow: ZeRO-0/1 inside pipelines, GPipe, ZB-H1, ZBV, full recomputation, and 8 ranks
(experts FSDP-sharded over dp_shard_mod_ep = 2; tp=2 with sequence parallelism; HSDP with
dp_replicate = 2; ZeRO-0/1 with dp_mod_ep = 2); the balancing bias's gathers without ep.
"""

from __future__ import annotations

from collections import Counter

import pytest

from testkit.equivalence import compare, format_report, layout_cfg, reference_run
from testkit.multiproc import run_on_ranks
from test_dp_collectives import _rank_fn
from test_ep_train import CFG as EP_CFG
from test_ep_train import SIGMOID, SOFTMAX, TOL

# The vocabulary a multiple of the data-parallel groups: FSDP2 pads dim 0 to a multiple of the
# group, the planner counts unpadded parameters (as tests/test_dp_collectives.py).
CFG = dict(EP_CFG, spec=dict(EP_CFG["spec"], vocab=132))

P = dict(dp=2, ep=2, pp=2, micro_batch=1)
# ep=2 x dp=4 without a pipeline under ZeRO-0 and ZeRO-1: the experts replicated (all-reduced)
# or optimizer-sharded over "dp_mod_ep" (the 2 ranks holding the same experts), the dense
# parts over all 4 data ranks; here for the count-for-count check in the same launch.
ZERO01 = [dict(dp=4, ep=2, micro_batch=1, model=SOFTMAX, zero=0),
          dict(dp=4, ep=2, micro_batch=1, model=SIGMOID, zero=1)]
LAYOUTS = [
    dict(P, model=SIGMOID, zero=3, schedule="1f1b"),
    dict(P, model=SOFTMAX, zero=2, schedule="interleaved", virtual_stages=2),
] + ZERO01
SLOW_LAYOUTS = [
    dict(P, model=SIGMOID, zero=1, schedule="1f1b"),
    dict(P, model=SOFTMAX, zero=0, schedule="interleaved", virtual_stages=2),
    dict(P, model=SIGMOID, zero=3, schedule="gpipe"),
    dict(P, model=SOFTMAX, zero=2, schedule="zb"),
    dict(P, model=SIGMOID, zero=2, schedule="zbv"),
    dict(P, model=SOFTMAX, zero=3, schedule="1f1b", recompute="full"),
]
SLOW_LAYOUTS_8 = [
    dict(P, dp=4, model=SOFTMAX, zero=3, schedule="1f1b"),
    dict(P, tp=2, sp=True, model=SIGMOID, zero=3, schedule="interleaved", virtual_stages=2),
    dict(P, dp=4, dp_replicate=2, model=SIGMOID, zero=2, schedule="1f1b"),  # HSDP
    dict(P, dp=4, model=SOFTMAX, zero=0, schedule="1f1b"),  # experts all-reduced over 2
    dict(P, dp=4, model=SIGMOID, zero=1, schedule="interleaved", virtual_stages=2),
]


def planned(layout: dict, world: int, pp_rank: int) -> Counter:
    """step_collectives for this layout on pipeline rank `pp_rank`, as the recorder keys them."""
    from meshtron.parallel.mesh import resolve_plan
    from meshtron.planner import step_collectives
    from testkit.equivalence import make_spec

    cfg, attrs = layout_cfg(CFG, layout)
    spec = make_spec(cfg)
    plan = resolve_plan(attrs, world, spec)
    return Counter({(c.kind, c.axis, c.bytes, c.group_size, c.dtype): c.count
                    for c in step_collectives(plan, spec, cfg["batch"], cfg["seq"], pp_rank)})


def _tokens(counted: Counter) -> tuple[Counter, Counter]:
    """(calls, input bytes) of the token all-to-alls, whose inputs are uneven by design."""
    calls, nbytes = Counter(), Counter()
    for (kind, axis, size, group, dtype), n in counted.items():
        if kind == "all_to_all" and axis == "ep" and dtype != "int64":
            calls[(axis, group, dtype)] += n
            nbytes[(axis, group, dtype)] += n * size
    return calls, nbytes


BIAS_LAYOUTS = [dict(dp=4, zero=z, micro_batch=1, model=SIGMOID) for z in (0, 1, 3)] + \
    [dict(dp=2, pp=2, zero=1, micro_batch=1, model=SIGMOID)]


@pytest.mark.slow
def test_balancing_bias_is_gathered_not_reduced_without_ep():
    """The sigmoid router's balancing bias (no gradient) in step_collectives without ep: ZeRO-1
    and ZeRO-3 gather it with its block, nothing reduces it (collectives only)."""
    results = run_on_ranks(_rank_fn, 4, CFG, BIAS_LAYOUTS, timeout=600)
    for i, layout in enumerate(BIAS_LAYOUTS):
        for rank, per in enumerate(results):
            got = Counter({k: v for k, v in per[i]["counted"].items() if k[1] != "tp"})
            want = planned(layout, 4, per[i]["pp_rank"])
            assert got == want, (rank, layout, sorted((got - want).items()),
                                 sorted((want - got).items()))


def default_rank_fn(cfg, layouts, spec_kw):
    """The default launch: the layouts (test_dp_collectives._rank_fn), then the no-token case
    on the same 4 ranks (one launch saves CI its start-up)."""
    return {"layouts": _rank_fn(cfg, layouts), "no_token": no_token_rank_fn(spec_kw)}


def _check(layouts, world, results=None):
    if results is None:
        results = run_on_ranks(_rank_fn, world, CFG, layouts, timeout=900)
    refs: dict = {}

    def ref(layout):  # whole logits only under tp (model/transformer.py `loss`)
        cfg, _ = layout_cfg(CFG, layout)
        whole = layout.get("tp", 1) > 1
        key = (cfg["spec"]["name"], whole)
        if key not in refs:
            refs[key] = reference_run(dict(cfg, whole_logits=whole))
        return refs[key]

    report = compare(ref, results)
    print(format_report(report))
    bad = [r for r in report if r["missing"] or r["extra"]
           or max(r["loss_rel"], r["norm_rel"], r["param_rel"]) > TOL]
    assert not bad, f"off the single-process run by more than {TOL}:\n" + format_report(bad)
    for i, layout in enumerate(layouts):
        group_bytes, group_want = Counter(), Counter()
        for rank, per in enumerate(results):
            got = Counter({k: v for k, v in per[i]["counted"].items() if k[1] != "tp"})
            want = planned(layout, world, per[i]["pp_rank"])
            (got_calls, got_bytes), (want_calls, want_bytes) = _tokens(got), _tokens(want)
            assert want_calls and got_calls == want_calls, (rank, layout, got_calls, want_calls)
            def exact(c):  # all but the token all-to-alls
                return Counter({k: v for k, v in c.items()
                                if k[0] != "all_to_all" or k[4] == "int64"})
            rest, rest_want = exact(got), exact(want)
            assert rest == rest_want, (rank, layout, sorted((rest - rest_want).items()),
                                       sorted((rest_want - rest).items()))
            # the planner's bytes are the mean over the ep group: sum the group's inputs (tp
            # innermost, then the ep ranks: the ep group of a rank is rank // (tp*ep), tp rank)
            tp = layout.get("tp", 1)
            group = (rank // (tp * layout["ep"]), rank % tp)
            group_bytes[group] += sum(got_bytes.values())
            group_want[group] += sum(want_bytes.values())
        assert group_bytes == group_want, (layout, group_bytes, group_want)


NO_TOKEN_SPEC = dict(CFG["spec"], **SIGMOID, layers=2)


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_ep_in_a_pipeline_matches_one_process_and_the_planner():
    """Also: every token routed to ep rank 1's experts, rank 0's get none, and both ranks still
    meet in every all-to-all of the backward (this hung before the fix), equal to one process."""
    ranks = run_on_ranks(default_rank_fn, 4, CFG, LAYOUTS, NO_TOKEN_SPEC, timeout=900)
    for res in (r["no_token"] for r in ranks):
        assert res["worst"] <= TOL, res
        assert abs(res["loss"] - res["want"]) <= TOL * abs(res["want"]), res
        assert res["unused"] and max(res["unused"]) == 0.0, res
    _check(LAYOUTS, 4, [r["layouts"] for r in ranks])


@pytest.mark.slow
def test_ep_in_a_pipeline_other_schedules():
    _check(SLOW_LAYOUTS, 4)


@pytest.mark.slow
def test_ep_in_a_pipeline_8_ranks():
    _check(SLOW_LAYOUTS_8, 8)


def no_token_rank_fn(spec_kw: dict) -> dict:
    """ep=2 over the pairs of a (dp, ep) = (2, 2) mesh, the balancing bias steering every token
    away from ep rank 0's experts (DeepSeek-V3's group-limited sigmoid router: their groups
    lose), one forward + backward against one process on the union of the pair's rows."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshtron.model.moe import MoE
    from meshtron.model.spec import ModelSpec
    from meshtron.model.transformer import Transformer
    from meshtron.parallel.expert import apply_expert_parallel

    spec = ModelSpec(**spec_kw)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))["ep"]
    models = []
    for _ in range(2):
        torch.manual_seed(7)
        m = Transformer(spec)
        for mod in m.modules():
            if isinstance(mod, MoE):
                with torch.no_grad():
                    mod.router.expert_bias[:spec.moe_experts // 2] = -100.0
        models.append(m)
    ref, model = models
    dispatcher = apply_expert_parallel(model, mesh)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, spec.vocab, (4, 17), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref(x, y).backward()
    r = mesh.get_local_rank()
    loss = model(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2]) / 2  # this rank's share of the mean
    loss.backward()
    worst, lo = 0.0, r * dispatcher.local
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.grad is None and q.grad is None:
            continue
        if hasattr(p.grad, "to_local"):  # an expert shard: its grad already holds both ranks
            grad, want = p.grad.to_local(), q.grad[lo:lo + dispatcher.local]
        else:  # replicated: summed over the ep pair
            grad = p.grad.clone()
            dist.all_reduce(grad, group=mesh.get_group())
            want = q.grad
        worst = max(worst, float((grad - want).abs().max() / want.abs().max().clamp_min(1e-6)))
    # no token reached ep rank 0's experts in the reference: their gradient rows are zero
    unused = [float(lin.weight.grad[:dispatcher.local].abs().max())
              for mod in ref.modules() if isinstance(mod, MoE)
              for lin in (mod.experts.w1, mod.experts.w2, mod.experts.w3)]
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.get_group())
    with torch.no_grad():
        want = float(ref(x, y))
    return {"worst": worst, "loss": float(total), "want": want, "unused": unused}
