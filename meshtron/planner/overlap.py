"""How much of a collective the compute beside it hides, and what hiding it costs: the one
`overlapped` formula (tensor-, context-, data- and expert-parallel overlap), the SMs a
communication kernel takes from a GEMM, and the tensor-parallel collectives of a layer paired
with the GEMM that can hide each (`tp_exposed`, compute.py's layer cost). Torch-free."""

from __future__ import annotations

from typing import Any, Callable

from meshtron.planner.cluster import ClusterSpec, gpu_type

OVERLAP_INTERFERENCE = 0.15
"""Overlapped communication is not free: NCCL kernels take SMs and HBM bandwidth from the
GEMMs they run beside (GEMMs slow by 10-25% while overlapped, e.g. Wang et al. 2023 "Overlap
communication with dependent computation via decomposition", Pati et al. 2024 "T3"). The hidden
part of overlapped communication costs this fraction of its duration where no NCCL group is
priced: copy-engine transfers (TE's ring exchange, async TP), pipeline p2p, expert all-to-alls.
NCCL collectives of the tensor, context and data-parallel groups pay their SM share instead
(planner/host.py `sm_interference`: their CTAs over the GPU's SMs)."""


def overlapped(comm_time: float, window: float,
               interference: float = OVERLAP_INTERFERENCE) -> float:
    """Exposed time of a collective run beside `window` seconds of compute it overlaps: what
    does not fit, plus `interference` of the hidden part (the SMs and HBM it shares: NCCL's
    CTAs per SM, planner/host.py `sm_interference`; OVERLAP_INTERFERENCE where no SM is taken
    or the group is not known)."""
    if comm_time <= window:
        return interference * comm_time
    return comm_time - window + interference * window


TE_UB_COMM_SMS = 16
"""SMs Transformer Engine's userbuffers give the communication kernel of a 'pipeline'
reduce-scatter overlap, taken from the GEMM beside it (`set_sm_margin`;
transformer_engine/pytorch/module/base.py `initialize_ub` get_default_config: num_sm 16, 4
splits; NeMo's tuned configs use 24 for the attention projection and 8-16 for MLP-down); the
'ring_exchange' method moves chunks with the copy engines (num_splits = tp)."""
TE_UB_PIPELINE_SPLITS = 4
"""GEMM chunks of TE's 'pipeline' reduce-scatter overlap (proj_fprop, fc2_fprop)."""
DEFAULT_SMS = 108
"""SMs assumed for a GPU outside the catalogue (an A100's)."""


def sm_count(cluster: ClusterSpec) -> int:
    """The cluster's GPU's SM count (catalogue), else DEFAULT_SMS."""
    if cluster.gpu is not None:
        sms = gpu_type(cluster.gpu).sms
        if sms:
            return sms
    return DEFAULT_SMS


def sm_margin(gemm_s: float, sms: int, taken: int = TE_UB_COMM_SMS) -> float:
    """Extra seconds of a GEMM that runs on sms - taken SMs while a communication kernel holds
    `taken` of them (the GEMM is SM-bound: its waves stretch by sms / (sms - taken))."""
    return gemm_s * taken / max(1, sms - taken)


