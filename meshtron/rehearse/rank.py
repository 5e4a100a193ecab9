"""One rank of a plan, run alone: a fake process group, the runtime's own build, one step.

`rehearse_rank(spec, plan, rank, device)` joins a fake process group of `plan.gpus` ranks as
`rank` (torch's `fake` backend: every collective and point-to-point returns at once, buffers
untouched), builds the mesh with `build_mesh`, the model on meta, shards it with the runtime's
`parallelize` and `build_optimizer` (the same `Plan`, placement and code `meshtron train`
runs), then runs one optimizer step at the plan's shapes:

* on CPU nothing is allocated: sharding runs outside FakeTensorMode (DeviceMesh and DTensor
  build real index tensors while they shard), the shards are materialized under it, and
  torch's memory tracker (`FSDPMemTracker`, or `MemTracker` when a rank holds several pipeline
  stages or no FSDP unit) records the peak by category;
* on CUDA the tensors are real: the allocator's peak and the step's compute time (the fake
  collectives take no time, so the step is compute-only).

Without a pipeline the step is the runtime's `ParallelModel.forward_backward`. A pipelined
rank's stages cannot run under `torch.distributed.pipelining`'s schedules here: a non-first
stage reads its input shape from a receive the fake group never fills. The stage modules
therefore run directly, one micro-batch at a time in the schedule's order for this pipeline
rank (1F1B / GPipe orders below, the torch schedule object's own `pipeline_order` for the
multi-stage ones), with the input shape a stage receives ([micro_batch, seq/cp(/tp with
sp), hidden] in the compute dtype) and the PipelineStage's own FSDP no-sync and final
gradient reduction (`backward_maybe_with_nosync`, `perform_reduce_grad`). Zero-bubble
schedules run their input and weight gradients apart, at their own slots, as the stage does
(`_input_backward`, `_weight_backward`: torch's stage_backward_input keeps the graph until
the weight gradient).

A mixture of experts routes by value (bincount, uneven all-to-all splits), which fake
tensors cannot size: every MoE layer gets a `StaticCounts` policy (meshtron/model/moe.py), the
mean T*k/E tokens per expert, or `imbalance` times it on the rehearsed rank's experts (the
planner's `expert_imbalance`: the fullest ep rank), and runs the kernel a GPU run uses (one
`torch._grouped_mm` per matrix in bf16). The router itself runs.

AdamW's states are created before the measured step (one step on zero gradients), so the
peak is a steady-state step's: states, gradients and the step's working set together. On CPU
the step runs the fewest of its micro-batches that reach the same peak (microbatches.py: every
micro-batch has the same shapes; `exact=True` runs them all), and a pipelined stage's received
inputs are freed after their backward as a real stage frees them (`_free_received`), and
the tracker's own hooks on a micro-batch's graph are emptied after its backward, which
otherwise keep a split backward's saved tensors to the end of the step (tracker_hooks.py).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

GIB = float(2**30)


def _fake_group(rank: int, world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # never replace a group someone else made
        raise RuntimeError("rehearse: torch.distributed is already initialised in this "
                           "process; rehearse in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _pipeline_order(pm, plan, n_micro: int, pp_rank: int) -> list[tuple[str, int, int]]:
    """(kind 'F'/'B', stage index, micro-batch) actions of this pipeline rank, in order."""
    stage = pm.stage_ids[0]
    if plan.virtual_stages == 1 and plan.schedule in ("gpipe", "1f1b"):
        if plan.schedule == "gpipe":
            return ([("F", stage, i) for i in range(n_micro)]
                    + [("B", stage, i) for i in range(n_micro)])
        # torch's Schedule1F1B: min(m, pp - rank) warm-up forwards, then one backward and one
        # forward in turn, then the remaining backwards
        warm = min(n_micro, plan.pp - pp_rank)
        out = [("F", stage, i) for i in range(warm)]
        f, b = warm, 0
        while b < n_micro:
            out.append(("B", stage, b))
            b += 1
            if f < n_micro:
                out.append(("F", stage, f))
                f += 1
        return out
    sched = pm._schedule(n_micro)  # the runtime's schedule object: its per-rank action list
    out = []
    for action in sched.pipeline_order[pp_rank]:
        if action is None:
            continue
        kind = getattr(action.computation_type, "value", action.computation_type)
        if kind == "F":
            out.append(("F", action.stage_index, action.microbatch_index))
        elif kind in ("B", "I", "W"):  # full backward, or zero bubble's input / weight
            out.append(("W" if kind == "W" else "B", action.stage_index,
                        action.microbatch_index))
    return out


def _stage_input(plan, spec, device, dtype, first: bool, tokens):
    """What a stage receives for one micro-batch: the tokens on the first stage, else the
    previous stage's hidden states (sequence-sharded over tp with sp, as tensor.py leaves
    them; seq/cp tokens with context parallelism)."""
    if first:
        return tokens
    seq = plan.seq_len // plan.cp // (plan.tp if plan.sp and plan.tp > 1 else 1)
    return torch.empty(plan.micro_batch, seq, spec.hidden, device=device, dtype=dtype,
                       requires_grad=True)


def _schedule_accepts(pm, plan, n: int) -> bool:
    """Whether the runtime's schedule runs a step of `n` micro-batches (plan_rules)."""
    from meshtron.planner.plan_rules import microbatch_problem

    if microbatch_problem(plan.schedule, plan.pp, plan.virtual_stages, n):
        return False
    try:
        pm._schedule(n)
    except (ValueError, RuntimeError, AssertionError):  # torch's own checks of n
        return False
    return True


