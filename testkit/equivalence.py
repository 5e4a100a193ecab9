"""Numerical-equivalence checks: parallel training vs one process, same seed, data, global batch.

`reference_run(cfg)` trains the plain model in one process; `parallel_rank_fn(cfg, layouts)` is
the per-rank function for `run_on_ranks`: for each layout (a dict of plan attributes) it builds
a fresh mesh and model from the same seed, trains `cfg["steps"]` steps with the parallel runtime
and returns losses, gradient norms and (from one rank per pipeline stage) the unsharded
parameters. `compare(ref, results)` gives the worst relative differences.

A layout may carry a "model" entry: ModelSpec fields that override `cfg["spec"]` for that
layout only (e.g. a GPT-style model next to the Llama-style default in the same launch);
`layout_cfg(cfg, layout)` gives the cfg to build and reference it with, and `compare` takes a
function layout -> reference run for such mixed lists.
"""

from __future__ import annotations

import gc
import time
from typing import Any

DEFAULT_CFG: dict[str, Any] = {
    # GQA (8 query heads over 4 kv heads), odd vocabulary, tp up to 4, up to 4 pipeline stages.
    "spec": dict(name="equiv", layers=4, hidden=64, heads=8, kv_heads=4, ffn_hidden=96,
                 vocab=131, max_seq=32),
    "seed": 1234,
    "steps": 3,
    "batch": 8,
    "seq": 16,
    "lr": 1e-3,
    # Adam amplifies gradient noise by up to lr/eps (d update / d g): fp32 summation-order noise
    # (~1e-8 absolute on these gradients) must stay below 1e-5 of the weights after the update,
    # so lr/eps = 10 here. A wrong gradient scale then also shows in the update.
    "eps": 1e-4,
    "weight_decay": 0.1,
    "clip": 0.5,
}


# GPT-2 style: LayerNorm with bias, learned absolute positions, biases on every linear layer,
# GELU MLP, multi-head attention, tied input/output embeddings (pp > 1 refuses tied embeddings).
GPT_MODEL: dict[str, Any] = dict(name="equiv-gpt", heads=4, kv_heads=4, ffn_hidden=128,
                                 mlp="gelu", norm="layernorm", position="learned", bias=True,
                                 tied_embeddings=True)
# GPT-NeoX/GPT-J style for pipelines: the same, untied, with the parallel residual.
GPT_PARALLEL_RESIDUAL_MODEL: dict[str, Any] = dict(GPT_MODEL, name="equiv-gpt-pr",
                                                   tied_embeddings=False,
                                                   parallel_residual=True)


