"""meshtron vs a plain Hugging Face `LlamaForCausalLM` loop, side by side: the same shape
(half the layers that fill the GPU, so an fp32 HF model has headroom), the same global batch
and micro-batch (2), the same recomputation (full: HF's per-layer gradient checkpointing is
the same policy), bf16 compute over fp32 weights
(meshtron: FSDP2 mixed precision; HF: autocast), AdamW (fused on CUDA), clipping at 1.0, SDPA
attention. Each with its own profiler window.
"""

from __future__ import annotations

from gpukit import common as C
from gpukit.cases import run_engine
from gpukit.profile import window


def _hf_model(spec, dev):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshtron.hf.names import hf_config

    d = {k: v for k, v in hf_config(spec).items()
         if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    config = LlamaConfig(**d, attn_implementation="sdpa", use_cache=False)
    with torch.device(dev):  # the kit's own HF model: initialised where it trains
        model = LlamaForCausalLM(config)
    return model.float().train()


def hf_step(model, opt, x, y, micro_batch: int, dev):
    """One optimizer step of the plain loop: gradient accumulation over micro-batches."""
    import torch
    import torch.nn.functional as F

    n_micro = x.shape[0] // micro_batch
    total = torch.zeros((), device=dev)
    for i in range(n_micro):
        xs, ys = x[i * micro_batch:(i + 1) * micro_batch], y[i * micro_batch:(i + 1) * micro_batch]
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(input_ids=xs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), ys.flatten()) / n_micro
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def case_hf(ctx: C.Ctx) -> None:
    import torch

    dev = C.device(ctx)
    C.init_group(dev, ctx)
    clus = C.cluster(ctx)
    spec = C.shape(ctx, C.half(C.largest_fit(ctx, clus)))
    # micro-batch 2 as the first GPU run compared (an fp32 HF model with unchunked logits
    # does not fit the micro-batch the planner picks for meshtron's chunked loss)
    plan, est = C.plan_for(spec, clus, ctx, recompute="full",
                           micro_batch=1 if ctx.dry_run else 2)
    ctx.emit(model=C.describe_model(spec), micro_batch=plan.micro_batch,
             recompute=plan.recompute)
    # the GEMM shapes of this shape are the eager case's per layer: no shapes step here
    m = run_engine(ctx, "meshtron", spec, plan, clus, dev, est, shapes=False)
    C.close_group()
    import transformers

    model = _hf_model(spec, dev)
    if plan.recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
                                                                           False})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                            fused=dev.type == "cuda")
    x, y = C.batch(spec, ctx, dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    def step():
        return hf_step(model, opt, x, y, plan.micro_batch, dev)

    hf = {"transformers": transformers.__version__,
          "params": sum(p.numel() for p in model.parameters())}
    hf["first_steps_s"], _ = C.timed(step, dev, 1 + ctx.warmup)
    times, losses = C.timed(step, dev, ctx.steps)
    hf.update(C.figures(times, spec, ctx, clus, dev), losses=losses)
    ctx.emit(hf=hf)
    hf["profile"] = window(step, dev, 1, x.shape[0] // plan.micro_batch, shapes=False)
    ctx.emit(hf=hf, meshtron_over_hf_tokens_per_s=m["tokens_per_s"] / hf["tokens_per_s"])