def _pipelined_step(pm, plan, spec, device, tokens, targets, exact: bool = False,
                    hooks=None) -> int:
    """Forward and backward of this rank's stages in schedule order, for every micro-batch
    (`exact`) or for the fewest that reach the same peak (microbatches.py); returns how many
    micro-batches ran. `hooks` (tracker_hooks.KeepingModTracker): the tracker's hooks on a
    micro-batch's graph are emptied once its backward is done, as if no tracker held it."""
    from meshtron.rehearse.microbatches import pipeline_microbatches
    from meshtron.rehearse.tracker_hooks import release

    n_micro = tokens.shape[0] // plan.micro_batch
    pp_rank = pm.mesh.get_local_rank("pp")
    pm._schedule(n_micro)  # builds the PipelineStage objects (pm._stages)
    stages = {s: st for s, st in zip(pm.stage_ids, pm._stages)}
    parts = dict(zip(pm.stage_ids, pm.model_parts))
    dtype = torch.float32 if plan.dtype == "fp32" else torch.bfloat16
    last = plan.num_stages - 1
    live: dict[tuple[int, int], tuple[Any, Any]] = {}
    n_run = n_micro if exact else pipeline_microbatches(
        n_micro, lambda n: _pipeline_order(pm, plan, n, pp_rank),
        lambda n: _schedule_accepts(pm, plan, n))
    order = _pipeline_order(pm, plan, n_run, pp_rank)
    split = any(k == "W" for k, _, _ in order)  # zero bubble: input, then weight gradients
    ends = "W" if split else "B"
    backwards = {s: sum(1 for k, st, _ in order if k == ends and st == s) for s in stages}
    done = {s: 0 for s in stages}
    waiting: dict[tuple[int, int], tuple] = {}
    hooked: dict[tuple[int, int], list] = {}  # the tracker's hooks on each graph
    local: set[tuple[int, int]] = set()  # inputs passed on this rank: nothing to free
    x_mb, y_mb = tokens.chunk(n_micro), targets.chunk(n_micro)
    for kind, s, i in order:
        if kind == "F":
            prev = live.get((s - 1, i)) if s - 1 in stages else None
            if prev is not None:  # the V's turn: torch passes the previous stage's output
                # detached, its storage shared, no copy (schedules.py `set_local_fwd_input`)
                inp = prev[1].detach().requires_grad_(True)
                local.add((s, i))
            else:
                inp = _stage_input(plan, spec, device, dtype, s == 0, x_mb[i])
            if split and s != 0:
                # a view, not the leaf a real stage receives: torch's module tracker hooks
                # every module input with a multi-grad hook, which refuses a leaf under the
                # autograd.grad of zero bubble's input backward (torch 2.13); same storage
                inp = inp.view_as(inp)
            with pm._loss_context():
                out = kept = parts[s](inp)
                if s == last:  # the schedule keeps the stage's output (the logits) until
                    out = pm.loss_fn(kept, y_mb[i]) / n_micro  # the micro-batch's backward
            live[(s, i)] = (inp, out, kept)
            hooked[(s, i)] = hooks.take() if hooks is not None else []
            continue
        if kind == "W":
            _weight_backward(stages[s], s, waiting.pop((s, i)), done, backwards, pm,
                             free=(s, i) not in local)
            release(hooked.pop((s, i)))
            continue
        inp, out, kept = live.pop((s, i))
        grads = None if s == last else torch.empty_like(out)
        inputs = [inp] if s != 0 else []
        if split:
            waiting[(s, i)] = _input_backward(stages[s], s, inp, out, kept, grads, inputs, pm)
            del inp, out, kept, inputs
            continue
        done[s] += 1
        with pm._loss_context():
            stages[s].backward_maybe_with_nosync(
                "full", {"stage_output": out, "output_grads": grads, "input_values": inputs},
                last_backward=done[s] == backwards[s])
        if s != 0 and (s, i) not in local:
            _free_received(inp)
        release(hooked.pop((s, i)))
        del inp, out, kept, inputs
    for st in stages.values():
        st.perform_reduce_grad(1)
    return n_run


