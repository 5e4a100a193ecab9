"""Host issue of a mixture-of-experts layer between the dispatcher's device-to-host syncs: what
the host spends issuing the router, the dispatcher and the experts, and how long the GPU waits
for it. Torch-free.

Both stacks' dispatchers read the split sizes on the host once per layer forward, dropless
routing (Megatron-Core moe/token_dispatcher.py `MoEAlltoAllTokenDispatcher`: the
device-to-host copies at `cuda_dtoh_point`, `_maybe_dtoh_and_synchronize` waiting on them at
`cuda_sync_point`, "before_ep_alltoall" with ep > 1, "before_finish" otherwise, what the
GroupedLinear's m_splits need; token dropping with padding to capacity has static splits and
skips it; meshtron/parallel/expert.py: the splits' `tolist()`). The copies were queued behind
the router on the compute stream, so when the host resumes the GPU has finished everything
issued before them: the queue is empty.

Between two syncs the host and the GPU form a two-stage pipeline (the host issues, the stream
runs what was issued, in order) that starts empty. With the work of the stretch cut into
segments in issue order, segment i taking h_i of host and g_i of GPU time, each issued
uniformly, the GPU finishes the stretch at

    T = max over i of  max(H(<i) + G(>=i), H(<=i) + G(>i))

(H, G: sums of h, g over the segments named; the maximum of a piecewise-linear function is at
a segment boundary). It is at least max(H, G), the rule the planner used before (`host_exposed`),
and equal to it when the host runs ahead of the GPU everywhere; it is more where host-heavy
work follows the sync before the GPU has anything of its own to run: the GPU idles there and
never recovers that time. Transformer Engine's GroupedLinear (Megatron-Core's TEGroupedMLP)
is such work: per local expert a split, two quantised-output allocations, the quantisation and
one cuBLAS GEMM (TE issue #1499: the per-expert torch.split / torch.empty calls are the host
cost; common/gemm/cublaslt_gemm.cu `multi_stream_cublas_gemm`), so with many small experts
the host issues the experts slower than the GPU runs them, right after the sync.

The stretch, in the order the code issues it (`stretch_segments`): the rest of one layer's
forward after its sync (dispatch all-to-all and chunk sort, experts, chunk unsort, combine
all-to-all, unpermute), then the backward of a layer of another micro-batch, which has no sync
(the dispatcher reuses the forward's splits: combine side, experts, dispatch side and router,
then attention), then the next layer's forward up to its sync (attention, router, dispatcher
preprocessing and the first permutation). That pairing is the pipeline's steady state with one
layer per virtual stage (Megatron-Core schedules.py, interleaved: forward and backward chunks
alternate); with several layers per chunk the forwards between two syncs meet no backward,
and the forward's own wait (`forward_segments`) is what they cost. A stack that overlaps the
all-to-alls by merging a forward with another micro-batch's backward issues the stretch in
another order (`merged_segments`).
"""

from __future__ import annotations

from dataclasses import dataclass

MOE_HOST_OPS = (30, 20)
"""Host-issued operations of one MoE layer that do not grow with the experts, (forward,
backward): the router (gating GEMM, top-k, softmax, routing-map scatter, probability gather, the
auxiliary loss's reductions and products, top-k normalisation: ~12), the dispatcher (routing-map
sums, the count all-gather, split sums, the device-to-host copies, permute, all-to-all, chunk
sort and unsort, all-to-all, unpermute: ~16) and the activation with its probability product
(2), counted from Megatron-Core's moe/router.py and moe/token_dispatcher.py; the backward runs
the autograd twins of the data movers and the router's gradient."""

PRE_SYNC_OPS = 20
"""Of MOE_HOST_OPS' forward, those issued before the sync: the router (~12) and the
dispatcher's preprocessing up to the all-to-all (routing-map and split sums, the count
all-gather, the device-to-host copies, the first permutation: ~8)."""

POST_SYNC_OPS = {"dispatch": 3, "experts": 2, "combine": 5}
"""The forward's other 10, where they fall after the sync: all-to-all and chunk sort; the
activation and its probability product (with the experts); chunk unsort, all-to-all,
unpermute."""

BACKWARD_OPS = {"combine": 6, "experts": 2, "dispatch": 12}
"""MOE_HOST_OPS' backward in issue order: the unpermute, combine all-to-all and unsort
gradients; the activation's; the sort, dispatch all-to-all and permute gradients with the
router's backward."""

PER_EXPERT_HOST_OPS = {"fp8": (10, 12), "bf16": (4, 6)}
"""Host operations per local expert of Transformer Engine's GroupedLinear pair (fc1, fc2),
(forward, backward): FP8 forward per linear a split, two quantised-output allocations, the
quantisation and the GEMM (5); backward per linear the gradient's split, allocations and
quantisation (4) and the dgrad and wgrad GEMMs (2). BF16: split + GEMM forward, split + two
GEMMs backward (grouped_linear.py, cpp_extensions/gemm.py `general_grouped_gemm`)."""


