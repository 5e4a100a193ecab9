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
stage_backward_input keeps the graph until the weight gradient). The stage's receive buffers
are held as torch holds them (`ReceiveBuffers`).
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


class ReceiveBuffers:
    """A rank's receive buffers as torch 2.13's PipelineStage holds them: one per micro-batch
    of the schedule's m (not only those in flight), made once when the schedule first runs and
    kept across steps (stage.py `_setup_forward_recv_info`: `_make_tensor_from_meta` per chunk
    into `args_recv_info[chunk]`; `_setup_backward_recv_info`: the same per chunk for the
    output gradient, `grad_recv_info[chunk]`): on every non-first stage the inputs, on every
    non-last stage the gradients of its output. A received input is that buffer itself, a leaf
    (`_retrieve_recv_activations`: `info.buffer.requires_grad_`), which the first block saves
    for backward: the same storage, never copied. torch's V passes a stage its previous
    stage's output instead (`set_local_fwd_input`: the buffer becomes that output, detached)
    and the next stage's input gradient as its output gradient (`set_local_bwd_input`): the
    replaced buffer goes, what replaces it stays to the next step. Under zero bubble the input
    gradient B computes stays as the buffer's `.grad` (_backward.py `stage_backward_input`:
    `inp.grad = dinput`) until the next step's `clear_runtime_states`; a whole backward clears
    it at once (`stage_backward`: `val.grad = None`). On a fake group nothing is received, so
    the buffers are made here, at the step's start, inside the tracker (they are alive
    throughout a steady-state step), and kept until the caller has run the optimizer."""

    def __init__(self, plan, spec, device, dtype, stages, n_micro: int) -> None:
        last = plan.num_stages - 1
        self.inputs = {s: [_stage_input(plan, spec, device, dtype, False, None)
                           for _ in range(n_micro)] for s in stages if s != 0}
        self.grads = {s: [_stage_input(plan, spec, device, dtype, False, None).detach()
                          for _ in range(n_micro)] for s in stages if s != last}

    def skipped_gradients(self, stages, n_run: int) -> None:
        """Under zero bubble, the input gradients that the micro-batches a truncated step
        skips (microbatches.py) would leave as their buffers' `.grad` by its end: made at the
        start, so the step's later moments, where the peak is, hold every one of them as the
        whole step does (its earlier moments hold more than the whole step's, below them).
        On the V the previous stage's output-gradient buffer is that same tensor. They are
        made inside an autograd pass, as B makes them, so that the tracker files them where
        it files B's (temporaries)."""
        def make(grad):
            for s, inputs in self.inputs.items():
                for i in range(n_run, len(inputs)):
                    shared = self.grads[s - 1][i] if s - 1 in stages else None
                    inputs[i].grad = torch.empty_like(inputs[i]) if shared is None else shared
            return grad

        some = next(iter(self.inputs.values()), None)
        if some:
            seed = torch.zeros((), device=some[0].device, requires_grad=True)
            seed.register_hook(make)
            torch.autograd.backward(seed * 1.0)


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
                    hooks=None) -> tuple[int, ReceiveBuffers]:
    """Forward and backward of this rank's stages in schedule order, for every micro-batch
    (`exact`) or for the fewest that reach the same peak (microbatches.py); returns how many
    micro-batches ran and the stages' receive buffers (alive until the next step: the caller
    keeps them through the optimizer step). `hooks` (tracker_hooks.KeepingModTracker): the
    tracker's hooks on a micro-batch's graph are emptied once its backward is done, as if no
    tracker held it."""
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
    bufs = ReceiveBuffers(plan, spec, device, dtype, stages, n_micro)
    if split and n_run < n_micro:
        bufs.skipped_gradients(stages, n_run)
    x_mb, y_mb = tokens.chunk(n_micro), targets.chunk(n_micro)
    for kind, s, i in order:
        if kind == "F":
            prev = live.get((s - 1, i)) if s - 1 in stages else None
            if prev is not None:  # the V's turn: torch passes the previous stage's output
                # detached, its storage shared, no copy (stage.py `set_local_fwd_input`)
                inp = bufs.inputs[s][i] = prev[1].detach().requires_grad_(True)
            elif s != 0:  # the receive buffer itself, a leaf
                inp = bufs.inputs[s][i].requires_grad_(True)
            else:
                inp = x_mb[i]
            if split and s != 0:
                # a view, not the leaf a real stage receives: torch's module tracker hooks
                # every module input with a multi-grad hook, which refuses a leaf under the
                # autograd.grad of zero bubble's input backward (torch 2.13); same storage
                inp = inp.view_as(inp)
            with pm._loss_context():
                out, kept = _stage_forward(pm, parts[s], inp,
                                           y_mb[i] if s == last else None, n_micro)
            live[(s, i)] = (inp, out, kept)
            hooked[(s, i)] = hooks.take() if hooks is not None else []
            continue
        if kind == "W":
            _weight_backward(stages[s], s, waiting.pop((s, i)), done, backwards, pm)
            release(hooked.pop((s, i)))
            continue
        inp, out, kept = live.pop((s, i))
        grads = None if s == last else _output_grad(bufs.grads[s][i], out)
        inputs = [inp] if s != 0 else []
        if split:
            state = _input_backward(stages[s], s, inp, out, kept, grads, inputs, pm)
            if s == last:  # past B torch keeps the loss to W, not the logits: it detaches
                # the stage's output at B's end (stage.py backward_one_chunk), and meshtron's
                # step keeps no output_chunks (parallel/pipeline.py step_options)
                state = (*state[:2], None, *state[3:])
            waiting[(s, i)] = state
            if s != 0 and state[-1] is not None:  # kept as the buffer's .grad to the step's
                leaf = bufs.inputs[s][i]  # end; the V's previous stage takes it as its
                leaf.grad = state[-1]  # output gradient (set_local_bwd_input)
                if s - 1 in stages:
                    bufs.grads[s - 1][i] = leaf.grad
            # `state` too: kept to the next B, it held the last stage's graph past its W
            # (the V's rank 0: W right after B) and every W copy of a checkpointed block in
            # it, 1.75 GiB on the 'mid' model; torch detaches the last stage's output in B
            # and drops W's state (stage.py backward_one_chunk, backward_weight_one_chunk)
            del inp, out, kept, inputs, state
            continue
        done[s] += 1
        with pm._loss_context():
            stages[s].backward_maybe_with_nosync(
                "full", {"stage_output": out, "output_grads": grads, "input_values": inputs},
                last_backward=done[s] == backwards[s])
        release(hooked.pop((s, i)))
        del inp, out, kept, inputs
    for st in stages.values():
        st.perform_reduce_grad(1)
    return n_run, bufs