def _input_backward(stage, s: int, inp, out, kept, grads, inputs, pm) -> tuple:
    """Zero bubble's B as the PipelineStage runs it (stage.py `backward_one_chunk(
    full_backward=False)`): the input gradient by `stage_backward_input`, which keeps the
    graph and the gradients reaching the weight paths until W; the first stage runs nothing
    here (its W runs the whole backward). What W needs is returned and kept, as the stage's
    `backward_state` keeps it."""
    groups = None
    if s != 0:
        with pm._loss_context():
            _, groups = stage.backward_maybe_with_nosync(
                "input", {"stage_output": (out,), "output_grads": None if grads is None
                          else [grads], "input_values": inputs}, last_backward=False)
    return inp, out, kept, grads, inputs, groups


def _weight_backward(stage, s: int, state: tuple, done: dict, ends: dict, pm,
                     free: bool = True) -> None:
    """Zero bubble's W (`backward_weight_one_chunk`): the weight gradients from what B kept
    (the first stage: its whole backward), then the received input is freed (`free`; not
    one passed on this rank, whose storage is the previous stage's output)."""
    inp, out, kept, grads, inputs, groups = state
    done[s] += 1
    with pm._loss_context():
        if s == 0:
            stage.backward_maybe_with_nosync(
                "full", {"stage_output": out, "output_grads": grads, "input_values": inputs},
                last_backward=done[s] == ends[s])
        else:
            stage.backward_maybe_with_nosync(
                "weight", {"stage_output": (out,), "param_groups": groups},
                last_backward=done[s] == ends[s])
            if free:
                _free_received(inp)