def layout_cfg(cfg: dict[str, Any], layout: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(cfg for this layout, plan attributes): a layout's "model" entry overrides cfg["spec"];
    "documents": True trains packed documents under the document mask (`document_eos`)."""
    plan = {k: v for k, v in layout.items() if k not in ("model", "documents")}
    if layout.get("documents"):
        cfg = dict(cfg, documents=True)
    if not layout.get("model"):
        return cfg, plan
    return dict(cfg, spec=dict(cfg["spec"], **layout["model"])), plan


def make_spec(cfg: dict[str, Any]):
    from meshtron.model.spec import ModelSpec

    return ModelSpec(**cfg["spec"])


def make_data(cfg: dict[str, Any]):
    """tokens [steps, batch, seq+1] from a seeded generator; inputs/targets are shifted views."""
    import torch

    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    spec = make_spec(cfg)
    tokens = torch.randint(0, spec.vocab, (cfg["steps"], cfg["batch"], cfg["seq"] + 1),
                           generator=g)
    eos = document_eos(cfg)
    if eos is not None:
        # documents of DOCUMENT_EVERY tokens, offset per row: they cross every chunk boundary
        # of context parallelism (chunks of seq/(2*cp) tokens)
        for row in range(cfg["batch"]):
            tokens[:, row, row % DOCUMENT_EVERY::DOCUMENT_EVERY] = eos
    return tokens[..., :-1], tokens[..., 1:]


DOCUMENT_EVERY = 5
"""Tokens per packed document of `make_data` with cfg["documents"]."""


def document_eos(cfg: dict[str, Any]) -> int | None:
    """The end-of-document token of cfg["documents"] runs (the vocabulary's last id), else None."""
    return cfg["spec"]["vocab"] - 1 if cfg.get("documents") else None


def reference_run(cfg: dict[str, Any]) -> dict[str, Any]:
    """The single-process run. cfg["dtype"] = "bf16" ("fp8": the same with the blocks' Linears
    in emulated FP8, cfg["fp8_recipe"]): the product's one-process bf16 mixed
    precision (meshtron.train.precision.BF16Compute: what FSDP2's MixedPrecisionPolicy
    computes), in micro-batches of cfg["micro_batch"] sequences (default: the whole batch).
    cfg["whole_logits"]: the loss on whole logits, as a tensor-parallel (vocabulary-sharded)
    head computes it (the chunked loss accumulates the head's bf16 gradient chunk by chunk in
    fp32; a pipeline's last stage without tp runs the chunked loss, as one process)."""
    import torch

    from meshtron.model.transformer import Transformer, cross_entropy_loss
    from meshtron.train.loop import forward_backward
    from meshtron.train.optim import adamw_kernel
    from meshtron.train.precision import BF16Compute

    torch.manual_seed(cfg["seed"])
    model = Transformer(make_spec(cfg))
    model.document_eos = document_eos(cfg)
    # The product's AdamW kernel (fused on CPU): element-wise, so every layout's shards get
    # exactly the reference's update for their elements.
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), eps=cfg["eps"],
                            weight_decay=cfg["weight_decay"], **adamw_kernel("cpu"))
    mp = BF16Compute(model) if cfg.get("dtype", "fp32") in ("bf16", "fp8") else None
    if cfg.get("dtype") == "fp8":  # the bf16 copy's block Linears in (emulated) FP8
        from meshtron.parallel.fp8 import convert_to_fp8

        convert_to_fp8(mp.model, cfg.get("fp8_recipe", "rowwise"), torch.device("cpu"))
    inputs, targets = make_data(cfg)
    losses, norms = [], []
    for step in range(cfg["steps"]):
        loss = forward_backward(model, inputs[step], targets[step],
                                cfg.get("micro_batch") or cfg["batch"], mp,
                                cross_entropy_loss if cfg.get("whole_logits") else None)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def parallel_rank_fn(cfg: dict[str, Any], layouts: list[dict[str, Any]],
                     release: bool = True) -> list[dict[str, Any]]:
    """Per-rank body: train each layout and report. Runs under run_on_ranks.

    Each layout's mesh is released before the next is built (`release=False` keeps them, only
    to measure what that costs: the reported thread counts then grow layout by layout)."""
    import torch
    import torch.distributed as dist

    from meshtron.model.transformer import Transformer
    from meshtron.parallel import build_mesh, build_optimizer, parallelize
    from meshtron.parallel.mesh import data_mesh, release_mesh
    from meshtron.train.optim import adamw_kernel

    world = dist.get_world_size()
    base_cfg = cfg
    out = []
    for layout in layouts:
        t0 = time.perf_counter()
        cfg, plan_attrs = layout_cfg(base_cfg, layout)
        inputs, targets = make_data(cfg)
        plan = dict(plan_attrs)
        mesh = build_mesh(plan, world, device_type="cpu")
        torch.manual_seed(cfg["seed"])
        # On meta: parallelize materializes only this rank's shards, and they must equal the
        # reference's single-process initialization (meshtron/model/init.py).
        with torch.device("meta"):
            model = Transformer(make_spec(cfg))
        pm = parallelize(model, plan, mesh)
        for part in pm.model_parts:  # as meshtron.data.documents.apply_document_mask
            part.document_eos = document_eos(cfg)
        opt = build_optimizer(pm, lr=cfg["lr"], betas=(0.9, 0.95), eps=cfg["eps"],
                              weight_decay=cfg["weight_decay"], **adamw_kernel("cpu"))
        dp, dp_rank = data_mesh(mesh).size(), data_mesh(mesh).get_local_rank()
        rows = cfg["batch"] // dp
        losses, norms = [], []
        for step in range(cfg["steps"]):
            x = inputs[step, dp_rank * rows:(dp_rank + 1) * rows]
            y = targets[step, dp_rank * rows:(dp_rank + 1) * rows]
            losses.append(float(pm.forward_backward(x, y)))
            norms.append(float(pm.clip_grad_norm_(cfg["clip"])))
            opt.step()
            opt.zero_grad()
        params = pm.full_parameters()
        # forward outputs a pipeline stage still holds after the step (torch keeps each
        # micro-batch's logits unless the schedule is stepped with return_outputs=False)
        stages = getattr(pm, "_stages", None) or ()
        kept = sum(len(st.output_chunks) for st in stages)
        # sends and receives to this rank itself in the stages' neighbour warm-up (gloo has no
        # such pair; torch 2.11 runs the warm-up for every stage: parallel/pipeline.py)
        self_p2p = sum(op.group_peer == st.group_rank for st in stages
                       for op in st._get_init_p2p_neighbors_ops())
        keep = mesh.get_local_rank("dp") == 0 and mesh.get_local_rank("tp") == 0
        out.append({"layout": layout, "losses": losses, "norms": norms,
                    "coords": {n: mesh.get_local_rank(n) for n in mesh.mesh_dim_names},
                    "params": params if keep else None, "kept_outputs": kept,
                    "self_p2p": self_p2p,
                    "seconds": time.perf_counter() - t0, "threads": thread_count()})
        # Free this layout's groups (and their backend threads) before building the next one.
        del pm, opt, model
        if release:
            release_mesh(mesh)
        del mesh
        gc.collect()
    return out