def tp_exposed(colls: dict[str, float], gemms: dict[str, float],
               gemm: Callable[..., float], tokens: float, tp: int, sp: bool,
               opts: Any, sms: int, nccl: float = OVERLAP_INTERFERENCE,
               atp_unfused: frozenset[tuple[str, str]] = frozenset()) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's tensor-parallel collectives left on the
    critical path, each paired with the one GEMM that can hide it (and the cost of hiding it).

    Forward: all-gather before QKV and MLP-up, reduce-scatter after the output projection and
    MLP-down (without SP: an all-reduce after each of the latter two), exposed unless
    overlapped with that GEMM: Transformer Engine userbuffers (`tp_comm_overlap`, TE's default
    methods): the all-gathers as a copy-engine ring exchange in tp chunks (the GEMM runs on
    tokens/tp rows per chunk, every chunk's transfer but the last hides), the reduce-scatters
    'pipelined' over 4 chunks on 16 SMs (the last chunk's part exposed, the GEMM slowed by the
    SM margin); PyTorch async TP (`async_tp`): both decomposed into tp chunks over symmetric
    memory. Backward, per GEMM group: the row-parallel input gradients need the output
    gradient all-gathered (SP), the column-parallel ones reduce-scatter (all-reduce) their
    result; Megatron's linears (`megatron_linear`) run the latter beside the weight-gradient
    GEMM and re-gather the sequence-sharded input beside the input-gradient GEMM (TE 'bulk':
    with the SM margin), async TP chunks the dgrad GEMMs as forward, autograd's conjugate
    collectives (DTensor) stay exposed. `opts`: compute.KernelOptions (its tp_comm_overlap,
    async_tp and megatron_linear); `gemm(group, rows)`: the group's GEMM time at `rows` rows;
    `nccl`: the interference of an NCCL collective of the tensor group beside a GEMM
    (planner/host.py `sm_interference`; copy-engine transfers keep OVERLAP_INTERFERENCE).
    `atp_unfused`: (collective, GEMM group) pairs async TP cannot fuse with that group's GEMM
    under the FP8 casting (planner/fp8.py `async_tp_unfused`; 'ag' with the row-parallel
    group whose input gradient needs it): exposed whole."""
    ag, ag_in, rs, ar = colls["ag"], colls["ag_in"], colls["rs"], colls["ar"]

    def chunked(c: float, group: str, chunks: int) -> tuple[float, float]:
        """(exposed comm, extra GEMM time) of `c` hidden behind `group`'s GEMM split into
        `chunks` row chunks run one after the other (PyTorch's fused_all_gather_matmul /
        fused_matmul_reduce_scatter): every chunk's transfer but one overlaps a chunk's
        product, each product on tokens/chunks rows."""
        g = gemm(group, tokens / chunks) * chunks
        return overlapped(c, (chunks - 1) / chunks * g), g - gemms[group]

    def te_ring(c: float, group: str) -> float:
        """TE's ring exchange: tp chunks moved by the copy engines, the chunk GEMMs spread
        over several compute streams (so they fill the GPU like the whole GEMM)."""
        return overlapped(c, (tp - 1) / tp * gemms[group])

    def te_pipeline(c: float, group: str) -> float:
        """TE's pipelined reduce-scatter: chunk i's scatter beside chunk i+1's GEMM, on 16
        SMs taken from it (set_sm_margin); the last chunk's part has nothing to hide behind."""
        splits = TE_UB_PIPELINE_SPLITS
        g = gemms[group]
        slow = sm_margin(g, sms)
        rest = (splits - 1) / splits
        return c / splits + max(0.0, rest * (c - g - slow)) + slow

    def te_bulk(c: float, group: str) -> float:
        """TE's bulk overlap as the NeMo / Megatron-Bridge recipes configure it
        (nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py: 2-24 SMs,
        set_sm_margin False): the whole collective beside the whole GEMM, sharing SMs."""
        return overlapped(c, gemms[group], TE_UB_COMM_SMS / sms)

    ub = opts.tp_comm_overlap and sp
    atp = opts.async_tp and sp and not ub
    fwd = bwd = 0.0
    for col, row in (("qkv", "out"), ("up", "down")):
        # forward
        if not sp:
            fwd += ar
        elif ub:
            fwd += te_ring(ag_in, col) + te_pipeline(rs, row)
        elif atp:
            fwd += (ag_in if ("ag_in", col) in atp_unfused else sum(chunked(ag_in, col, tp))) \
                + sum(chunked(rs, row, tp))
        else:
            fwd += ag_in + rs
        # backward: the row-parallel GEMM's input gradient needs the gathered output gradient
        if sp:
            if ub:
                bwd += te_ring(ag, row)
            elif atp and ("ag", row) not in atp_unfused:
                bwd += sum(chunked(ag, row, tp))
            else:
                bwd += ag
        # the column-parallel GEMM's input gradient is reduced
        red = rs if sp else ar
        if opts.megatron_linear:
            if sp and ub:  # TE bulk overlaps: re-gather beside dgrad, reduce beside wgrad
                bwd += te_bulk(ag_in, col) + te_bulk(red, col)
            else:
                bwd += ((overlapped(ag_in, gemms[col], nccl) if sp else 0.0)
                        + overlapped(red, gemms[col], nccl))
        elif atp and ("red", col) not in atp_unfused:
            bwd += sum(chunked(red, col, tp))
        else:
            bwd += red
    return fwd, bwd