def _free_received(inp) -> None:
    """Free a received stage input once its backward has run, as a real stage does. torch's
    module tracker registers a multi-grad hook on every module input
    (`ModTracker._fw_pre_hook`); on a leaf (a received input is one, as in a real stage) the
    hooks and the autograd nodes they reach keep it alive through C++ (measured: with the
    tracker all 6 [2, 2048, 2048] inputs of a 1F1B last stage were alive at its peak,
    without it none; 80 x 32 MiB on a Llama 3 405B pipeline rank). Its storage is released
    instead (the tracker follows `resize_`, as it does for FSDP2's buffers); nothing reads
    the input after its backward."""
    inp.untyped_storage().resize_(0)


def _prime_optimizer(pm, optimizer) -> None:
    """Create AdamW's states (one step on zero gradients), then drop the gradients."""
    for p in pm.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()


def _in_sharding_propagation(code) -> bool:
    """Whether the op being dispatched runs inside DTensor's sharding propagation (`code`):
    there it computes output metadata on global-shaped fake tensors in the active fake mode,
    ours, so torch's tracker would count tensors no rank ever holds (measured: 8 bytes per
    global logit under loss_parallel, i.e. tp times the local logits). Read off the stack:
    nothing of torch is patched."""
    frame = sys._getframe(2)
    for _ in range(48):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _without_propagation(cls):
    """torch's tracker class `cls`, blind to DTensor's metadata-only propagation ops, keeping
    the rank's peak only: torch's `_update_peak_stats` also updates the peak of every module
    it tracks that is running, walking all of them (a weak dictionary) after every op, a
    cost that grows with the layers (measured: 4.3 s of a 46 s 7-layer rehearsal; an
    80-layer rank did not finish in 10 minutes). The rank's peak is computed as torch's."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    from meshtron.rehearse.tracker_hooks import KeepingModTracker

    code = ShardingPropagator._propagate_tensor_meta_non_cached.__code__

    class Tracker(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # torch's module tracker, listing the hooks it leaves on a forward's graph, so a
            # micro-batch's graph can go after its backward (tracker_hooks.py)
            self._mod_tracker = KeepingModTracker()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _in_sharding_propagation(code):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

    return Tracker


def _tracker(pm, optimizer):
    """torch's tracker for this rank's model parts. FSDPMemTracker follows one FSDP root and
    lets a module run once per micro-batch (MemTracker refuses a second call in a step): with
    several pipeline stages on the rank it follows the first, and the other stages' parameter
    shards, made before tracking starts, are added by their exact bytes (`untracked`);
    everything they create during the step is tracked."""
    from torch.distributed.fsdp import FSDPModule

    parts = pm.model_parts
    if isinstance(parts[0], FSDPModule):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = _without_propagation(FSDPMemTracker)(parts[0], optimizer)
        tracker.untracked = _param_bytes(parts[1:], exclude=parts[0])
        return tracker
    if len(parts) > 1:
        from meshtron.errors import UserError

        raise UserError("rehearse: several pipeline stages per rank without FSDP (fp32, "
                        "dp=1) cannot be tracked on CPU; rehearse it on a GPU")
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = _without_propagation(MemTracker)()
    tracker.track_external(*parts, optimizer)
    tracker.untracked = 0.0
    return tracker


def _param_bytes(parts, exclude) -> float:
    """Bytes of the local parameter shards and buffers of `parts` not in `exclude`."""
    from torch.distributed.tensor import DTensor

    seen = {id(t) for t in list(exclude.parameters()) + list(exclude.buffers())}
    total = 0.0
    for part in parts:
        for t in list(part.parameters()) + list(part.buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


_CATEGORY = {"Sharded Param": "params", "Parameter": "params", "Buffer": "params",
             "Sharded Grad": "grads", "Gradient": "grads", "Optstate": "optimizer",
             "Unsharded Param": "gathered", "Unsharded Grad": "gathered",
             "All Gather": "gathered", "Reduce Scatter": "gathered",
             "Activation": "activations", "Inputs": "activations", "Temp": "temporaries"}
CATEGORIES = ("params", "grads", "optimizer", "gathered", "activations", "temporaries")


def _categories(snapshot: dict) -> dict[str, float]:
    """Tracker categories (per device) folded into CATEGORIES, bytes."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    total = 0.0
    for dev_snap in snapshot.values():
        for key, value in dev_snap.items():
            name = getattr(key, "value", key)
            if name == "Total":
                total += value
            else:
                out[_CATEGORY.get(name, "temporaries")] += value
    out["total"] = total
    return out