def build_parallel(cfg: dict[str, Any], plan: dict[str, Any], seed: int, **optimizer_kw):
    """(parallel model, optimizer, mesh) of `plan` on this rank, built on meta and materialized
    by `parallelize` (the same weights as a single-process init on `seed`)."""
    import torch

    from meshtron.model.transformer import Transformer
    from meshtron.parallel import build_mesh, build_optimizer, parallelize

    mesh = build_mesh(dict(plan), device_type="cpu")
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(make_spec(cfg))
    pm = parallelize(model, dict(plan), mesh)
    opt = build_optimizer(pm, lr=cfg["lr"], betas=(0.9, 0.95), eps=cfg["eps"],
                          weight_decay=cfg["weight_decay"], **optimizer_kw)
    return pm, opt, mesh


def train_step(pm, opt, mesh, cfg: dict[str, Any], batch: tuple, sched=None) -> float:
    """One optimizer step of a parallel model on its data-parallel rank's rows of `batch`
    ((inputs, targets) of the whole global batch): clip, step, (schedule), zero; the loss."""
    from meshtron.parallel.mesh import data_mesh

    inputs, targets = batch
    dp, r = data_mesh(mesh).size(), data_mesh(mesh).get_local_rank()
    rows = cfg["batch"] // dp
    loss = pm.forward_backward(inputs[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows])
    pm.clip_grad_norm_(cfg["clip"])
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad()
    return float(loss)


