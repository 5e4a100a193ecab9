"""The training loop's mixture-of-experts hooks (meshtron/train/router.py): the auxiliary loss
weighted 1/M over M micro-batches, the balancing bias moved once per optimizer step on the load
summed over the data ranks, router statistics in metrics.jsonl; dp=2 against one process."""

from __future__ import annotations

import json

import pytest

import torch

from meshtron.model import PRESETS, Transformer
from meshtron.model.moe import MoE
from testkit.engine_runs import token_batches, train_cfg

STEPS = 3


def _cfg(model: str, tmp=None, micro: int = 2, **train):
    return train_cfg(model, STEPS, tmp, micro, **train)


def _batches(vocab: int):
    return token_batches(vocab, STEPS)


def _biases(model) -> list[torch.Tensor]:
    out = []
    for m in model.modules():
        if isinstance(m, MoE) and m.router.expert_bias is not None:
            b = m.router.expert_bias
            out.append((b.full_tensor() if hasattr(b, "full_tensor") else b).detach().clone())
    return out


def _local_run(model: str, dtype: str = "fp32"):
    from meshtron.train.loop import LocalEngine

    from testkit.bf16 import one_thread

    cfg = _cfg(model, dtype=dtype)
    with one_thread():  # the ranks' one thread (routing amplifies a GEMM's blocking)
        engine = LocalEngine(cfg)
        losses = [float(engine.train_step(tokens[:, :-1], tokens[:, 1:]).loss)
                  for tokens in _batches(cfg.model.vocab)]
    return engine, losses


def test_aux_loss_is_weighted_one_over_m_micro_batches():
    """Eight copies of one sequence: every micro-batch has the full batch's auxiliary loss, so
    M=4 micro-batches of 2 must give the gradient of one micro-batch of 8 (without the 1/M
    weight the auxiliary term's gradient would be 4x)."""
    from meshtron.train.loop import forward_backward

    spec = PRESETS["tiny-moe"]
    torch.manual_seed(0)
    row = torch.randint(0, spec.vocab, (1, 33))
    tokens = row.repeat(8, 1)
    grads = []
    for micro in (8, 2):
        torch.manual_seed(0)
        model = Transformer(spec)
        forward_backward(model, tokens[:, :-1], tokens[:, 1:], micro)
        grads.append(torch.cat([m.router.gate.weight.grad.flatten()
                                for m in model.modules() if isinstance(m, MoE)]))
    # the auxiliary term is a visible part of the router's gradient ...
    torch.manual_seed(0)
    model = Transformer(spec)
    for m in model.modules():
        if isinstance(m, MoE):
            m.aux_loss_scale = 0.0
    forward_backward(model, tokens[:, :-1], tokens[:, 1:], 8)
    no_aux = torch.cat([m.router.gate.weight.grad.flatten()
                        for m in model.modules() if isinstance(m, MoE)])
    assert (grads[0] - no_aux).abs().max() > 1e-3 * grads[0].abs().max()
    # ... and equal for 1 and 4 micro-batches
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_balancing_bias_moves_in_training_and_bf16_copy_follows():
    engine, _ = _local_run("tiny-moe-ds")
    biases = _biases(engine.model)
    gamma = PRESETS["tiny-moe-ds"].moe_bias_update
    assert len(biases) == 3  # 4 layers, the first dense
    for b in biases:
        assert b.abs().max() > 0
        # STEPS sign steps of size gamma: an integer multiple of gamma, at most STEPS of them
        k = b / gamma
        assert torch.allclose(k, k.round(), atol=1e-4) and k.abs().max() <= STEPS
    bf16, _ = _local_run("tiny-moe-ds", dtype="bf16")
    master, copy = _biases(bf16.model), _biases(bf16.mp.model)
    assert all(m.abs().max() > 0 for m in master)
    for m, c in zip(master, copy):
        assert c.dtype == torch.bfloat16 and torch.equal(c, m.to(torch.bfloat16))