def _static_routing(parts, imbalance: float, dtype: str) -> None:
    """Fix every MoE layer's tokens per expert on the host (module docstring)."""
    from meshtron.model.moe import MoE, StaticCounts

    for part in parts:
        for module in part.modules():
            if not isinstance(module, MoE):
                continue
            d = module.dispatcher
            hot = None if d is None else (d.rank * d.local, (d.rank + 1) * d.local)
            module.counts_policy = StaticCounts(imbalance, hot)
            if dtype != "fp32" and hasattr(torch, "_grouped_mm"):  # a bf16 GPU run's kernel
                module.experts.kernel = "grouped"


def rehearse_rank(spec, plan, rank: int, device: str = "cpu", imbalance: float = 1.0,
                  real: bool | None = None, exact: bool = False) -> dict[str, Any]:
    """Run one step of global rank `rank` of `plan` (a validated Plan with global_batch and
    seq_len) for model `spec`; returns {"rank", "pp_rank", "stages", "peak_bytes": {category:
    bytes, "total": bytes}, "wall_s", and with real tensors "step_s"}. `imbalance`: a mixture
    of experts' load on this rank's experts over the mean (module docstring). `real`: real
    tensors (default: on CUDA only); real on the CPU runs the GPU path's code at a toy size
    (timed step, and the tracker's peak: the CPU has no allocator statistics). The tracked
    step runs the fewest micro-batches that reach its peak (microbatches.py), all of them with
    `exact`; a timed step always runs them all."""
    from meshtron.model import Transformer
    from meshtron.model.init import materialize
    from meshtron.parallel import build_mesh, build_optimizer, parallelize
    from meshtron.train.parallel import runtime_plan

    start = time.perf_counter()
    torch.set_num_threads(1)
    _fake_group(rank, plan.gpus)
    mesh = None
    try:
        rt = runtime_plan(plan, plan.dtype)
        mesh = build_mesh(rt, device_type=device, spec=spec)
        with torch.device("meta"):
            model = Transformer(spec)
        real = device != "cpu" if real is None else real
        pm = parallelize(model, rt, mesh, allocate=False)
        if spec.is_moe:
            _static_routing(pm.model_parts, imbalance, plan.dtype)
        dev = torch.device("cpu") if device == "cpu" else pm.device
        mode = contextlib.nullcontext() if real else _fake_mode()
        with mode:
            # real tensors get the product's initialization (uninitialized memory may hold
            # NaNs, and a MoE router's choices follow the values); fake ones hold nothing
            materialize(pm.model_parts, dev, fill=None if real else _keep_empty)
            optimizer = build_optimizer(pm, lr=1e-4)
            tracker = _tracker(pm, optimizer) if dev.type == "cpu" else None
            with tracker or contextlib.nullcontext():  # the tracker sees the states made
                _prime_optimizer(pm, optimizer)
            local = plan.global_batch // plan.dp
            tokens = torch.randint(0, spec.vocab, (local, plan.seq_len), device=dev)
            targets = torch.randint(0, spec.vocab, (local, plan.seq_len), device=dev)
            result = _measured_step(pm, rt, spec, dev, optimizer, tokens, targets, tracker,
                                    real, exact)
        result.update(rank=rank, pp_rank=mesh.get_local_rank("pp"), stages=pm.stage_ids,
                      layers=sum(len(p.layers) for p in pm.model_parts))
    finally:
        if mesh is not None:  # and DTensor's caches of it: a second rehearsal in this process
            from meshtron.parallel.mesh import release_mesh  # would get its dead groups

            release_mesh(mesh)
        dist.destroy_process_group()
    result["wall_s"] = time.perf_counter() - start
    return result


