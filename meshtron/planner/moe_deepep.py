"""DeepEP's normal-mode dispatch and combine (KernelOptions.ep_dispatch 'deepep'): what one
MoE layer's token all-to-alls move when DeepEP runs them instead of NCCL's all-to-all.
Torch-free; moe_cost.py calls `deepep_a2a_time` in place of its `a2a_time`. NVIDIA's HybridEP
('hybridep') moves the same rows and gathers the routing map first
(`hybridep_map_gather_time`).

What DeepEP sends (deepseek-ai/DeepEP, the V1 Buffer that NeMo AutoModel's and Megatron-Core's
flex token dispatchers call, moe/megatron/fused_a2a.py; docs/legacy.md):

* a token is sent once to every RANK that holds at least one of its top-k experts, not once
  per expert: the dispatch output has one row per (token, rank), carrying the token's
  top-k indices and weights, and the receiving rank permutes it to its experts; the combine
  sends one row back per (token, rank), already summed over that rank's experts;
* across nodes ("normal kernels with NVLink and RDMA forwarding") a token crosses the network
  once per destination NODE, to the GPU of the same local index there, which forwards it over
  NVLink to the ranks of that node that need it; the combine reduces within the node first
  and sends one row per (token, node) back.

So per token, with R the expected number of distinct ranks and D of distinct nodes its k
experts sit on (`spread`), N the nodes of the ep group and L its ranks per node: the network
carries D (N-1)/N rows (its own node is any of the N alike), NVLink R (L-1)/L (every rank hit
but the entry GPU of each node, which is one of the node's L alike). NCCL's all-to-all carries
k rows per token, k (ep-L)/ep of them across nodes (moe_cost.a2a_bytes / a2a_time).

DeepEP's README measures its normal kernels at the link's bandwidth ("Bottleneck bandwidth",
H800 with CX7 400 Gb/s: 43-58 GB/s RDMA against ~50 GB/s, 153-158 GB/s NVLink against ~160),
so the seconds are the rows over the fabric's bandwidths (comm.Fabric, the same as NCCL's),
the slower link setting the time, plus one launch's latency.

Where the experts are (`spread`): the routed experts of rank r are the contiguous block
[r E/ep, (r+1) E/ep) (GShard; AutoModel's and Megatron-Core's local_expert_indices), node n
holds L of those blocks. KernelOptions.expert_routing says how a token picks its k:

* 'spread': k distinct experts uniform over the E (a balanced learned router on average,
  Megatron-Core's moe_router_force_load_balancing: random logits): a rank is missed with
  probability C(E - E/ep, k) / C(E, k), a node with C(E - E L/ep, k) / C(E, k);
* 'contiguous': NeMo AutoModel's FakeBalancedGate (components/moe/layers.py, noise 0): token t
  takes experts (t k + j) mod E, j < k, the same on every rank: R and D counted exactly over
  the E / gcd(E, k) starting points.
"""

from __future__ import annotations

from math import comb, gcd

from meshtron.planner import comm

ROUTINGS = ("spread", "contiguous")
"""How a token's k experts are picked (KernelOptions.expert_routing; module docstring)."""


def _missed(e: int, k: int, held: float) -> float:
    """Probability that k distinct experts drawn uniformly from e miss a block of `held`."""
    held = int(round(held))
    if held >= e or k > e - held:
        return 0.0
    return comb(e - held, k) / comb(e, k)