def test_train_writes_router_statistics(tmp_path):
    from meshtron.cli import main

    run, text = tmp_path / "run", tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n"
                            for i in range(400)))
    assert main(["train", "--model", "tiny-moe", "--steps", "2", "--seq-len", "32",
                 "--data", str(text),
                 "--global-batch", "4", "--log-every", "1", "--run-dir", str(run)]) == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert r["moe_imbalance_max"] >= r["moe_imbalance_mean"] >= 1.0
        assert r["moe_dropped"] == 0
        # Switch loss E * sum f_i P_i: 1 when balanced, up to E (8)
        assert 0.9 < r["moe_aux_loss"] < 8.0


CASES = [("tiny-moe", dict(dp=2, zero=3)), ("tiny-moe-ds", dict(dp=2, zero=3)),
         ("tiny-moe-ds", dict(pp=2, zero=0, schedule="1f1b"))]


def two_rank_fn(cases) -> list[dict]:
    """Per rank (under run_on_ranks): STEPS steps of each case, 2 micro-batches of 2 rows per
    data rank: dp=2 (ZeRO-3) on rows [4r, 4r+4) of the single-process batches, or pp=2 (1F1B,
    whose first step infers shapes with an extra forward per stage) on all of them."""
    import torch.distributed as dist

    from meshtron.planner.plan import Plan
    from meshtron.train.parallel import ParallelEngine

    torch.set_num_threads(1)
    out = []
    for name, kw in cases:
        cfg = _cfg(name)
        kw = {"tp": 1, "pp": 1, "dp": 1, **kw}
        plan = Plan(model=name, cluster="test", global_batch=8, seq_len=32, micro_batch=2,
                    recompute="none", dtype="fp32", **kw)
        engine = ParallelEngine(cfg, plan, torch.device("cpu"))
        r, rows = engine.dp_rank, 8 // kw["dp"]
        losses = []
        for tokens in _batches(cfg.model.vocab):
            part = tokens[rows * r:rows * (r + 1)]
            losses.append(float(engine.train_step(part[:, :-1], part[:, 1:]).loss))
        record = engine.router_record()
        memory = engine.memory_bytes()
        biases = [b.tolist() for b in _biases(engine.pm.model_parts[0])]
        out.append({"losses": losses, "record": record, "biases": biases, "memory": memory})
        engine.release()
        dist.barrier()
    return out


def test_dp2_and_pp2_match_one_process():
    from meshtron.planner.memory_ranks import rank_states
    from meshtron.planner.plan import Plan
    from testkit.multiproc import run_on_ranks

    results = run_on_ranks(two_rank_fn, 2, CASES, timeout=300)
    refs = {name: _local_run(name) for name in {n for n, _ in CASES}}
    for i, (name, kw) in enumerate(CASES):
        engine, ref = refs[name]
        ref_bias = _biases(engine.model)
        got = [results[rank][i] for rank in range(2)]
        for rank in range(2):
            assert got[rank]["losses"] == pytest.approx(ref, rel=1e-5), (name, kw, rank)
            rec = got[rank]["record"]
            assert rec["moe_dropped"] == 0 and rec["moe_imbalance_max"] >= 1.0
        assert got[0]["record"] == got[1]["record"]
        # dp: every rank holds every bias; pp: each stage its layers'
        biases = (got[0]["biases"] + got[1]["biases"] if kw.get("pp") else got[0]["biases"])
        if kw.get("dp"):
            assert got[0]["biases"] == got[1]["biases"]
        assert len(biases) == len(ref_bias)
        for b, want in zip(biases, ref_bias):
            assert torch.allclose(torch.tensor(b), want, atol=1e-9), (name, kw)
        if name == "tiny-moe-ds":
            assert any(torch.tensor(b).abs().max() > 0 for b in biases)
        if kw.get("dp"):
            # the planner's per-rank states (the balancing bias a parameter without gradient
            # or AdamW state) are the bytes the runtime holds
            plan = Plan(1, 1, 2, 3, 2, "none", False, None, 1, dtype="fp32")
            for rank, st in enumerate(rank_states(PRESETS[name], plan, "fp32")):
                m = got[rank]["memory"]
                assert (m["params"], m["grads"], m["optimizer"]) == (
                    st.params, st.grads, st.optimizer), (name, rank)