def per_expert_gemms(framework: str) -> bool:
    """Whether the stack's expert GEMMs are issued one per local expert: Megatron-Core's
    TEGroupedMLP (Transformer Engine GroupedLinear on cuBLAS, the default of
    --moe-grouped-gemm). meshtron and torchtitan call torch._grouped_mm once."""
    return framework == "megatron"


def expert_ops(lin_dt: str, local_experts: float, per_expert: bool) -> tuple[float, float]:
    """(forward, backward) host operations of the expert GEMMs of one MoE layer: per local
    expert for Transformer Engine's GroupedLinear, else one grouped GEMM per linear (two
    in the backward)."""
    if per_expert:
        pf, pb = PER_EXPERT_HOST_OPS["fp8" if lin_dt == "fp8" else "bf16"]
        return local_experts * pf, local_experts * pb
    return 2.0, 4.0


def host_seconds(lin_dt: str, local_experts: float, per_expert: bool,
                 dispatch: float) -> tuple[float, float]:
    """(forward, backward) seconds the host spends issuing one MoE layer's router, dispatcher
    and experts for one micro-batch (MOE_HOST_OPS, PER_EXPERT_HOST_OPS)."""
    ef, eb = expert_ops(lin_dt, local_experts, per_expert)
    return (MOE_HOST_OPS[0] + ef) * dispatch, (MOE_HOST_OPS[1] + eb) * dispatch


def host_exposed(gpu_f: float, gpu_b: float, host_f: float, host_b: float) -> tuple[float, float]:
    """Lower bound of the wait (`queue_makespan` is the exact one): a stretch between two syncs
    costs at least max(GPU, host); the excess split in proportion to the host time of each
    pass."""
    host, gpu = host_f + host_b, gpu_f + gpu_b
    if host <= gpu or host <= 0:
        return 0.0, 0.0
    return (host - gpu) * host_f / host, (host - gpu) * host_b / host


def queue_makespan(segments: list[tuple[float, float]]) -> float:
    """Seconds until the GPU finishes `segments` [(host, gpu), ...] issued in order into an
    empty queue (module docstring)."""
    host_done, gpu_left = 0.0, sum(g for _, g in segments)
    end = gpu_left
    for h, g in segments:
        end = max(end, host_done + gpu_left)  # the segment's first kernel issued
        host_done, gpu_left = host_done + h, gpu_left - g
        end = max(end, host_done + gpu_left)  # its last one
    return end


@dataclass(frozen=True)
class MoeWork:
    """One MoE layer's work for one micro-batch as the stretch orders it: GPU seconds and host
    operations of its parts (`stretch_segments`)."""

    pre_f: float
    """GPU: the forward up to the sync (attention, norms, router, preprocessing, the first
    permutation)."""
    dispatch_f: float
    """GPU: dispatch all-to-all (exposed part) and the chunk sort."""
    experts_f: float
    """GPU: the expert GEMMs and their input casts."""
    combine_f: float
    """GPU: chunk unsort, combine all-to-all (exposed part), unpermute."""
    combine_b: float
    dispatch_b: float
    experts_b: float
    """GPU: the expert GEMMs' input and weight gradients with the casts."""
    wgrad_b: float
    """GPU: the weight-gradient part of `experts_b`."""
    attn_b: float
    """GPU: the backward of the rest of the layer (attention, norms)."""
    dense_ops: float
    """Host operations of the layer's dense part in the forward (the backward issues twice
    as many, as `moe_cost` prices them)."""
    expert_ops_f: float
    expert_ops_b: float
    wgrad_ops: float = 0.0
    """Host operations of the weight-gradient GEMMs among `expert_ops_b` (one per linear and
    expert issued)."""


def forward_segments(w: MoeWork, dispatch: float) -> list[tuple[float, float]]:
    """The forward of one layer from its sync to the next layer's sync, (host, GPU) pairs."""
    post = POST_SYNC_OPS
    return [(post["dispatch"] * dispatch, w.dispatch_f),
            ((w.expert_ops_f + post["experts"]) * dispatch, w.experts_f),
            (post["combine"] * dispatch, w.combine_f),
            ((w.dense_ops + PRE_SYNC_OPS) * dispatch, w.pre_f)]


def stretch_segments(w: MoeWork, dispatch: float) -> list[tuple[float, float]]:
    """A forward stretch with another micro-batch's layer backward between its MoE part and the
    next layer's forward (module docstring), (host, GPU) pairs in issue order."""
    f = forward_segments(w, dispatch)
    back = BACKWARD_OPS
    b = [(back["combine"] * dispatch, w.combine_b),
         ((w.expert_ops_b + back["experts"]) * dispatch, w.experts_b),
         (back["dispatch"] * dispatch, w.dispatch_b),
         (2 * w.dense_ops * dispatch, w.attn_b)]
    return f[:3] + b + f[3:]