def _keep_empty(parts) -> None:
    """materialize's fill: leave the fake shards uninitialized (nothing to compute)."""


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _step(pm, plan, spec, dev, optimizer, tokens, targets, exact: bool = True,
          hooks=None) -> int:
    """One optimizer step; returns the micro-batches run. `hooks`: the tracker's module
    tracker (tracker_hooks.py), whose hooks on each micro-batch's graph are released after
    its backward."""
    if pm.is_pipelined:
        if plan.cp > 1:
            from meshtron.parallel.context import shard_batch

            shard = shard_batch(tokens, targets, plan.cp, pm.mesh.get_local_rank("cp"))
            tokens, targets = shard.tokens, shard.targets
        n_run = _pipelined_step(pm, plan, spec, dev, tokens, targets, exact, hooks)
    else:
        rows = tokens.shape[0]
        if not exact:  # the first, a middle and the last micro-batch (microbatches.py)
            from meshtron.rehearse.microbatches import accumulation_microbatches

            rows = accumulation_microbatches(rows // plan.micro_batch) * plan.micro_batch
        pm.forward_backward(tokens[:rows], targets[:rows])
        n_run = rows // plan.micro_batch
    optimizer.step()
    optimizer.zero_grad()
    return n_run


def _state_bytes(optimizer) -> float:
    """Bytes of the optimizer states this rank holds (local shards)."""
    from torch.distributed.tensor import DTensor

    total = 0.0
    for opt in optimizer.optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    v = v.to_local() if isinstance(v, DTensor) else v
                    total += v.numel() * v.element_size()
    return total


def _measured_step(pm, plan, spec, dev, optimizer, tokens, targets, tracker, real,
                   exact: bool = False) -> dict:
    """The step's peak: the tracker's (entering it again starts its peak from what is held
    now), or on CUDA the allocator's; with real tensors also the step's time after one
    warm-up step."""
    out = _timed_step(pm, plan, spec, dev, optimizer, tokens, targets) if real else {}
    if tracker is not None:
        with tracker:
            n_run = _step(pm, plan, spec, dev, optimizer, tokens, targets, exact,
                          getattr(tracker, "_mod_tracker", None))
        peak = _categories(tracker.get_tracker_snapshot("peak"))
        peak["params"] += tracker.untracked  # alive all step: in the peak
        peak["total"] += tracker.untracked
        # AdamW's states live through the whole step, so they are in the peak; the tracker
        # files the states of the runtime's per-part optimizers as temporaries (it hooks only
        # the optimizer it is given): moved to their category, by their exact bytes
        states = _state_bytes(optimizer)
        moved = max(0.0, states - peak["optimizer"])
        peak["optimizer"] += moved
        peak["temporaries"] = max(0.0, peak["temporaries"] - moved)
        what = "real" if real else "fake"
        out.update(peak_bytes=peak, measured=f"{what} tensors, torch memory tracker"
                   + (", step timed" if real else ""), microbatches_run=n_run)
    return out


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed_step(pm, plan, spec, dev, optimizer, tokens, targets) -> dict:
    """One warm-up step (kernels, allocator), then one timed step of every micro-batch; on
    CUDA the allocator's peak of the timed one."""
    _sync(dev)
    _step(pm, plan, spec, dev, optimizer, tokens, targets)
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    _step(pm, plan, spec, dev, optimizer, tokens, targets)
    _sync(dev)
    out: dict[str, Any] = {"step_s": time.perf_counter() - t0}
    if dev.type == "cuda":
        out.update(peak_bytes={"total": float(torch.cuda.max_memory_allocated(dev))},
                   measured="CUDA allocator peak, compute-only step (collectives return at "
                            "once)")
    return out
