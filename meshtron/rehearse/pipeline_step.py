"""A pipelined rank's step in the rehearsal: its stages run directly, one micro-batch at a
time in the schedule's order for this pipeline rank.

A pipelined rank's stages cannot run under `torch.distributed.pipelining`'s schedules here: a
non-first stage reads its input shape from a receive the fake group never fills. The stage
modules therefore run directly (1F1B / GPipe orders below, the torch schedule object's own
`pipeline_order` for the multi-stage ones), with the input shape a stage receives
([micro_batch, seq/cp(/tp with sp), hidden] in the compute dtype) and the PipelineStage's own
FSDP no-sync and final gradient reduction (`backward_maybe_with_nosync`,
`perform_reduce_grad`). Zero-bubble schedules run their input and weight gradients apart, at
their own slots, as the stage does (`_input_backward`, `_weight_backward`: torch's
stage_backward_input keeps the graph until the weight gradient). Received inputs are freed
after their backward as a real stage frees them (`_free_received`).
"""

from __future__ import annotations

from typing import Any

import torch


def pipeline_order(pm, plan, n_micro: int, pp_rank: int) -> list[tuple[str, int, int]]:
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


def pipelined_step(pm, plan, spec, device, tokens, targets, exact: bool = False,
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
        n_micro, lambda n: pipeline_order(pm, plan, n, pp_rank),
        lambda n: _schedule_accepts(pm, plan, n))
    order = pipeline_order(pm, plan, n_run, pp_rank)
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