def merged_segments(w: MoeWork, dispatch: float) -> list[tuple[float, float]]:
    """The stretch between two syncs of Megatron-Core's merged forward-backward schedule
    (`--overlap-moe-expert-parallel-comm` with `--delay-wgrad-compute`;
    models/common/model_chunk_schedule_plan.py `TransformerLayerSchedulePlan.run`: combine
    backward, attention forward with the router, experts' input-gradient backward, dispatch
    forward -- the sync --, delayed weight gradients, dispatch backward, experts forward,
    combine forward, attention backward), (host, GPU) pairs in issue order from the sync. The
    experts' input-gradient work was queued before the sync but after the router the sync
    waits for: the GPU starts the stretch with it (a first segment of no host time), and the
    next one's is issued at the stretch's end, its GPU time carried to the next stretch.
    DualPipe (DeepSeek-V3 report section 3.2.1) pairs the same chunks and is priced alike."""
    post, back = POST_SYNC_OPS, BACKWARD_OPS
    dgrad_ops = w.expert_ops_b - w.wgrad_ops + back["experts"]
    return [(0.0, w.experts_b - w.wgrad_b),
            (post["dispatch"] * dispatch, w.dispatch_f),
            (w.wgrad_ops * dispatch, w.wgrad_b),
            (back["dispatch"] * dispatch, w.dispatch_b),
            ((w.expert_ops_f + post["experts"]) * dispatch, w.experts_f),
            (post["combine"] * dispatch, w.combine_f),
            (2 * w.dense_ops * dispatch, w.attn_b),
            (back["combine"] * dispatch, w.combine_b),
            ((w.dense_ops + PRE_SYNC_OPS) * dispatch, w.pre_f),
            (dgrad_ops * dispatch, 0.0)]


def dispatcher_syncs(per_expert: bool, dispatch: str, capacity: float) -> bool:
    """Whether the dispatcher reads its split sizes on the host every MoE layer forward (module
    docstring). Not Megatron-Core's (`per_expert`: the stack whose experts are TEGroupedMLP)
    under token drop padded to capacity (KernelOptions.expert_capacity > 0 with
    expert_capacity_pad; callers pass 0 without padding, whose splits Megatron-Core reads
    on the host at "before_permutation_1", token_dispatcher.py `preprocess`): the alltoall
    dispatcher's `preprocess` builds the splits on the host from the capacity (torch.full on
    the CPU) and returns before choosing a sync point, which stays "no_sync"
    (token_dispatcher.py, core_v0.12.2 to d7288711); HybridEP's dispatch is non-blocking when
    num_permuted_tokens is known, as drop_and_pad sets it (`_HybridEPManager.setup_metadata`,
    fused_a2a.py `HybridEPDispatch`, d7288711). DeepEP's dispatch waits on the host for its
    receive counts whatever the capacity; meshtron and torchtitan drop no tokens."""
    return not (per_expert and capacity > 0 and dispatch in ("bf16", "hybridep"))


def unsynced_wait(w: MoeWork, dispatch: float) -> tuple[float, float]:
    """(forward, backward) seconds the GPU waits on the host for one MoE layer where no sync
    empties the queue (`dispatcher_syncs` False): the host runs ahead across layers, so only a
    host slower than the GPU over the whole layer shows (`host_exposed`), the layer's host
    operations as `stretch_segments` counts them."""
    post, back = POST_SYNC_OPS, BACKWARD_OPS
    host_f = (w.dense_ops + PRE_SYNC_OPS + sum(post.values()) + w.expert_ops_f) * dispatch
    host_b = (2 * w.dense_ops + sum(back.values()) + w.expert_ops_b) * dispatch
    gpu_f = w.pre_f + w.dispatch_f + w.experts_f + w.combine_f
    gpu_b = w.combine_b + w.experts_b + w.dispatch_b + w.attn_b
    return host_exposed(gpu_f, gpu_b, host_f, host_b)


def ordered_wait(w: MoeWork, dispatch: float, merged: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds the GPU waits on the host over one layer's stretch (its
    `queue_makespan` less its GPU time). Separate passes (`stretch_segments`): the forward's
    share is what its own segments cost without a backward beside them, at most the whole;
    the merged schedule (`merged_segments`) runs both in one stretch: split by host time."""
    seg = merged_segments(w, dispatch) if merged else stretch_segments(w, dispatch)
    wait = max(0.0, queue_makespan(seg) - sum(g for _, g in seg))
    if merged:
        host_f = (w.expert_ops_f + MOE_HOST_OPS[0] + w.dense_ops) * dispatch
        host = sum(h for h, _ in seg)
        share = host_f / host if host > 0 else 0.0
        return wait * share, wait * (1.0 - share)
    fwd = forward_segments(w, dispatch)
    own = queue_makespan(fwd) - sum(g for _, g in fwd)
    wait_f = min(wait, own)
    return wait_f, wait - wait_f


__all__ = ["MOE_HOST_OPS", "PER_EXPERT_HOST_OPS", "PRE_SYNC_OPS", "POST_SYNC_OPS",
           "BACKWARD_OPS", "MoeWork", "dispatcher_syncs", "expert_ops", "forward_segments",
           "host_exposed", "unsynced_wait",
           "merged_segments",
           "host_seconds", "ordered_wait", "per_expert_gemms", "queue_makespan",
           "stretch_segments"]
