"""Compressed gradients and DiLoCo on real gloo ranks (one 4-rank launch for the reductions,
one 2-rank launch for DiLoCo's loss parity).

The debug preset (the reductions' cases; the uncompressed-vs-int8 run and the residual's
reshard too since session 56: "tiny" took 6.5 of each rank's 11 CPU s, the same checks pass)
and the demo model ("tiny" preset, the slow DiLoCo runs) train on byte-tokenized Python
standard-library sources, every case from the same seed and the same global batches:
- int8 (error feedback) reaches the uncompressed loss within 2% after the same steps (ZeRO-0);
- DiLoCo with H=1, a plain SGD inner optimizer and outer SGD lr 1 without momentum equals
  data-parallel SGD (losses and parameters to float tolerance);
- the other reductions (ZeRO-1 hierarchical over two simulated nodes of 2 ranks, ZeRO-2 and
  ZeRO-3 through FSDP2's custom reduce-scatter, bf16) track the uncompressed losses;
- DiLoCo with its default outer settings, H=4 and H=16, AdamW inside with the run's default
  schedule, trains as well as data parallelism over 60 steps (losses have moved by half by then):
  the mean of the last 5 losses within 4% (the paper's 0.7/0.9 at H=4 is +20% here: see
  meshtron/compress/diloco.py), and the replicas hold identical weights after every sync;
- the error-feedback residual survives a DCP checkpoint saved at dp=4 and loaded at dp=2 x tp=2
  (what the group owes is kept, in each parameter's tensor-parallel layout).
"""

from __future__ import annotations

import pytest
import torch

from testkit.multiproc import run_on_ranks

STEPS = 16
SHORT = 5
SEQ = 32
BATCH = 8


def demo_tokens(steps: int) -> torch.Tensor:
    """[steps, BATCH, SEQ+1] byte tokens of consecutive windows of stdlib sources."""
    from meshtron.data.corpus import stdlib_documents
    from meshtron.data.tokenizer import ByteTokenizer

    text = "\n".join(stdlib_documents(max_bytes=400_000))
    ids = torch.tensor(ByteTokenizer().encode(text)[: steps * BATCH * (SEQ + 1)])
    return ids.view(steps, BATCH, SEQ + 1)


def _train(tokens, plan, steps, optimizer="adamw", lr=3e-3, diloco=False, model="tiny"):
    """Train `steps` steps of `model` (a preset) under `plan`; returns (losses, pm, mesh,
    DiLoCo or None)."""
    import torch.distributed as dist

    from meshtron.compress import diloco as dl
    from meshtron.model import Transformer, preset
    from meshtron.parallel import build_mesh, build_optimizer, parallelize
    from meshtron.parallel.mesh import data_mesh

    mesh = build_mesh(plan, dist.get_world_size(), device_type="cpu")
    torch.manual_seed(0)
    pm = parallelize(Transformer(preset(model)), plan, mesh)
    if optimizer == "sgd":
        opt = build_optimizer(pm, lr=lr, optimizer_cls=_sgd)
    else:
        opt = build_optimizer(pm, lr=lr, weight_decay=0.0)
    outer = dl.attach(pm, pm.layout) if diloco else None
    dp, r = data_mesh(mesh).size(), data_mesh(mesh).get_local_rank()
    rows = BATCH // dp
    losses = []
    for step in range(steps):
        batch = tokens[step, r * rows:(r + 1) * rows]
        losses.append(float(pm.forward_backward(batch[:, :-1], batch[:, 1:])))
        if optimizer != "sgd":
            pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if outer is not None:
            outer.after_inner_step()
    return losses, pm, mesh, outer


def _sgd(params, lr, betas=None, eps=None, weight_decay=0.0):
    return torch.optim.SGD(params, lr=lr)


def _release(pm, mesh, outer=None):
    from meshtron.parallel.mesh import release_mesh

    for owner in (pm.grad_sync, outer):
        if owner is not None:
            owner.release()
    del pm
    release_mesh(mesh)