def dcp_save(pm, opt, checkpoint_id: str) -> None:
    """Save `pm` and `opt` with DCP as `dcp_load` reads them (every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": pm.state_dict(), "optim": opt.state_dict()}, checkpoint_id=checkpoint_id)


def dcp_load(pm, opt, checkpoint_id: str) -> None:
    """Load a model + optimizer checkpoint saved with DCP (`{"model": ..., "optim": ...}`,
    possibly from another layout) into `pm` and `opt`, resharding it to their layout."""
    import torch.distributed.checkpoint as dcp

    state = {"model": pm.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint_id)
    pm.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])


def thread_count() -> int:
    """Threads of this process (backend threads included), from /proc where there is one."""
    import os
    import threading

    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


# Denominator floor for parameter differences: tensors smaller than the model's smallest weight
# scale (residual projections: std 0.02/sqrt(2L) = 0.007, max ~0.025) are held to an absolute
# TOL * 1e-2 = 1e-7 instead of a relative error. Those are biases (~1e-3 after 3 steps of lr
# 1e-3, and the key bias ~1e-8: causal softmax is invariant to it, so its exact gradient is 0):
# their gradients sum over every token (fp32 order noise ~5e-8 absolute, 3x larger under TP than
# with micro-batching, measured), and AdamW's step amplifies that by up to lr/eps = 10 where
# |g| ~ eps, i.e. ~3e-8 absolute: noise of 1e-5 relative to a 3e-3 tensor, 3e-6 against the
# floor. A real gradient bug moves a parameter by ~lr = 1e-3 per step.
PARAM_SCALE_FLOOR = 1e-2


def compare(ref: Any, rank_results: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per layout: worst relative loss, grad-norm and parameter differences over all ranks.

    `ref`: a `reference_run` result, or a function layout -> reference (layouts with their own
    "model")."""
    import torch

    ref_for = ref if callable(ref) else (lambda layout: ref)
    report = []
    for i in range(len(rank_results[0])):
        per_rank = [r[i] for r in rank_results]
        ref = ref_for(per_rank[0]["layout"])
        loss_rel = max(abs(a - b) / abs(b) for r in per_rank for a, b in
                       zip(r["losses"], ref["losses"]))
        norm_rel = max(abs(a - b) / abs(b) for r in per_rank for a, b in
                       zip(r["norms"], ref["norms"]))
        merged: dict[str, torch.Tensor] = {}
        for r in per_rank:
            if r["params"]:
                merged.update(r["params"])
        missing = sorted(set(ref["params"]) - set(merged))
        extra = sorted(set(merged) - set(ref["params"]))
        param_rel = 0.0
        worst = None
        for name, want in ref["params"].items():
            if name not in merged:
                continue
            got = merged[name]
            rel = float((got.float() - want).abs().max()
                        / want.abs().max().clamp_min(PARAM_SCALE_FLOOR))
            if rel > param_rel:
                param_rel, worst = rel, name
        report.append({"layout": per_rank[0]["layout"], "loss_rel": loss_rel,
                       "norm_rel": norm_rel, "param_rel": param_rel, "worst_param": worst,
                       "missing": missing, "extra": extra,
                       "seconds": max(r["seconds"] for r in per_rank),
                       "threads": max(r.get("threads", 0) for r in per_rank)})
    return report


def format_report(report: list[dict[str, Any]]) -> str:
    lines = []
    for r in report:
        layout = {k: v for k, v in r["layout"].items() if k != "model"}
        if r["layout"].get("model"):
            layout["model"] = r["layout"]["model"].get("name", "custom")
        lines.append(f"{layout}: loss {r['loss_rel']:.2e} norm {r['norm_rel']:.2e} "
                     f"param {r['param_rel']:.2e} ({r['worst_param']}) {r['seconds']:.1f}s "
                     f"{r.get('threads', 0)} threads/rank"
                     + (f" MISSING {r['missing'][:3]}" if r["missing"] else "")
                     + (f" EXTRA {r['extra'][:3]}" if r["extra"] else ""))
    return "\n".join(lines)


__all__ = ["DEFAULT_CFG", "GPT_MODEL", "GPT_PARALLEL_RESIDUAL_MODEL", "reference_run",
           "parallel_rank_fn", "compare", "format_report", "layout_cfg", "make_data", "make_spec"]
