"""What a mixture-of-experts layer costs beyond its active-parameter equivalent: expert
parallelism's token all-to-alls, the grouped GEMMs of small per-expert batches, the token
permutation copies, the routing imbalance, and the memory of the dispatch buffers. Torch-free.

The dense part of the cost model prices a MoE block as the dense block of the same active width
(`compute.active_equivalent`). This module adds, per MoE layer and micro-batch on one rank
(T = micro_batch * seq / cp tokens entering the layer, k = top_k, h = hidden, E experts, b
bytes of the compute dtype, ep the expert-parallel degree):

* All-to-all (`a2a_time`). Dispatch and combine in the forward, their autograd twins in the
  backward (meshtron/parallel/expert.py; the contract in planner/collectives.py), each moving
  T*k*h*b bytes of which (ep-1)/ep leave the rank (GShard, Lepikhin et al. 2020; Megatron-Core
  MoE docs, "Token dispatcher": alltoall). Where the ep group sits comes from placement.py (ep
  consecutive data ranks, stride tp): inside a node when tp*ep fits, over NVLink; otherwise the
  share addressed to other nodes crosses the NIC of each GPU (one NIC per GPU, rail-aligned),
  the rest NVLink, the slower of the two setting the time. Frameworks with node-limited routing
  and per-node deduplication (DeepSeek-V3 technical report, section 2.1.2 / 3.2.2: each token
  goes to at most M = 4 nodes, sent once per node over IB and fanned out over NVLink)
  send min(k, M) copies of a token across nodes instead of k (`KernelOptions.ep_node_limit`).
  DeepEP's kernels (`KernelOptions.ep_dispatch` 'deepep') send one row per destination rank
  and node instead (planner/moe_deepep.py).
  Stacks that dispatch in FP8 (`KernelOptions.ep_dispatch`: DeepSeek-V3 section 3.3.3, DeepEP)
  send the two all-to-alls toward the experts at FP8_DISPATCH_BYTES per element, the two
  combines in BF16 (`a2a_dtype_bytes`).
  Recomputation replays the forward's two (full: every layer; half: every second).
  Exposed unless the framework overlaps them with computation (`KernelOptions.ep_overlap`:
  DeepSeek's DualPipe overlaps both all-to-alls of one micro-batch with the computation of
  another, technical report section 3.2.1; Megatron-Core's `--overlap-moe-expert-parallel-comm`
  (1F1B A2A overlap, 2025); meshtron's runtime and torchtitan 2025 run them on the compute
  stream: exposed). Overlapped, the four all-to-alls of a layer run beside the paired
  micro-batch's whole layer (attention included), forward plus backward (`overlapped_a2a`).
* Imbalance (`imbalance`). Dropless routing sends each rank what its experts were chosen for;
  the step waits for the fullest rank, whose expert GEMMs and received bytes are `imbalance`
  times the mean. Default DEFAULT_IMBALANCE; `meshtron calibrate --router-stats
  metrics.jsonl` measures it from a run's router statistics (max/mean load).
* Token drop (planner/moe_capacity.py, `KernelOptions.expert_capacity`): padded to capacity,
  every expert multiplies C = ceil(f T k / E) rows from each rank and each rank sends C E,
  whatever the imbalance; dropped without padding, the imbalance is capped at f. The grouped
  GEMMs, the permutations, the casts and the all-to-alls below take those rows.
* Grouped GEMMs. The E/ep local experts each multiply the tokens routed to them, T*k*ep/E on
  average (T*k/E without expert parallelism): small M dimensions lose efficiency to tile
  quantisation like any small GEMM (compute.py's s(m) model, or the calibrated table), which is
  what CUTLASS / torch._grouped_mm grouped GEMMs pay (one launch, per-group tiles). The dense
  equivalent's routed part is replaced by this time.
* Permutation. Tokens are copied into expert order before dispatch and back after combine,
  forward and backward, memory bound, each pass reading and writing T*k*h*b
  (`permute_passes`): Megatron-Core's fused permute and unpermute-with-probabilities, plus
  with expert parallelism the sort and unsort of the received chunks by local expert
  (moe/token_dispatcher.py `MoEAlltoAllTokenDispatcher`: permute, sort_chunks_by_idxs
  twice, unpermute); meshtron's eager layer (meshtron/model/moe.py) gathers the slots
  (index_select), pads them into the grouped GEMM's buffer (a zero fill and an index_copy),
  gathers the outputs back (index_select), weights them (a product) and sums each token's k
  (index_add), plus the regrouping gather and scatter of the received rows with expert
  parallelism. The router's passes over [T, E] fp32 affinities are E*4 bytes per token
  against the k*h*b of one slot pass: not counted. Megatron-Core's FP8 experts copy the
  routed rows once more each way, padding every expert's rows to 16 and back
  (moe_fp8.fp8_pad_passes), where the splits are not aligned already.
* Host issue (planner/moe_host.py). Both stacks' dispatchers read the split sizes on the host
  once per layer forward (Megatron-Core's MoEAlltoAllTokenDispatcher:
  `_maybe_dtoh_and_synchronize` at `cuda_sync_point`, "before_ep_alltoall" with ep > 1,
  "before_finish" otherwise, the GroupedLinear's m_splits; meshtron/parallel/expert.py: the
  splits' `tolist()`): the CPU cannot
  run ahead of the GPU across MoE layers, and after each sync the queue is empty. Between two
  syncs the GPU finishes no earlier than the host issues, and where host-heavy work follows the
  sync (Transformer Engine's GroupedLinear, Megatron-Core's TEGroupedMLP, issues a split,
  allocations, a quantisation and a cuBLAS GEMM per local expert: TE issue #1499) it idles
  while the host catches up: moe_host.py prices the stretch in issue order
  (compute.dispatch_s per operation). torch._grouped_mm (meshtron) and DeepGEMM issue one
  launch for all experts.
* Memory: planner/moe_memory.py (what the router, permutation, experts and combine save;
  where the expert parameters live).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from meshtron.model.spec import ModelSpec
from meshtron.planner import comm
from meshtron.planner.compute import DEFAULT_IMBALANCE  # the KernelOptions default it prices
from meshtron.planner.moe_capacity import expert_rows
from meshtron.planner.moe_deepep import (DEDUPLICATED, deepep_a2a_time,
                                         hybridep_map_gather_time)
from meshtron.planner.moe_fp8 import expert_cast_bytes, fp8_pad_passes
from meshtron.planner.moe_router import fp32_router_extra
from meshtron.planner.moe_host import (MOE_HOST_OPS, PER_EXPERT_HOST_OPS, MoeWork,
                                       dispatcher_syncs, expert_ops, host_exposed, host_seconds,
                                       ordered_wait, per_expert_gemms, unsynced_wait)

FP8_DISPATCH_BYTES = 1.0 + 4.0 / 128
"""Bytes per element of an FP8 dispatch: the e4m3 value and its share of one fp32 scale per
1x128 block of a row (DeepSeek-V3 report sections 3.3.2-3.3.3: activations quantised per token
per 128 channels, the same tiles the up-projection's FP8 GEMM takes)."""


def a2a_dtype_bytes(dtype_bytes: float, fp8_experts: bool, dispatch: str) -> tuple[float, float]:
    """(toward the experts, back from them) bytes per element of one MoE layer's all-to-alls.
    Toward: the forward dispatch and, in the backward, the combine's twin (the output gradient
    before the down-projection); back: the forward combine and the dispatch's twin.
    `dispatch` 'fp8' (KernelOptions.ep_dispatch) quantises the rows toward FP8 experts before
    sending them, "compatible with FP8 Fprop in MoE up-projections", and does the same for the
    activation gradient before the down-projections; "both the forward and backward combine
    components" stay BF16 (DeepSeek-V3 report section 3.3.3). BF16 experts take BF16 rows."""
    if dispatch == "fp8" and fp8_experts:
        return FP8_DISPATCH_BYTES, dtype_bytes
    return dtype_bytes, dtype_bytes


@dataclass(frozen=True)
class MoeLayerCost:
    """Seconds (and bytes) one MoE layer adds on one rank for one micro-batch, beyond its
    dense active-width equivalent."""

    compute_fwd: float
    """Extra forward compute: grouped GEMMs minus the dense equivalent's routed GEMMs (with
    imbalance), plus the permutation copies."""
    compute_bwd: float
    """The same for the backward (two GEMMs per forward GEMM, permutation gradients)."""
    a2a_fwd: float
    """Dispatch + combine all-to-all of the forward, exposed seconds."""
    a2a_bwd: float
    """Their backward twins, exposed seconds."""
    a2a_bytes: float
    """Bytes one token all-to-all call in the compute dtype sends to other ranks
    (T*k*h*b*(ep-1)/ep, times the rows token drop leaves: moe_capacity.ExpertRows.sent):
    the combines (an FP8 dispatch sends `a2a_dtype_bytes` of it)."""


def a2a_bytes(tokens: float, top_k: int, hidden: int, dtype_bytes: float, ep: int) -> float:
    """Bytes a rank sends to the other ep-1 ranks in one token all-to-all: its T*k routed rows of
    h elements, (ep-1)/ep of them addressed to experts elsewhere (uniform routing)."""
    if ep <= 1:
        return 0.0
    return tokens * top_k * hidden * dtype_bytes * (ep - 1) / ep


def a2a_time(nbytes: float, group: comm.Group, fab: comm.Fabric, top_k: int = 1,
             node_limit: int = 0) -> float:
    """One all-to-all of `nbytes` per rank (already (ep-1)/ep of the buffer) over `group`:
    NCCL runs it as ep-1 grouped send/recv pairs (one launch: base latency plus one step
    latency per link type used). Of what leaves the rank, (local-1)/(ep-1) stays in the node
    (NVLink) and the rest crosses the network on the GPU's NIC; `node_limit` M > 0 (DeepSeek's
    node-limited routing with per-node deduplication) scales the cross-node part by
    min(top_k, M)/top_k."""
    n, local = group.size, max(1, min(group.local, group.size))
    if n <= 1 or nbytes <= 0:
        return 0.0
    intra = nbytes * (local - 1) / (n - 1)
    inter = nbytes - intra
    if inter > 0 and node_limit > 0 and top_k > node_limit:
        inter *= node_limit / top_k
    t_intra = intra / fab.intra_bw + (fab.intra_alpha if local > 1 else 0.0)
    t_inter = inter / fab.inter_bw + fab.inter_alpha if inter > 0 else 0.0
    return fab.base_latency + max(t_intra, t_inter)


def routed_tokens_per_expert(tokens: float, model: ModelSpec, ep: int) -> float:
    """Rows one local expert multiplies per micro-batch on average: every ep rank routes T*k
    slots over E experts, and a rank holds E/ep of them."""
    return tokens * model.moe_top_k * ep / model.moe_experts


@lru_cache(maxsize=2048)
def moe_layer_cost(model: ModelSpec, cluster: Any, tokens: float, ep: int, group: comm.Group,
                   dtype: str, imbalance: float, ep_overlap: bool, node_limit: int,
                   stack: str, tp: int = 1, etp: int = 1, window_fwd: float = 0.0,
                   window_bwd: float = 0.0, per_expert: bool = False,
                   fp8_scaling: str = "te-delayed", fp8_gemm: str = "cublas",
                   fp8_split_accum_bwd: bool = True, ep_dispatch: str = "bf16",
                   folded: bool = False, expert_routing: str = "spread",
                   capacity: float = 0.0, router_dtype: str = "bf16",
                   capacity_pad: bool = True) -> MoeLayerCost:
    """Extra cost of one MoE layer (module docstring) for `tokens` tokens on this rank. Under
    tensor parallelism `tp` the dense equivalent charged the routed GEMMs at 1/tp of their
    width (compute.layer_cost); the experts run fe/etp columns (`etp`: 1 where the MoE is
    replicated over tp, meshtron's runtime; tp for Megatron-Core's default expert tensor
    parallelism, planner/moe_memory.py `expert_tp`). `window_fwd`, `window_bwd`: the dense
    equivalent layer's forward and backward compute (compute.layer_cost), what an overlapped
    all-to-all runs beside (`overlapped_a2a`) and the GPU work the host issue is ordered with
    (moe_host.py `ordered_wait`); 0 counts the routed GEMMs alone and leaves the host unpriced.
    `per_expert`: the expert GEMMs are issued one per local expert (`per_expert_gemms`).
    `fp8_scaling`: how the FP8 experts quantise their inputs (moe_fp8.expert_cast_bytes);
    `fp8_gemm`: their GEMM kernel kind (compute.fp8_tile_scale), the same as the dense
    equivalent's, whose routed GEMMs are subtracted at the time it charged them;
    `fp8_split_accum_bwd`: the
    backward GEMMs promote their partial sums (compute.KernelOptions.fp8_split_accum_bwd:
    Transformer Engine's GroupedLinear takes the same _2X_ACC_DGRAD / _2X_ACC_WGRAD), so the
    backward's extra is priced with that kernel, as the dense equivalent's backward was.
    `ep_dispatch`: what the all-to-alls toward the experts carry (`a2a_dtype_bytes`); 'deepep':
    DeepEP's kernels run them, rows deduplicated per rank and node (moe_deepep.py), routed as
    `expert_routing` says; 'hybridep': the same rows, plus HybridEP's routing-map all-gather
    in the forward (moe_deepep.hybridep_map_gather_time).
    `folded`: Megatron-Core's dispatcher over its folded expert grid (`folded`,
    `folded_tokens`): each tp rank routes its own sequence shard, the etp group all-gathers
    the received rows and reduce-scatters the experts' output (`etp_collectives`).
    `capacity`: token drop at that capacity factor (KernelOptions.expert_capacity; 0:
    dropless), padded to capacity where `capacity_pad` (KernelOptions.expert_capacity_pad):
    the rows the grouped GEMMs multiply, the permutations copy and the all-to-alls carry
    (moe_capacity.expert_rows: every expert's C rows padded, the imbalance capped at the
    factor without padding); padded, it also decides whether the FP8 experts copy their rows
    into 16-aligned buffers (moe_fp8.fp8_pad_passes) and whether the dispatcher syncs
    (moe_host.dispatcher_syncs). `router_dtype` 'fp32': the gating GEMM's TF32 backward and
    casts over a bf16 one (moe_router.fp32_router_extra)."""
    from meshtron.planner import compute

    lin_dt, other_dt = compute.compute_dtypes(dtype)
    lin_cl = cluster.at_dtype(lin_dt)
    gemm_opts = compute.KernelOptions(fp8_gemm=fp8_gemm, fp8_split_accum_bwd=fp8_split_accum_bwd)
    kernel = ((compute.FP8, compute.fp8_tile_scale(gemm_opts))
              if lin_dt == "fp8" else (compute.BF16, 1.0))
    kernel_b = ((compute.FP8, compute.fp8_tile_scale(gemm_opts, backward=True))
                if lin_dt == "fp8" else kernel)
    h, fe, k, e = model.hidden, model.moe_ffn_hidden, model.moe_top_k, model.moe_experts
    b = 4.0 if dtype == "fp32" else compute.BF16
    full = tokens  # the tokens the dense equivalent's routed GEMMs were charged for
    tokens, seen = folded_tokens(tokens, tp, etp, folded)
    # the rows after token drop (moe_capacity.py): each rank routes `tokens` of its own
    counts = expert_rows(tokens, k, e, ep, imbalance, capacity, capacity_pad)
    rows = max(1.0, routed_tokens_per_expert(seen, model, ep) * counts.per_expert)
    local, fe_local = e / ep, fe / etp

    def gemms(kern: tuple[float, float]) -> tuple[float, float]:
        """(the dense equivalent's routed GEMMs, the experts' grouped ones) with `kern`."""
        # dense equivalent's routed part: [T, k*fe/tp] up (x2 for SwiGLU's gate) and down
        dense = (compute.cluster_gemm_time(full, 2 * k * fe / tp, h, lin_cl, *kern)
                 + compute.cluster_gemm_time(full, h, k * fe / tp, lin_cl, *kern))
        grouped = local * (compute.cluster_gemm_time(rows, 2 * fe_local, h, lin_cl, *kern)
                           + compute.cluster_gemm_time(rows, h, fe_local, lin_cl, *kern))
        if tp > 1 and etp == 1 and not folded:
            # the shared experts run whole on every tp rank too (meshtron/parallel/tensor.py
            # `_moe_plan`), where the dense equivalent charged 1/tp of them
            fs = model.moe_shared_experts * fe
            if fs:
                def shared(cols):
                    return (compute.cluster_gemm_time(tokens, 2 * cols, h, lin_cl, *kern)
                            + compute.cluster_gemm_time(tokens, h, cols, lin_cl, *kern))

                grouped += shared(fs) - shared(fs / tp)
        return dense, grouped

    dense, grouped = gemms(kernel)
    dense_b, grouped_b = gemms(kernel_b) if kernel_b != kernel else (dense, grouped)
    bw = compute.membound_bytes_per_s(cluster.at_dtype(other_dt), stack)
    slots = tokens * k * h * b * counts.sent  # the rows the rank permutes and sends
    passes = permute_passes(stack, ep, local, ep_dispatch)
    permute = passes * 2 * slots / bw  # each reads and writes
    cast_f = cast_b = 0.0
    if lin_dt == "fp8":
        routed = seen * k * counts.received * h  # elements of the routed rows
        cast_f, cast_b = (x / bw for x in expert_cast_bytes(fp8_scaling, routed, tokens * h))
        # Transformer Engine's Fp8Padding / Fp8Unpadding around the expert GEMMs: each a read
        # and a write of the routed rows, forward and (their autograd twins) backward
        pad = fp8_pad_passes(per_expert, ep_dispatch, capacity if capacity_pad else 0.0,
                             tokens, k, e, ep, etp, folded)
        cast_f, cast_b = (c + pad * 2 * routed * b / bw for c in (cast_f, cast_b))
    extra_f = grouped - dense + permute + cast_f
    extra_b = 2 * (grouped_b - dense_b) + 2 * permute + cast_b
    if router_dtype == "fp32" and lin_dt != "fp32":  # the router routes the rank's `tokens`
        extra_b += fp32_router_extra(tokens, h, e, cluster, bw)
    fab = comm.Fabric.of(cluster)
    nbytes = a2a_bytes(tokens, k, h, b, ep)
    # each direction of the step makes one all-to-all toward the experts and one back
    def call(x: float) -> float:
        """One all-to-all of rows of x bytes per element: NCCL's, or DeepEP's deduplicated."""
        if ep_dispatch not in DEDUPLICATED:
            return a2a_time(nbytes * counts.received * x / b, group, fab, k, node_limit)
        return deepep_a2a_time(tokens, h, x, e, k, group, fab, expert_routing,
                               counts.received, node_limit) if ep > 1 else 0.0

    calls = [call(x) for x in a2a_dtype_bytes(b, lin_dt == "fp8", ep_dispatch)]
    # the etp group's all-gather of the received rows and reduce-scatter of the experts' output
    calls = [c + x for c, x in zip(calls, etp_collectives(seen * k * counts.received * h * b,
                                                          etp, cluster, fab, folded))]
    a2a_f = a2a_b = sum(calls)
    toward = calls[0] / a2a_f if a2a_f > 0 else 0.5  # the share of the call toward the experts
    if ep_dispatch == "hybridep":  # its routing map, gathered before each forward dispatch
        a2a_f += hybridep_map_gather_time(tokens, e, group, fab)
    if ep_overlap:
        # the whole MoE layer computes beside them: the dense equivalent's layer (attention
        # included; its routed GEMMs when no window is given) plus the experts' extra
        win_f = max(window_fwd, dense) + extra_f
        win_b = max(window_bwd, 2 * dense_b) + extra_b
        a2a_f, a2a_b = overlapped_a2a(a2a_f, a2a_b, win_f, win_b)
    if window_fwd > 0:
        # the GPU waits for the host where the host issues slower than the GPU runs, after the
        # sync of each forward (moe_host.py: the stretch between two syncs in issue order)
        ops = compute.kernels_per_layer(compute.active_equivalent(model),
                                        compute.KernelOptions(stack=stack))
        work = _ordered_work(dense, grouped, (cast_f, cast_b),
                             permute / passes,
                             permute, (a2a_f, a2a_b, toward), (window_fwd, window_bwd),
                             (ops, *expert_ops(lin_dt, local, per_expert),
                              2.0 * (local if per_expert else 1.0)))
        if dispatcher_syncs(per_expert, ep_dispatch, capacity if capacity_pad else 0.0):
            wait_f, wait_b = ordered_wait(work, compute.dispatch_s(cluster), ep_overlap)
        else:  # static splits: the host runs ahead across layers, only its total can show
            wait_f, wait_b = unsynced_wait(work, compute.dispatch_s(cluster))
        extra_f, extra_b = extra_f + wait_f, extra_b + wait_b
    return MoeLayerCost(extra_f, extra_b, a2a_f, a2a_b, nbytes * counts.sent)


def folded(framework: str, ep: int, etp: int | None = None) -> bool:
    """Whether the priced stack dispatches over Megatron-Core's folded expert grid
    (plan_rules_fields.EP_FOLDS: Megatron-Core >= 0.10's MoEAlltoAllTokenDispatcher, whose
    groups are the expert grid's `ep_group` and `expt_tp`): with expert parallelism, or with
    the plan's own etp (Plan.etp) at ep = 1. Megatron MoE at ep = 1 with the default etp keeps
    the price it had (the experts' tp collectives there are not priced)."""
    from meshtron.planner.plan_rules_fields import EP_FOLDS

    return framework in EP_FOLDS and (ep > 1 or etp is not None)


def folded_tokens(tokens: float, tp: int, etp: int, is_folded: bool) -> tuple[float, float]:
    """(tokens a rank routes and sends, tokens its experts see per ep rank's share) of a
    micro-batch's `tokens` per tensor group. Megatron-Core trains MoE under tp > 1 with
    sequence parallelism only (moe_layer.py raises otherwise): each tp rank holds T/tp tokens,
    routes and permutes them itself, sends them over the ep group (token_dispatcher.py
    `token_dispatch`: all_to_all(self.ep_group, ...)), and with etp > 1 all-gathers what it
    received over the etp group (`dispatch_postprocess`: gather_from_sequence_parallel_region
    on self.tp_group = expt_tp), so its experts see etp ranks' rows: T*etp/tp. Elsewhere
    (meshtron's runtime: the MoE replicated over tp, fed the gathered tokens) T and T."""
    if not is_folded:
        return tokens, tokens
    return tokens / tp, tokens * etp / tp


def etp_collectives(nbytes: float, etp: int, cluster: Any, fab: comm.Fabric,
                    is_folded: bool) -> tuple[float, float]:
    """Seconds of the etp group's collectives beside one direction's two all-to-alls:
    (the all-gather of the received rows after the dispatch, the reduce-scatter of the
    experts' output before the combine; the backward runs their twins, the same), `nbytes`
    the rows one rank's experts see (token_dispatcher.py `dispatch_postprocess`,
    `combine_preprocess`). The etp ranks are consecutive (placement.EXPERT_AXES: innermost),
    inside a node when etp divides it. Zero at etp = 1, where Megatron-Core runs neither."""
    if not is_folded or etp <= 1:
        return 0.0, 0.0
    from meshtron.planner.placement import tp_group

    group = tp_group(etp, cluster.gpus_per_node)
    return comm.all_gather(nbytes, group, fab), comm.reduce_scatter(nbytes, group, fab)


def _ordered_work(dense: float, grouped: float, cast: tuple[float, float], first: float,
                  permute: float, a2a: tuple[float, float, float], window: tuple[float, float],
                  ops: tuple[float, float, float, float]) -> MoeWork:
    """One MoE layer's GPU seconds in the order the stretch between two syncs issues them
    (moe_host.MoeWork): the first permutation (`first`: one pass of `permute`) before the
    sync, the chunk sort after the dispatch all-to-all, the unsort and the unpermute around
    the combine; the backward makes the same passes in reverse. `grouped`: the forward's
    expert GEMMs (twice that backward), `cast`: their casts (forward, backward); `a2a`,
    `window`: (forward, backward) exposed all-to-alls (with the share of the calls toward
    the experts: the forward dispatch, the combine's backward twin) and dense-equivalent
    layer; `ops`: host
    operations of the dense part, of the experts (forward, backward) and of their weight-
    gradient GEMMs (one per linear, per expert where issued so)."""
    rest = permute - 2 * first  # chunk sort and unsort, where the stack makes them
    toward = a2a[2]
    return MoeWork(pre_f=max(window[0], dense) - dense + first,
                   dispatch_f=a2a[0] * toward + rest / 2, experts_f=grouped + cast[0],
                   combine_f=a2a[0] * (1 - toward) + rest / 2 + first,
                   combine_b=a2a[1] * toward + permute,
                   dispatch_b=a2a[1] * (1 - toward) + permute, experts_b=2 * grouped + cast[1],
                   wgrad_b=grouped, attn_b=max(window[1], 2 * dense) - 2 * dense,
                   dense_ops=ops[0], expert_ops_f=ops[1], expert_ops_b=ops[2],
                   wgrad_ops=ops[3])


def overlapped_a2a(a2a_f: float, a2a_b: float, win_f: float, win_b: float) -> tuple[float, float]:
    """Exposed (forward, backward) all-to-all seconds of one MoE layer whose stack overlaps
    them across a pair of micro-batches: DualPipe runs a forward chunk beside a backward chunk
    of another micro-batch, the dispatch and combine of each direction beside the other's
    attention and MLP computation (DeepSeek-V3 report section 3.2.1, figure 4); Megatron-Core's
    `--overlap-moe-expert-parallel-comm` merges the forward and backward of two micro-batches
    in 1F1B the same way (moe/README.md, "EP A2A overlap"). So all four all-to-alls of a layer
    hide behind the pair's whole layer computation (forward + backward, attention included),
    not behind the expert GEMMs alone; what does not fit stays exposed and the hidden part
    interferes (compute.overlapped). Split back to the directions in proportion."""
    comm_t = a2a_f + a2a_b
    if comm_t <= 0:
        return 0.0, 0.0
    from meshtron.planner import compute

    exposed = compute.overlapped(comm_t, win_f + win_b)
    return exposed * a2a_f / comm_t, exposed * a2a_b / comm_t


def permute_passes(stack: str, ep: int, local_experts: float = 2.0,
                   dispatch: str = "bf16") -> float:
    """Memory-bound passes over the T*k routed slots one MoE layer's forward makes (module
    docstring); the backward makes the same. Megatron-Core sorts the received chunks by local
    expert only when a rank holds several ("Permutation 2", `num_local_experts > 1`);
    meshtron's dispatcher regroups always. DeepEP (`dispatch` 'deepep': AutoModel's and
    Megatron-Core's flex dispatchers) takes the tokens unpermuted with their top-k and returns
    them so: one fused permute of the received rows into expert order after the dispatch, one
    unpermute before the combine (token_permutation2 / token_unpermutation with
    moe_permute_fusion), whatever the stack."""
    if dispatch in DEDUPLICATED and ep > 1:  # HybridEP's dispatch_with_permute: the same two
        return 2.0
    if stack == "eager":
        # 2 gathers, zero fill (a write: half a pass), scatter, product, index_add
        return 5.5 + (2.0 if ep > 1 else 0.0)
    return 2.0 + (2.0 if ep > 1 and local_experts > 1 else 0.0)


def expert_params_per_layer(model: ModelSpec) -> float:
    """Routed expert parameters of one MoE layer (3 matrices of fe x h per expert)."""
    if not model.is_moe:
        return 0.0
    return model.moe_experts * model.mlp_params(model.moe_ffn_hidden)


def expert_params_local(model: ModelSpec, pp: int, ep: int) -> float:
    """Routed expert parameters of one block on one rank, as memory.layer_params_local averages
    blocks: the mean over the model's blocks without pipelining, the MoE block's with it."""
    per = expert_params_per_layer(model)
    if pp == 1:
        per = per * model.moe_layers / model.layers
    return per / ep


def moe_share(model: ModelSpec, pp: int) -> float:
    """Fraction of the blocks of an average stage that are MoE layers (as layer_params_local:
    exact without pipelining, the MoE-only fullest stage with it)."""
    if not model.is_moe:
        return 0.0
    return 1.0 if pp > 1 else model.moe_layers / model.layers


def measured_imbalance(loads: list[float]) -> float:
    """max/mean of per-expert-parallel-rank loads (router statistics)."""
    loads = [float(x) for x in loads]
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def rank_loads(expert_loads: list[float], ep: int) -> list[float]:
    """Per-rank loads of `ep` ranks holding contiguous blocks of E/ep experts (expert.py)."""
    e = len(expert_loads)
    if ep < 1 or e % ep:
        raise ValueError(f"ep={ep} must divide the {e} experts")
    per = e // ep
    return [sum(expert_loads[i * per:(i + 1) * per]) for i in range(ep)]


__all__ = ["DEFAULT_IMBALANCE", "FP8_DISPATCH_BYTES", "MoeLayerCost", "a2a_bytes",
           "a2a_dtype_bytes", "a2a_time", "expert_cast_bytes", "fp8_pad_passes", "moe_layer_cost",
           "MOE_HOST_OPS", "PER_EXPERT_HOST_OPS", "host_exposed", "host_seconds",
           "overlapped_a2a", "per_expert_gemms",
           "permute_passes",
           "expert_params_local", "expert_params_per_layer", "measured_imbalance",
           "rank_loads", "routed_tokens_per_expert", "moe_share"]
