"""Pipeline parallelism with `torch.distributed.pipelining`: stage cutting and schedules.

Stages are cut where the plan says (`plan.stage_layers`: layers per stage, in stage order), or
evenly. The model is built on every rank (usually on the meta device, materialized per shard
after the split: meshtron/model/init.py) and each stage
is a *shell* of the same class holding the original module objects it owns: global blocks
`layers[start:end]` (ModuleDict keys, hence parameter names and checkpoint keys, unchanged),
the embeddings on stage 0, the final norm and output head on the last stage; the others are
None and the model's forward passes hidden states through. No module is copied, so the original
model must not be used afterwards.

Schedules (plan.schedule, plan.virtual_stages = v):

- 'gpipe': ScheduleGPipe (v=1); with v>1 ScheduleLoopedBFS.
- '1f1b': Schedule1F1B (v=1); with v>1 ScheduleInterleaved1F1B.
- 'interleaved': ScheduleInterleaved1F1B, v stages per rank, looped placement
  (stage s on pp rank s % pp; Narayanan et al. 2021).
- 'zb': zero bubble (Qi et al. 2024). v=1 (the planner's ZB-H1: one stage per rank):
  ScheduleInterleavedZeroBubble with one local stage; v=2: ScheduleZBVZeroBubble, V placement
  (rank r holds stages r and 2pp-1-r); other v: ScheduleInterleavedZeroBubble, looped.
  'zbv' is read as 'zb' with v=2 (planner/plan.py).
  Zero-bubble + ZeRO-3 is refused by the plan's rules (planner/plan.py) (measured silent drift with FSDP2
  reshard_after_forward=True on torch 2.13).

Gradients are scaled by 1/n_microbatches by the schedule (scale_grads=True) and the loss is the
per-micro-batch mean, so gradients are the mean over the rank's local batch.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.errors import UserError
from meshtron.parallel.mesh import stage_layer_counts
from meshtron.planner.plan import Plan


def stage_ids_for_rank(lay: Plan, pp_rank: int) -> list[int]:
    """Global stage indices held by pipeline rank `pp_rank`, in increasing order."""
    n, pp = lay.num_stages, lay.pp
    if lay.schedule == "zb" and lay.virtual_stages == 2:
        return sorted({pp_rank, n - 1 - pp_rank})
    return list(range(pp_rank, n, pp))


def make_stage_module(model: nn.Module, stage: int, num_stages: int,
                      layer_range: tuple[int, int]) -> nn.Module:
    """A shell of `type(model)` holding the parts of `model` that stage `stage` owns."""
    chunk = type(model).__new__(type(model))
    nn.Module.__init__(chunk)
    for key, value in model.__dict__.items():
        if not key.startswith("_") and key != "training":
            chunk.__dict__[key] = value
    first, last = stage == 0, stage == num_stages - 1
    chunk.tok_embeddings = model.tok_embeddings if first else None
    chunk.pos_embeddings = getattr(model, "pos_embeddings", None) if first else None
    start, end = layer_range
    chunk.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in range(start, end)})
    chunk.norm = model.norm if last else None
    chunk.output = model.output if last else None
    rope = getattr(model, "rope", None)
    chunk.register_buffer("rope", rope, persistent=False)
    chunk.train(model.training)
    return chunk


def split_model(model: nn.Module, lay: Plan, pp_rank: int) -> list[tuple[int, nn.Module]]:
    """[(stage index, stage module)] for this pipeline rank."""
    num_layers = len(model.layers)
    counts = stage_layer_counts(lay, num_layers)
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return [(s, make_stage_module(model, s, lay.num_stages, bounds[s]))
            for s in stage_ids_for_rank(lay, pp_rank)]


def splits_backward(lay: Plan) -> bool:
    """Whether the layout's schedule runs each stage's backward in two passes (input gradients,
    then weight gradients): the zero-bubble ones (ScheduleInterleavedZeroBubble and
    ScheduleZBVZeroBubble order only BACKWARD_INPUT and BACKWARD_WEIGHT actions)."""
    return lay.schedule == "zb"


def build_schedule(stages: list, lay: Plan, n_microbatches: int, loss_fn):
    """The torch.distributed.pipelining schedule object for the layout."""
    from torch.distributed.pipelining import schedules as S

    v = lay.virtual_stages
    if lay.schedule == "gpipe":
        cls = S.ScheduleGPipe if v == 1 else S.ScheduleLoopedBFS
    elif lay.schedule == "1f1b":
        cls = S.Schedule1F1B if v == 1 else S.ScheduleInterleaved1F1B
    elif lay.schedule == "interleaved":
        cls = S.ScheduleInterleaved1F1B
    elif lay.schedule == "zb":
        cls = S.ScheduleZBVZeroBubble if v == 2 else S.ScheduleInterleavedZeroBubble
    else:  # Plan validation already rejects these
        raise UserError(f"plan.schedule={lay.schedule!r}: unknown")
    if issubclass(cls, S.PipelineScheduleSingle):
        if len(stages) != 1:
            raise UserError(f"plan.schedule={lay.schedule!r}: single-stage schedule but this "
                             f"rank holds {len(stages)} stages")
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)


def step_options(schedule) -> dict:
    """Keyword arguments for `schedule.step`/`eval` that keep the last stage from holding every
    micro-batch's output until the step ends. torch's schedules save each forward output in
    `stage.output_chunks` (`forward_one_chunk(save_forward_output=return_outputs)`) so `step` can
    return the merged logits; meshtron reads only the losses, and for a last stage those outputs
    are the logits: [micro_batch, seq, vocab/tp] per micro-batch, ~2 GiB each for Llama 3 8B at
    8,192 tokens in bf16, all m of them alive at the step's end, which neither the planner nor the
    rehearsal counts. Detected on the installed torch's signature rather than assumed from a
    version (a torch without the argument keeps the outputs, as before)."""
    import inspect

    params = inspect.signature(type(schedule).step).parameters
    return {"return_outputs": False} if "return_outputs" in params else {}


METADATA_INFERENCE = ("_forward_metadata_inference", "_shape_inference")
"""PipelineStage's method that runs the first step's metadata-inference forward: its torch
2.13 name, then its torch 2.11 name (stage.py `_prepare_forward_infra` calls one of them; both
registered in meshtron/torch_compat.py). Feature-detected on the stage object: on 2.11 only
the 2.13 name was looked for, so the routers counted that forward's tokens."""


