"""Training on many ranks: the plan's mesh, `meshtron.parallelize`, and the shared loop.

Every rank builds the model on the meta device from the same seed, `parallelize` shards it and
materializes only this rank's shards, initialized to exactly the single-process weights
(meshtron/model/init.py) or read from a Hugging Face checkpoint (`train.init_from`); data-parallel rank r
reads rows [r*B/dp, (r+1)*B/dp) of the single-process global batch. Together these make every
layout reproduce the single-process losses (tests/test_parallel*.py).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from meshtron import doctor
from meshtron.config import RunConfig
from meshtron.errors import UserError
from meshtron.launch import World
from meshtron.model import Transformer
from meshtron.train import outputs, router
from meshtron.train.features import build_features, stateful_features
from meshtron.train.loop import StepOutput, build_run_data, read_values, run_loop
from meshtron.train.optim import adamw_kernel, build_scheduler, param_groups
from meshtron.hf.hooks import export_at_end, hf_fill
from meshtron.data.documents import apply_document_mask, check_document_layout
from meshtron.data.tokenizer import keep_tokenizer


def _adamw_factory(weight_decay: float, device_type: str):
    """AdamW with the single-process parameter groups (decay on matrices only) and the
    single-process kernel choice, for `build_optimizer`, which hands it the parameters of one
    model part or ZeRO-1 shard."""

    def make(params, **kwargs):
        kwargs.pop("weight_decay", None)
        groups = param_groups(params, weight_decay)
        return torch.optim.AdamW([g for g in groups if g["params"]], **adamw_kernel(device_type),
                                 **kwargs)

    return make


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def runtime_plan(plan, dtype: str, fp8_recipe: str | None = None, compile: bool = False):
    """The plan with the run's precision (and FP8 recipe), compiled when the plan or the run
    (`train.compile`, `--compile`) says so, as `parallelize` reads it."""
    import dataclasses

    if dtype == "fp8" and fp8_recipe is not None:
        plan = dataclasses.replace(plan, fp8_recipe=fp8_recipe)
    return dataclasses.replace(plan, dtype=dtype, compile=plan.compile or compile)


class ParallelEngine:
    """A plan executed over a DeviceMesh; the same interface as `LocalEngine`."""

    def __init__(self, cfg: RunConfig, plan, device: torch.device):
        from meshtron.parallel import build_mesh, build_optimizer, parallelize
        from meshtron.parallel.mesh import data_mesh

        check_document_layout(cfg, plan)
        from meshtron.train.precision import configure_matmul_precision

        configure_matmul_precision(device, cfg.train.dtype)
        rt = runtime_plan(plan, cfg.train.dtype, cfg.train.fp8_recipe, cfg.train.compile)
        self.compiles = rt.compile
        """Per-block torch.compile (the loop reports `compile_time_s` apart)."""
        self.mesh = build_mesh(rt, device_type=device.type, spec=cfg.model)
        self.dp_rank = data_mesh(self.mesh).get_local_rank()
        torch.manual_seed(cfg.train.seed)
        with torch.device("meta"):  # no rank ever holds the whole model
            model = Transformer(cfg.model)
        self.pm = parallelize(model, rt, self.mesh, fill=hf_fill(cfg))
        self.optimizer = build_optimizer(
            self.pm, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay,
            optimizer_cls=_adamw_factory(cfg.optim.weight_decay, device.type))
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.grad_clip = cfg.optim.grad_clip
        self.is_main = dist.get_rank() == 0
        self.grad_bytes: int | None = None
        self.spec = cfg.model
        self._moe: list | None = None
        self._dp_group: Any = False  # not made yet (see _data_group)
        self.features = build_features(self.pm, rt, self._moe_layers(), self._data_group,
                                       last_step=cfg.train.steps)
        """Called after every optimizer step (meshtron/train/features.py)."""
        # Error-feedback residuals or DiLoCo's outer state: a Stateful to checkpoint (or None).
        self.compress_state = stateful_features(self.features).get("compress")
        self.diloco = self.compress_state if rt.diloco > 0 else None  # checkpoint/state.py reads it
        # meshtron.checkpoint saves (and reshards) these beside the model and optimizer.
        self.checkpoint_extras = stateful_features(self.features)
        self._wire_mark = 0  # Reducer.bytes_sent at the last logged step (comm_record)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        """One optimizer step with no host synchronisation."""
        moe = self._moe_layers()
        if moe:  # pipeline schedules scale every gradient by 1/M (scale_grads), aux included
            n_micro = inputs.shape[0] // self.pm.layout.micro_batch
            router.set_accum_scale(moe, 1.0 if self.pm.is_pipelined else 1.0 / n_micro)
        loss = self.pm.forward_backward(inputs, targets)
        if self.grad_bytes is None:  # measured where gradients peak: after backward
            self.grad_bytes = sum(_local(p.grad).numel() * _local(p.grad).element_size()
                                  for p in self.pm.parameters() if p.grad is not None)
        norm = self.pm.clip_grad_norm_(self.grad_clip) if self.grad_clip > 0 else None
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        for feature in self.features:  # FP8 scales, MoE balancing bias, DiLoCo's outer step
            feature.after_optimizer_step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        return StepOutput(loss, norm, lr)

    def _moe_layers(self) -> list:
        if self._moe is None:
            self._moe = router.moe_layers(self.pm.model_parts) if self.spec.is_moe else []
        return self._moe

    def _data_group(self):
        """The ranks that route different tokens through the same experts: dp (x cp); None
        when alone. Made once (with cp, a `_flatten`: every rank reaches it at step 1)."""
        if self._dp_group is False:
            lay = self.pm.layout
            self._dp_group = (self.pm._loss_mesh().get_group() if lay.dp * lay.cp > 1
                              else None)
        return self._dp_group

    def router_record(self) -> dict[str, float]:
        """Router statistics over every rank's MoE layers (meshtron/train/router.py)."""
        lay = self.pm.layout
        return router.router_record(
            self._moe_layers(), self.spec, self.pm.device, dp_group=self._data_group(),
            dp=lay.dp * lay.cp,
            pp_group=self.mesh["pp"].get_group() if self.pm.is_pipelined else None)

    def read_log(self, out: StepOutput, seconds: float) -> tuple[float, float | None, float]:
        """(loss, grad norm, the slowest rank's seconds): one all-reduce, one host read."""
        return read_values(out, seconds, self.pm.device,
                           reduce_max=lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX))

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        return float(torch.stack([self.pm.evaluate(x, y) for x, y in batches]).mean())

    def comm_record(self, steps: int) -> dict[str, Any]:
        """For a metrics record `steps` steps after the last: the bytes this rank put on the
        wire per step in meshtron.compress's reductions (`Reducer.bytes_sent`, a host counter:
        no device sync; compressed gradients, or DiLoCo's outer all-reduce; FSDP2's own
        all-gathers are not counted) and DiLoCo's outer syncs so far. {} without either."""
        state = self.compress_state
        if state is None or steps <= 0:
            return {}
        sent = state.reducer.bytes_sent
        out: dict[str, Any] = {"wire_bytes_per_step": (sent - self._wire_mark) / steps}
        self._wire_mark = sent
        if self.diloco is not None:
            out["diloco_syncs"] = self.diloco.syncs
        return out

    def comm_summary(self, steps: int) -> dict[str, Any]:
        """summary.json's view of `comm_record` over this attempt's `steps` steps."""
        state = self.compress_state
        if state is None or steps <= 0:
            return {}
        out: dict[str, Any] = {"wire_bytes_per_step": state.reducer.bytes_sent / steps,
                               # 'none' under compress_scope='inter_node' inside one node
                               "wire_codec": state.reducer.codec.mode}
        if self.diloco is not None:
            out["diloco_syncs"] = self.diloco.syncs
        return out

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: parameter, gradient and optimizer-state shards (and the CUDA
        allocator's peak on GPU)."""
        params = list(self.pm.parameters())
        out = {"params": sum(_local(p).numel() * _local(p).element_size() for p in params),
               "grads": self.grad_bytes or 0,
               "optimizer": 0}
        for opt in self.optimizer.optimizers:
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        out["optimizer"] += _local(v).numel() * _local(v).element_size()
        out["compress"] = self._compress_bytes()
        out["total"] = out["params"] + out["grads"] + out["optimizer"] + out["compress"]
        if torch.cuda.is_available():
            out["cuda_peak_allocated"] = torch.cuda.max_memory_allocated()
        return out

    def _compress_bytes(self) -> int:
        """Bytes of the tensors meshtron.compress keeps: error-feedback residuals, and DiLoCo's
        theta_global and outer momentum (planner/memory_compress.py predicts them)."""
        state = self.compress_state
        if state is None:
            return 0
        held = list(state.reducer.residuals.values())
        if self.diloco is not None:
            held += self.diloco.held_tensors()
        return sum(t.numel() * t.element_size() for t in held)

    def release(self) -> None:
        """Drop the model and optimizer and destroy the mesh's process groups."""
        from meshtron.parallel.mesh import release_mesh

        for feature in self.features:
            feature.release()
        del self.pm, self.optimizer, self.scheduler, self.diloco, self.compress_state
        del self.features, self.checkpoint_extras
        release_mesh(self.mesh)


def predicted_memory(cfg: RunConfig, plan, cluster) -> dict[str, Any] | None:
    """The planner's prediction for exactly this plan and the run's dtype: the fullest rank's
    breakdown (GiB) on `cluster`, and every rank's parameter, gradient and optimizer-state bytes
    (the part memory.json measures exactly)."""
    import dataclasses

    from meshtron.planner.memory_compress import compress_bytes
    from meshtron.planner.memory_ranks import rank_states
    from meshtron.planner.search import evaluate_plan
    from meshtron.train.planning import sized_cluster

    run_plan = dataclasses.replace(plan, dtype=cfg.train.dtype)
    comm = compress_bytes(cfg.model, run_plan, cfg.train.dtype)
    out: dict[str, Any] = {"bytes_per_rank": [
        {"rank": st.rank, "params": st.params, "grads": st.grads, "optimizer": st.optimizer,
         "compress": comm[st.rank], "total": st.total + comm[st.rank]}
        for st in rank_states(cfg.model, run_plan, cfg.train.dtype)]}
    out["fullest_rank_gib"] = None  # no cluster, or one the plan cannot be costed on
    if cluster is not None:
        try:
            est = evaluate_plan(cfg.model, sized_cluster(cluster, plan.gpus), plan.global_batch,
                                plan.seq_len, run_plan)
        except UserError:
            return out
        out["fullest_rank_gib"] = est.memory.to_dict()
    return out


def train_on_rank(cfg: RunConfig, plan, world: World, device: torch.device,
                  cluster=None, show_progress: bool = True,
                  fresh_tokenizer: bool = True, checkpoint=None,
                  trace_samples: bool = False, curves: bool = True) -> dict[str, Any] | None:
    """Run the plan on this rank (process group already initialised); rank 0 writes the run's
    outputs and returns the summary, with the planner's prediction beside the measurement when
    a cluster is known. `fresh_tokenizer`: no launching parent has trained the run's BPE
    tokenizer yet (rank 0 trains it). `checkpoint`: a `meshtron.checkpoint.CheckpointConfig`,
    or None. `trace_samples`: every metrics record names its step's samples (elastic runs:
    the sampler's `last_step_fields`). `curves=False`: the launching parent draws curves.png
    (outputs.draw_run_curves)."""
    from meshtron.checkpoint.checkpointer import make_checkpointer
    from meshtron.parallel.mesh import named_submeshes

    engine = ParallelEngine(cfg, plan, device)
    doctor.watch_mesh(engine.mesh, named_submeshes(engine.mesh))
    data = build_run_data(cfg, dp_rank=engine.dp_rank, dp_size=plan.dp, main=engine.is_main,
                          barrier=dist.barrier, fresh=fresh_tokenizer)
    ckpt = make_checkpointer(checkpoint, cfg, engine, data, plan)
    run_dir = outputs.prepare_run_dir(cfg, engine.is_main, extra={"plan": plan.to_dict()},
                                      resume=ckpt is not None and ckpt.may_resume)
    if engine.is_main:
        keep_tokenizer(data.tokenizer, run_dir)
    apply_document_mask(engine.pm.model_parts, cfg, data.tokenizer)
    # MFU needs a real peak: the calibrated or catalogue figure, not the nominal placeholder.
    known = cluster is not None and not cluster.name.startswith("nominal")
    peak = world.world_size * cluster.peak_tflops * 1e12 if known else None
    with outputs.extra_writers(cfg, run_dir, engine.is_main) as writers:
        result = run_loop(engine, data, cfg, run_dir, show_progress, peak_flops=peak,
                          writers=writers, checkpointer=ckpt, trace_samples=trace_samples)
    export_at_end(cfg, run_dir, pm=engine.pm)
    comm = engine.comm_summary(result.steps - result.resumed_from_step)
    memory = engine.memory_bytes()
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, memory)
    engine.release()
    if not engine.is_main:
        return None
    predicted = plan.predicted or {}
    summary = {**result.to_dict(), "plan": plan.to_dict(), "world_size": world.world_size,
               # this attempt's steps: the plan predicted is this attempt's (a --resume may
               # change the layout; step_time_s spans every attempt's steps)
               "measured_step_time_s": result.attempt_step_time_s,
               "predicted_step_time_s": predicted.get("step_time_s"), **comm}
    if ckpt is not None and ckpt.snapshots is not None:  # host memory: own + peer copy
        summary["snapshot"] = ckpt.snapshots.summary()
    (run_dir / "memory.json").write_text(json.dumps({
        "measured_bytes_per_rank": gathered,
        "measured_max_rank_gib": {k: max(m[k] for m in gathered) / 2**30 for k in gathered[0]},
        "predicted": predicted_memory(cfg, plan, cluster),
        "note": "measured: bytes of each rank's parameter, gradient (after backward) and "
                "optimizer-state shards, and compress: gradient compression's error-feedback "
                "residuals and DiLoCo's outer copy and momentum; on CUDA also the allocator's peak. predicted: the "
                "planner's bytes for every rank (same components) and its full breakdown of "
                "the fullest rank (plus activations, gathered copies and workspace), for the "
                "run's dtype",
    }, indent=2))
    outputs.finish_run(run_dir, summary, result.records, curves=curves)
    return summary