def _stage_forward(pm, part, inp, target, n_micro: int) -> tuple[Any, Any]:
    """(what the micro-batch's backward starts from, what the schedule keeps to it) of one
    stage's forward; `target` on the last stage only. There the runtime's stage returns the
    model's chunked loss itself (ParallelModel._schedule: `stage_loss`), or else its output,
    the logits, which the schedule keeps while its loss function runs on them."""
    if target is None:
        out = part(inp)
        return out, out
    if pm._stage_computes_loss:
        loss = part(inp, targets=target) / n_micro
        return loss, loss
    logits = part(inp)
    return pm.loss_fn(logits, target) / n_micro, logits


def _output_grad(buffer, out):
    """The output gradient a backward runs with: the stage's receive buffer for it, or, where
    the output is not a plain tensor of that shape (a DTensor), one like the output."""
    from torch.distributed.tensor import DTensor

    if isinstance(out, DTensor) or tuple(out.shape) != tuple(buffer.shape):
        return torch.empty_like(out)
    return buffer


def _input_backward(stage, s: int, inp, out, kept, grads, inputs, pm) -> tuple:
    """Zero bubble's B as the PipelineStage runs it (stage.py `backward_one_chunk(
    full_backward=False)`): the input gradient by `stage_backward_input`, which keeps the
    graph and the gradients reaching the weight paths until W; the first stage runs nothing
    here (its W runs the whole backward). What W needs is returned and kept, as the stage's
    `backward_state` keeps it."""
    groups = dinput = None
    if s != 0:
        with pm._loss_context():
            dinputs, groups = stage.backward_maybe_with_nosync(
                "input", {"stage_output": (out,), "output_grads": None if grads is None
                          else [grads], "input_values": inputs}, last_backward=False)
        dinput = dinputs[0] if dinputs else None
    return inp, out, kept, grads, inputs, groups, dinput


def _weight_backward(stage, s: int, state: tuple, done: dict, ends: dict, pm) -> None:
    """Zero bubble's W (`backward_weight_one_chunk`): the weight gradients from what B kept
    (the first stage: its whole backward); the received input stays, the stage's buffer.
    Then, as the runtime's stage does after each W (parallel/pipeline.py
    `_weight_grads_into_reduce_dtype`), the gradients go to FSDP2's reduce-dtype accumulator
    (`fold_weight_grads`), so none waits for the stage's next B."""
    from meshtron.parallel.pipeline import fold_weight_grads, fsdp_params

    inp, out, kept, grads, inputs, groups, _ = state
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
    fold_weight_grads(fsdp_params(stage.submod))