def diloco_equals_dp(tokens, plan, model):
    """DiLoCo(H=1, SGD inside, outer SGD lr 1, no momentum) against data-parallel SGD on the
    same layout: losses and the worst relative parameter difference."""
    ref, pm, mesh, _ = _train(tokens, plan, SHORT, optimizer="sgd", lr=0.1, model=model)
    ref_params = pm.full_parameters()
    _release(pm, mesh)
    dil, pm, mesh, outer = _train(tokens, dict(plan, diloco=1, outer_lr=1.0,
                                               outer_momentum=0.0),
                                  SHORT, optimizer="sgd", lr=0.1, diloco=True, model=model)
    params = pm.full_parameters()
    diff = max((float((params[k] - v).abs().max() / v.abs().max()), k)
               for k, v in ref_params.items())
    syncs = outer.syncs
    _release(pm, mesh, outer)
    return {"sgd_dp": ref, "sgd_diloco1": dil, "sgd_param_diff": diff, "outer_syncs": syncs}


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _rank_body(tokens, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from meshtron.checkpoint.rank_entries import OWN_PREFIX, drop_own

    out = {}
    # Uncompressed reference, int8 and DiLoCo H=4 over the same STEPS.
    for name, plan, kw in [
        ("fp32", dict(dp=4), {}),
        ("int8", dict(dp=4, grad_compression="int8", grad_compression_block=64), {}),
    ]:
        losses, pm, mesh, _ = _train(tokens, plan, STEPS, model="debug", **kw)
        out[name] = losses
        if name == "int8":  # checkpoint the residual (mean over dp, per parameter)
            state = pm.grad_sync.state_dict()
            saved = {k: v.clone() for k, v in state.items()}
            dcp.save({"compress": state}, checkpoint_id=ckpt_dir)
        _release(pm, mesh)
    # Other reductions, SHORT steps each.
    for name, plan in [
        ("zero1_hier", dict(dp=4, zero=1, grad_compression="int8", compress_scope="inter_node",
                            ranks_per_node=2)),
        ("zero2", dict(dp=4, zero=2, grad_compression="int8")),
        ("zero3_hier_bf16", dict(dp=4, zero=3, grad_compression="bf16",
                                 compress_scope="inter_node", ranks_per_node=2)),
    ]:
        losses, pm, mesh, _ = _train(tokens, plan, SHORT, model="debug")
        out[name] = losses
        # residual export / import in this layout (flat, hierarchical, FSDP2 reduce-scatter):
        # what the group owes survives the round trip
        # (the mean entries alone: the path of a resume on another layout)
        before = {k: v for k, v in pm.grad_sync.state_dict().items()
                  if not k.startswith(OWN_PREFIX)}
        pm.grad_sync.load_state_dict(before)
        after = pm.grad_sync.state_dict()
        out[name + "_roundtrip"] = (max(float((_full(after[k]) - _full(v)).abs().max())
                                        for k, v in before.items()),
                                    sum(float(_full(v).abs().sum()) for v in before.values()))
        _release(pm, mesh)
    ref, pm, mesh, _ = _train(tokens, dict(dp=4), SHORT, model="debug")
    out["debug_fp32"] = ref
    _release(pm, mesh)
    # DiLoCo H=1 + SGD inside + outer SGD lr 1, no momentum == data-parallel SGD.
    out.update(diloco_equals_dp(tokens, dict(dp=4), "debug"))
    # Reshard the int8 residual: saved at dp=4 (no tp), loaded at dp=2 x tp=2.
    _, pm, mesh, _ = _train(tokens, dict(dp=2, tp=2, zero=1, grad_compression="int8",
                                         grad_compression_block=64), 0, model="debug")
    template = {"compress": pm.grad_sync.state_dict()}
    assert drop_own(template)  # each rank's own residual of dp=4 means nothing here
    dcp.load(template, checkpoint_id=ckpt_dir)
    pm.grad_sync.load_state_dict(template["compress"])
    again = pm.grad_sync.state_dict()
    worst, total = 0.0, 0.0
    for k, v in saved.items():
        if k.startswith(OWN_PREFIX):
            continue
        got = again[k].full_tensor() if isinstance(again[k], DTensor) else again[k]
        worst = max(worst, float((got - v).abs().max()))
        total += float(v.abs().sum())
    out["residual_reshard_err"], out["residual_total"] = worst, total
    out["residual_is_dtensor"] = any(isinstance(v, DTensor) for v in again.values())
    _release(pm, mesh)
    out["zero2_tp_mean_err"] = _mean_only_round_trip(tokens, ckpt_dir + "-zero2-tp")
    return out


def _mean_only_round_trip(tokens, folder):
    """ZeRO-2 under tp=2 x dp=2, int8: the group's mean residual alone through a DCP checkpoint
    (what `--checkpoint-residuals mean` saves) reloads on the same layout as each rank saved
    it. Its per-unit entries are plain tensors that differ between tp ranks: under one key per
    unit DCP kept one of them and tp rank 1 loaded tp rank 0's. Returns (worst difference,
    total owed) over this rank's entries."""
    import torch.distributed.checkpoint as dcp

    from meshtron.checkpoint.rank_entries import drop_own

    plan = dict(dp=2, tp=2, zero=2, grad_compression="int8", grad_compression_block=64)
    _, pm, mesh, _ = _train(tokens, plan, 2, model="debug")
    state = {"compress": pm.grad_sync.state_dict()}
    drop_own(state)
    saved = {k: _full(v).clone() for k, v in state["compress"].items()}
    dcp.save(state, checkpoint_id=folder)
    template = {"compress": pm.grad_sync.state_dict()}
    drop_own(template)
    for v in template["compress"].values():
        _full(v).zero_() if not hasattr(v, "to_local") else v.to_local().zero_()
    dcp.load(template, checkpoint_id=folder)
    worst = max(float((_full(template["compress"][k]) - v).abs().max()) for k, v in saved.items())
    total = sum(float(v.abs().sum()) for v in saved.values())
    _release(pm, mesh)
    return worst, total


def _check_diloco_equals_dp(r):
    """DiLoCo(H=1, SGD, outer lr 1, mu 0) is data-parallel SGD."""
    assert r["outer_syncs"] == SHORT
    assert max(abs(a - b) / b for a, b in zip(r["sgd_diloco1"], r["sgd_dp"])) < 1e-5
    assert r["sgd_param_diff"][0] < 1e-5, r["sgd_param_diff"]


def test_compression_and_diloco_on_gloo(tmp_path):
    tokens = demo_tokens(STEPS)
    res = run_on_ranks(_rank_body, 4, tokens, str(tmp_path / "ckpt"), timeout=600)
    r = res[0]
    assert all(x == r for x in res[1:]) or all(x["fp32"] == r["fp32"] for x in res)
    fp32 = r["fp32"]
    assert fp32[-1] < 0.8 * fp32[0], fp32  # the model learns in these steps
    last = lambda xs: sum(xs[-3:]) / 3  # noqa: E731 (mean of the last 3 steps)
    assert abs(last(r["int8"]) - last(fp32)) / last(fp32) < 0.02, (r["int8"], fp32)
    assert r["int8"] != fp32  # compression really ran (values differ in the last digits)
    for name in ("zero1_hier", "zero2", "zero3_hier_bf16"):
        rel = max(abs(a - b) / b for a, b in zip(r[name], r["debug_fp32"]))
        assert rel < 0.02, (name, r[name], r["debug_fp32"])
        assert r[name] != r["debug_fp32"]
        err, owed = r[name + "_roundtrip"]
        assert owed > 0 and err <= 1e-6 * owed, (name, err, owed)
    for rank, x in enumerate(res):  # every tp rank reloads its own unit means
        err, owed = x["zero2_tp_mean_err"]
        assert owed > 0 and err == 0, (rank, err, owed)
    _check_diloco_equals_dp(r)
    # Residual checkpoint: nonzero, resharded to dp=2 x tp=2 exactly (mean kept).
    assert r["residual_total"] > 0 and r["residual_is_dtensor"]
    assert r["residual_reshard_err"] < 1e-6


def _layouts_body(tokens, layouts):
    return [diloco_equals_dp(tokens, plan, "debug") for plan in layouts]


@pytest.mark.slow
def test_diloco_composes_with_tp_pp_and_hsdp():
    """DiLoCo's replicas hold tensor-parallel, pipelined or FSDP-sharded (HSDP: ZeRO-2/3 inside
    a replica, replicas on dp_replicate) models: H=1 + SGD still equals data-parallel SGD."""
    layouts = [dict(tp=2, dp=2), dict(pp=2, dp=2, schedule="gpipe", micro_batch=1),
               dict(dp=4, zero=2, dp_replicate=2), dict(dp=4, zero=3, dp_replicate=2)]
    res = run_on_ranks(_layouts_body, 4, demo_tokens(SHORT), layouts, timeout=900)
    for per_rank in zip(*res):
        for r in per_rank:
            _check_diloco_equals_dp(r)


PARITY_STEPS = 60


def _parity_train(tokens, plan):
    """PARITY_STEPS steps of tiny on 2 ranks with AdamW and the run's default schedule
    (meshtron.config.OptimConfig: lr 2e-3, warm-up 20, cosine); returns (rank-mean losses,
    the largest weight difference between the replicas right after each sync)."""
    import torch.distributed as dist

    from meshtron.compress import diloco as dl
    from meshtron.config import OptimConfig
    from meshtron.model import Transformer, preset
    from meshtron.parallel import build_mesh, build_optimizer, parallelize
    from meshtron.parallel.mesh import data_mesh
    from meshtron.train.optim import build_scheduler

    cfg = OptimConfig()
    mesh = build_mesh(plan, dist.get_world_size(), device_type="cpu")
    torch.manual_seed(0)
    pm = parallelize(Transformer(preset("tiny")), plan, mesh)
    opt = build_optimizer(pm, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    sched = build_scheduler(opt, cfg, PARITY_STEPS)
    outer = dl.attach(pm, pm.layout)
    dp, r = data_mesh(mesh).size(), data_mesh(mesh).get_local_rank()
    rows = tokens.shape[1] // dp
    losses, spread = [], 0.0
    for step in range(PARITY_STEPS):
        batch = tokens[step, r * rows:(r + 1) * rows]
        loss = pm.forward_backward(batch[:, :-1], batch[:, 1:]).detach().clone()
        dist.all_reduce(loss)
        losses.append(float(loss) / dist.get_world_size())
        pm.clip_grad_norm_(cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        if outer is not None and outer.after_inner_step():
            for p in pm.parameters():
                hi, lo = p.detach().clone(), p.detach().clone()
                dist.all_reduce(hi, op=dist.ReduceOp.MAX)
                dist.all_reduce(lo, op=dist.ReduceOp.MIN)
                spread = max(spread, float((hi - lo).abs().max()))
    syncs = outer.syncs if outer is not None else 0
    _release(pm, mesh, outer)
    return losses, spread, syncs


def _parity_body(tokens):
    return {name: _parity_train(tokens, plan) for name, plan in
            [("dp", dict(dp=2)), ("h4", dict(dp=2, diloco=4)), ("h16", dict(dp=2, diloco=16))]}


@pytest.mark.slow  # suite time (stop 44): a scenario a default test covers
def test_diloco_trains_as_well_as_data_parallel():
    """DiLoCo's defaults (H=4 and H=16) reach data parallelism's loss over a horizon where the
    losses have moved (see the module doc)."""
    r = run_on_ranks(_parity_body, 2, demo_tokens(PARITY_STEPS), timeout=900)[0]
    last = lambda xs: sum(xs[-5:]) / 5  # noqa: E731
    dp = r["dp"][0]
    assert last(dp) < 0.6 * dp[0], dp  # trained: far from the initial loss
    for name, syncs in (("h4", PARITY_STEPS // 4), ("h16", PARITY_STEPS // 16)):
        losses, spread, n = r[name]
        assert n == syncs, (name, n)
        assert spread == 0.0, (name, spread)  # every replica restarts from theta_global
        assert losses != dp  # the replicas really stepped alone
        assert abs(last(losses) - last(dp)) / last(dp) < 0.04, (name, last(losses), last(dp))