def spread(experts: int, top_k: int, ep: int, local: int,
           routing: str = "spread") -> tuple[float, float]:
    """(R, D): expected distinct ranks and nodes one token's top-k experts sit on, for an ep
    group of `ep` ranks, `local` per node, holding contiguous expert blocks (module
    docstring)."""
    e, k = int(experts), int(top_k)
    ep, local = max(1, ep), max(1, min(local, ep))
    per_rank = e / ep
    nodes = max(1, ep // local)
    if routing == "contiguous":
        starts = range(0, e, gcd(e, k))  # t k mod e visits the multiples of gcd(e, k)
        ranks = nodes_hit = 0
        for s in starts:
            picked = [(s + j) % e for j in range(k)]
            owners = {int(x // per_rank) for x in picked}
            ranks += len(owners)
            nodes_hit += len({r // local for r in owners})
        n = len(starts)
        return ranks / n, nodes_hit / n
    if routing != "spread":
        raise ValueError(f"routing={routing!r}: allowed values are {', '.join(ROUTINGS)}")
    return (ep * (1.0 - _missed(e, k, per_rank)),
            nodes * (1.0 - _missed(e, k, per_rank * local)))


def deepep_rows(experts: int, top_k: int, group: comm.Group, routing: str = "spread",
                node_limit: int = 0) -> tuple[float, float]:
    """(network rows, NVLink rows) one token sends in one DeepEP dispatch (the combine sends
    the same back): D (N-1)/N and R (L-1)/L (module docstring); `node_limit` M > 0: node-
    limited routing keeps D <= M (KernelOptions.ep_node_limit)."""
    n, local = group.size, max(1, min(group.local, group.size))
    if n <= 1:
        return 0.0, 0.0
    ranks, nodes_hit = spread(experts, top_k, n, local, routing)
    if node_limit > 0:
        nodes_hit = min(nodes_hit, float(node_limit))
    nodes = max(1, n // local)
    return nodes_hit * (nodes - 1) / nodes, ranks * (local - 1) / local


def deepep_a2a_time(tokens: float, hidden: int, elem_bytes: float, experts: int, top_k: int,
                    group: comm.Group, fab: comm.Fabric, routing: str = "spread",
                    imbalance: float = 1.0, node_limit: int = 0) -> float:
    """Seconds of one DeepEP dispatch (or combine) of `tokens` rows of `hidden` elements of
    `elem_bytes` on one rank: its network and NVLink rows over the fabric's bandwidths, the
    slower setting the time, plus the launch and each link's latency. `imbalance`: the
    fullest rank receives that many times the mean (moe_cost.py)."""
    inter, intra = deepep_rows(experts, top_k, group, routing, node_limit)
    if inter <= 0 and intra <= 0:
        return 0.0
    row = tokens * hidden * elem_bytes * imbalance
    t_intra = intra * row / fab.intra_bw + fab.intra_alpha if intra > 0 else 0.0
    t_inter = inter * row / fab.inter_bw + fab.inter_alpha if inter > 0 else 0.0
    return fab.base_latency + max(t_intra, t_inter)


DEDUPLICATED = ("deepep", "hybridep")
"""KernelOptions.ep_dispatch values whose kernels send a token once per destination rank and
node (`deepep_a2a_time`): DeepEP's normal kernels and NVIDIA's HybridEP (DeepEP branch
hybrid-ep, docs/README_Hybrid-EP.md: RDMA across nodes, then NVLink inside the node)."""

ROUTING_MAP_BYTES = 1.0
"""HybridEP's routing map is a torch.bool [tokens, experts] tensor (Megatron-Core
token_dispatcher.py `_HybridEPManager.setup_metadata`): one byte an entry."""


def hybridep_map_gather_time(tokens: float, experts: int, group: comm.Group,
                             fab: comm.Fabric) -> float:
    """Seconds of the routing-map all-gather HybridEP makes before every forward dispatch:
    `dispatch_with_permute` without a handle runs its metadata preprocessing on the global
    routing map, [tokens x ep, experts] bools gathered from the ep group, by NCCL's
    all_gather_into_tensor whenever the group spans nodes (deepseek-ai/DeepEP branch hybrid-ep
    at a0d27f1, 2026-03-31: deep_ep/hybrid_ep_buffer.py, csrc/hybrid_ep/executor/executor.cu
    `Executor::allgather_routing_map`; the same call at 7febc6e, 2026-02-09). Megatron-Core's
    HybridEPDispatch makes the handle in the forward and reuses it in both backwards
    (moe/fused_a2a.py at d7288711, the core_r0.17 pin of Megatron-Bridge v0.4.1): one gather
    per MoE layer forward. The count copy to the host that follows is the dispatcher's
    per-forward sync, priced with every dispatcher (estimate_pieces: host.SYNC_S)."""
    if group.size <= 1:
        return 0.0
    return comm.all_gather(tokens * group.size * experts * ROUTING_MAP_BYTES, group, fab)


# ---- DeepEP's preallocated buffers --------------------------------------------------------------
DEEPEP_NUM_SMS = 20
"""SMs of DeepEP's normal kernels: Buffer.num_sms' default (deep_ep/buffer.py), the
dispatcher_num_sms NeMo AutoModel passes (moe/experts.py) and Megatron-Core's
moe_deepep_num_sms default; a channel is two SMs."""
NVL_PEERS = 8
"""NUM_MAX_NVL_PEERS (csrc/kernels/configs.cuh): ranks of one NVLink domain."""
_NVL_RECV = {2: 256, 4: 256, 8: 256, 16: 288, 24: 288, 32: 288, 48: 288, 64: 288, 96: 480,
             128: 560, 144: 720, 160: 720}
"""num_max_nvl_chunked_recv_tokens of Buffer.get_dispatch_config / get_combine_config per ep
size (the same in both tables, DeepEP V1 deep_ep/buffer.py before the V2 release b306af0)."""
_RDMA_SEND = {16: (20, 12)}
"""num_max_rdma_chunked_send_tokens (dispatch, combine) where they are not 8 (ep >= 24: 8, 8;
ep 96-160: 12, 8); the 128 receive tokens are rounded up to a multiple of them (Config)."""
_TOPK, _SCALES, _META, _INT4 = 128, 128, 8, 16
"""kNumMaxTopK, kNumMaxScales (csrc/config.hpp), sizeof(SourceMeta) (two ints,
csrc/kernels/internode.cu), sizeof(int4); topk indices are int64 (TOPK_IDX_BITS 64)."""


def _rdma_recv(ep: int) -> int:
    """The larger of the dispatch and combine configs' aligned RDMA receive tokens."""
    send = _RDMA_SEND.get(ep, (12, 8) if ep >= 96 else (8, 8))
    return max(-(-128 // s) * s for s in send)


def deepep_buffer_bytes(hidden: int, ep: int, elem_bytes: float = 2.0,
                        num_sms: int = DEEPEP_NUM_SMS) -> float:
    """Bytes of the NVLink and RDMA buffers DeepEP's Buffer preallocates per rank for an ep
    group of `ep` ranks and rows of `hidden` elements (hidden_bytes = hidden x max(element,
    2): fused_a2a.get_hidden_bytes in AutoModel and Megatron-Core), the larger of the
    dispatch and combine configs' size hints (Config.get_nvl_buffer_size_hint /
    get_rdma_buffer_size_hint, csrc/config.hpp), allocated once, outside PyTorch's caching
    allocator (cudaMalloc / nvshmem_malloc): a fixed allowance like the CUDA context's."""
    if ep <= 1:
        return 0.0
    row = hidden * max(elem_bytes, 2.0)
    ch = num_sms // 2
    nvl, rdma = min(ep, NVL_PEERS), max(ep // NVL_PEERS, 1)
    recv = _NVL_RECV.get(ep, max(v for k, v in _NVL_RECV.items() if k <= ep))
    per_token = row + _META + _TOPK * 8 + _TOPK * 4 + _SCALES * 4
    nvl_bytes = ch * nvl * (2 * rdma + 3) * 4 + ch * nvl * recv * per_token
    if ep <= NVL_PEERS:
        return float(-(-nvl_bytes // 128) * 128)
    r = _rdma_recv(ep)
    rdma_bytes = (ch * rdma * (NVL_PEERS * 2 + 2) * 2 * 4
                  + ch * rdma * r * (per_token + _INT4) * 2)
    return float(-(-nvl_bytes // 128) * 128 + -(-rdma_bytes // 128) * 128)