def pipeline_stage(module: nn.Module, stage: int, lay: Plan, pp_group, device: torch.device):
    from torch.distributed.pipelining import PipelineStage

    st = PipelineStage(module, stage, lay.num_stages, device, group=pp_group)
    _uncounted_metadata_forward(st, module)
    _local_backward_only_with_backward(st)
    _no_self_p2p_at_init(st)
    if splits_backward(lay):
        _weight_grads_into_reduce_dtype(st)
    return st


def _no_self_p2p_at_init(st) -> None:
    """Drop the send and receive to this rank itself from the neighbour warm-up a schedule runs
    before its first step, on this stage object only.

    Why: torch 2.11's `_initialize_stages` (schedules.py) batches every local stage's
    `_get_init_p2p_neighbors_ops` (stage.py): a dummy send to the next stage's rank and a receive
    from the previous one's, each way. Where a rank holds two adjacent stages (ZBV's V: rank pp-1
    holds stages pp-1 and pp) the peer is the rank itself, and gloo has no pair to itself: `meshtron
    train --nproc 2 --plan pp=2 --schedule zbv` stopped at its first step ("Pair is not connected").
    The ops only warm up the communicators of real neighbours; adjacent stages on one rank hand
    their tensors over in memory (schedules.py [Note: V-schedule special case]), so a self pair is
    never used, on NCCL either. Both halves of each self pair are local, so dropping them keeps
    every remaining send matched by its receive. torch 2.13 warms up through a vote
    (schedules.py `_warmup_p2p`) and calls this method only for other stage types, so there the
    wrapper is never called. Feature-detected on the stage object."""
    init_ops = getattr(st, "_get_init_p2p_neighbors_ops", None)
    if not callable(init_ops):
        return

    def _get_init_p2p_neighbors_ops():
        return [op for op in init_ops() if op.group_peer != st.group_rank]

    st._get_init_p2p_neighbors_ops = _get_init_p2p_neighbors_ops


def _weight_grads_into_reduce_dtype(st) -> None:
    """After each weight-gradient pass (a zero-bubble schedule's W action) of this stage, hand
    the micro-batch's gradient to FSDP2's accumulator in its reduce dtype, as FSDP2's own
    post-backward does after a whole backward.

    Why: torch 2.13's W pass adds each micro-batch's weight gradient into `param.grad` itself
    (torch/distributed/pipelining/_backward.py `stage_backward_weight`: `weight.grad += dw`), on
    FSDP2's unsharded bf16 parameter. FSDP2 moves that gradient into its fp32 accumulator only
    in `post_backward` (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:
    `accumulate_unsharded_grad_if_needed`, `to_accumulated_grad_if_needed`), which a split
    backward reaches in the I pass, when the gradient reaches the stage's inputs, and at the
    step's REDUCE_GRAD. Two W passes of one stage with no I pass of it between them therefore
    add the second micro-batch's gradient to the first in bf16, where one process and every
    other schedule add them in fp32. ZBV does that on every rank but the first in its
    cool-down (torch 2.13 schedules.py `ScheduleZBVZeroBubble`, pp=2, 4 micro-batches,
    rank 1: `1I2 2I3 1I3 1W2 2W3 1W3`, stage 1 sums micro-batches 2 and 3 in bf16): 5e-6 off
    one process's gradient norm at step 1 (only stage 1's weights, 1e-3 of their largest
    gradient), 4e-4 by step 3. A no-op for fp32 or a bf16 reduce dtype (the gradient is
    already in the reduce dtype) and without FSDP2; only this stage object's method is wrapped."""
    weight_pass = st.backward_weight_one_chunk
    units = fsdp_params(st.submod)
    if not units:
        return

    def backward_weight_one_chunk(bwd_chunk_id, last_backward=False):
        weight_pass(bwd_chunk_id, last_backward=last_backward)
        fold_weight_grads(units)

    st.backward_weight_one_chunk = backward_weight_one_chunk


def fold_weight_grads(units: list) -> None:
    """The no-sync half of FSDP2's `post_backward`, in its order, on `units` (`fsdp_params`):
    a gradient left on an unsharded parameter is added to (or becomes) the reduce-dtype
    accumulator. What a stage runs after each W pass (`_weight_grads_into_reduce_dtype`)."""
    for fsdp_param in units:
        fsdp_param.accumulate_unsharded_grad_if_needed()
        fsdp_param.to_accumulated_grad_if_needed()


def fsdp_params(module: nn.Module) -> list:
    """FSDP2's per-parameter objects of every unit inside `module`, once each."""
    from torch.distributed.fsdp import FSDPModule

    from meshtron.compress.runtime import fsdp_param_groups

    out, seen = [], set()
    for m in module.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            if id(state) not in seen:
                seen.add(id(state))
                out.extend(fp for group in fsdp_param_groups(state) for fp in group.fsdp_params)
    return out


def _local_backward_only_with_backward(st) -> None:
    """Let a schedule's `eval` (forward only) pass over its backward actions where a rank
    holds two adjacent stages (ZBV's V: rank pp-1 holds stages pp-1 and pp). torch 2.13's
    runtime for multi-stage schedules still walks the backward actions of its order in eval
    (`stage.backward_one_chunk` returns at once without backward; the backward sends and
    receives are empty), but then hands the later stage's input gradient to the earlier stage
    in memory (schedules.py `_PipelineScheduleRuntime._step_microbatches`, [Note: V-schedule
    special case]): `get_local_bwd_output` and `set_local_bwd_input` assert that the stage
    has a backward ("can't steal_bwd_input if this stage doesn't have backward"), so every
    evaluation of a zbv run stopped there. Without a backward there is no gradient to hand
    over: both become no-ops then, on this stage object only; with a backward they are
    torch's own. (A second, forward-only schedule object is no way round it: the stages'
    receive buffers are set up per schedule object, in eval without requires_grad, and the
    training schedule would not set them up again.)"""
    get_output, set_input = st.get_local_bwd_output, st.set_local_bwd_input

    def get_local_bwd_output(mb_index):
        return get_output(mb_index) if st.has_backward else ()

    def set_local_bwd_input(next_stage_bwd_outputs, mb_index):
        if st.has_backward:
            set_input(next_stage_bwd_outputs, mb_index)

    st.get_local_bwd_output = get_local_bwd_output
    st.set_local_bwd_input = set_local_bwd_input


def _uncounted_metadata_forward(st, module: nn.Module) -> None:
    """torch.distributed.pipelining infers the stages' tensor metadata with one forward per
    stage at the first step (PipelineStage._forward_metadata_inference on torch 2.13: the first
    stage on the real micro-batch, the others on uninitialized tensors; `_shape_inference` on
    torch 2.11, every stage on zeros, i.e. every token id 0 on the first: METADATA_INFERENCE).
    Routers must not count those tokens into the balancing bias's load (meshtron/model/moe.py):
    only this stage object's method is wrapped, nothing process-wide. Under expert parallelism that inference also runs
    the all-to-alls on garbage routing (often every token to one ep rank's experts): the experts
    keep an autograd edge when they get no token (moe.py `GroupedExperts`), so all ep ranks
    meet in the backward's all-to-alls (tests/test_ep_pp.py). Static `input_args`/`output_args`
    would skip the inference, but torch 2.13 then also needs gradient metadata for the DTensor
    logits of a tensor-parallel last stage; torchtitan lets the stages infer too."""
    from meshtron.model.moe import MoE

    moe = [m for m in module.modules() if isinstance(m, MoE)]
    name = next((n for n in METADATA_INFERENCE if callable(getattr(st, n, None))), None)
    if not moe or name is None:
        return
    infer = getattr(st, name)

    def uncounted(*args, **kwargs):
        for m in moe:
            m.count_load = False
        try:
            return infer(*args, **kwargs)
        finally:
            for m in moe:
                m.count_load = True

    setattr(st, name, uncounted)

