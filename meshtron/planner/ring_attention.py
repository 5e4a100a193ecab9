"""Context-parallel flash attention as the stacks call it, and what torch's ring attention
runs around those calls, per layer.

The calls (`ring_core_time`, every stack with cp > 1): a load-balanced rank holds two chunks
(head and tail) of s_local / 2 tokens; its first call is the causal square of its own s_local
queries and keys, each of the other cp - 1 is one unmasked call on a chunk pair, s_local
queries x s_local / 2 keys or the reverse (torch's `_templated_ring_attention` with the
round-robin balancer; Transformer Engine's p2p ring likewise; meshtron's calls, a causal c x c
diagonal and an unmasked prefix per chunk, split the same FLOPs a little differently and are
priced with this split). Each call's QK^T and PV are timed by the same head_dim-wide GEMM model
as the whole-sequence core (compute_core.py): the FLOPs add up to the causal half of
s_local x cp * s_local, the shorter calls run at their own shapes' efficiency.

torch's experimental `context_parallel` (torch/distributed/tensor/experimental/_attention.py,
torch 2.6-2.8, the one torchtitan's `experimental.context_parallel_degree` turns on; read at
pytorch commit 0123248a) replaces each SDPA call of a rank by `_templated_ring_attention`: cp
flash calls on chunk pairs (their kernel time: `ring_core_time`) and, around them,
plain PyTorch ops that move the local tensors through HBM, and collectives. Per layer and rank,
with E the elements of the local queries (= outputs, = their gradients) and K those of the
local keys (= values; at every query head when the model repeats K/V before SDPA, torchtitan's
`repeat_kv`), priced for the rank that does the most (the last one: with the round-robin
balancer its every later step is a full-query, half-key call, `_is_causal_behavior`):

Forward (`_templated_ring_attention`, `_SDPAMerger` with `_cp_options.convert_to_f32`):
  key/value `.contiguous()` (SDPA's head-major views copied)             2 x (2+2) K
  `torch.cat([key.flatten(), value.flatten()])` before each of cp-1 sends 2 x (2+2) K each
  `out.to(float32)` of every call                                        (2+4) E each
  the merge of each later call: out - sigmoid(dlse) * (out - block_out) (4+4+4) + (4+4) +
                                                                         (4+4+4) E each
  `results()`: the merged output back to bf16                            (4+2) E
Backward (`_templated_ring_attention_backward`, accumulation in fp32):
  zeros_like of dq, dk, dv in fp32                                       4 E + 2 x 4 K
  key/value `.contiguous()` again; the cat before each of cp-1 sends     8 K; 8 K each
  first call: dk, dv, dq += the call's bf16 gradients                    (4+2+4) (2K + E)
  each later call: dk, dv `_partial_update` (add into the first chunk,
    torch.cat of the chunks) and dq +=                                   2 x (5 + 8) K + 10 E
  `torch.cat([grad_key.flatten(), grad_value.flatten()])` in fp32,
    before each of the cp dk/dv sends                                    2 x (4+4) K each
  dq and the received dk/dv back to bf16                                 (4+2) E + 2 x (4+2) K
The log-sum-exp tensors are head_dim times smaller and left out of the bytes (not of the
launches: `torch_ring_launches`).

Under torch.compile (`torch_ring_bytes_compiled`, KernelOptions.stack 'compiled') the ring is
traced into the block's graph: torchtitan compiles each TransformerBlock with
`torch.compile(block, fullgraph=True)` (parallelize_llama.py `apply_compile`, 2024-2025), so
the patched SDPA and the `_sdpa_handler` it dispatches to are traced, not run op by op
(`_maybe_wait`: "When tracing the code, the result tensor is not an AsyncCollectiveTensor";
torch's test_attention.py `test_ring_attention_compile` compiles the ring with fullgraph=True),
forward and backward alike (AOTAutograd runs the backward handler while tracing the joint
graph). Inductor then runs the memory-bound ops between two flash calls as one fused kernel
and drops what no one reads: the all-gather rotater consumes only the first K/V cat, so the
cp - 2 later cats are dead code; `.contiguous()` of SDPA's head-major views fuses into the
kernel that produces K/V; zeros + the first `+=` is one cast. Per layer and rank, same E, K
and rank as above:
Forward:
  the K/V cat for the all-gather                                        (4+4) K
  each later call's merge, the previous call's `.to(float32)` and the
    last one's cast back folded in: reads the running output (bf16 from
    the first call, fp32 after) and the call's bf16 output, writes fp32
    (bf16 after the last call)                                          (2+2+2) E at cp 2;
                                                                         (2+2+4) E, (4+2+4) E
                                                                         each middle one,
                                                                         (4+2+2) E
Backward:
  the K/V cat for the all-gather                                        (4+4) K
  the first call's dk/dv cast to fp32 into the first send's cat         (2+2) K + 8 K
  each later call: the received fp32 dk/dv plus the call's half-key
    dk/dv (`_partial_update`), written into the next send's cat         8 K + 2 K + 8 K
  dq: the cp calls' bf16 dq summed and cast back in one kernel          2 E cp + 2 E
  the last received dk/dv back to bf16                                  (4+2) 2 K

Collectives (`_create_rotater`, torchtitan's `context_parallel_rotate_method` default
'allgather'): forward and backward each all-gather the local K/V once (`_AllGatherRotater`:
issued before the first call, waited before the second, so only the first call hides it);
the backward sends the fp32 dk/dv partial sums to the next rank after every call
(`_AllToAllRotater`, `ft_c.permute_tensor`), each waited after the following call, the last
one after the loop (nothing hides it).

Transformer Engine's p2p ring (`AttnFuncWithCPAndKVP2P`, the cp_comm_type 'p2p' that
Megatron-Core's TEDotProductAttention runs by default: transformer_engine/pytorch/attention.py
at v1.11 and v2.1, attention/dot_product_attention/context_parallel.py at d0067d0da; bf16
q/k/v in the 'sbhd'/'bshd' layouts, cuDNN fused attention) makes the same calls
(`ring_core_time`), sends each step's K/V to the next rank while the step's kernel runs (the
forward's steps alternate between two streams so that consecutive kernels may overlap; the
backward's on one) and runs these memory-bound ops around them, per layer and rank (`te_ring_bytes`,
E_q the local query elements = dq's, E_o the output's, K the local keys' = values'; priced for
the last rank, whose every later step is a full-query call):

Forward:
  `torch.cat((k, v))` into the first send buffer                          (4+4) K
  `out = torch.zeros_like(q)` in bf16, before the corrections: q's shape   2 E_q
    (attention.py at v2.2 `torch.zeros_like(q if not fp8 else ...)`; MLA's
    q head is wider than its V)
  `flash_attn_fwd_out_correction` of each of the cp steps' outputs: one
    fused kernel (`jit_fuser`: torch.compile) reading the step's bf16
    output and `out` and writing `out` back (`out.add_`)                  (2+2+2) E_o each
Backward:
  `p2p_comm_buffers[0][0].copy_(kv)`                                      (4+4) K
  dq: the first step's `dq.copy_(dq_)`, each later step's `dq.add_(dq_)`  4 E_q; 6 E_q each
  `torch.cat((dk_, dv_))` of each step: the cp - 1 off-diagonal steps'
    half-key gradients, the last (diagonal) step's whole                  4 K each; 8 K
  dkv: the first step's `copy_` into half of the received buffer, each of
    the cp - 2 other off-diagonal steps' `add_` into that half, the
    diagonal's `dkv.add_(dkv_)` over the whole                            4 K; 6 K each; 12 K
The softmax statistics (`flash_attn_fwd_softmax_lse_correction`, the lse clones) are
head_dim times smaller and left out, as for torch's ring. The K/V and dK/dV sends are
NCCL's (`cp_exposed`): the backward's last step sends the accumulated dK/dV beside the
diagonal call, so each exchange has a call to hide behind. Its launches: `te_ring_launches`.
"""

from __future__ import annotations

from meshtron.planner import comm
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.gemm import cluster_gemm_time
from meshtron.planner.overlap import overlapped


def bwd_ratio(hd: float, hd_v: float) -> float:
    """A flash core's backward over its forward FLOPs: S = QK^T again, dQ and dK at the q/k
    width `hd`, dP = dO V^T and dV at V's `hd_v`, against QK^T and PV (FlashAttention-2's
    backward, Dao 2023, algorithm 2): 2.5 where the widths agree."""
    return (3.0 * hd + 2.0 * hd_v) / (hd + hd_v)


def _call_fwd(cluster: ClusterSpec, batch_heads: float, q: float, k: float, head_dim: float,
              causal: bool, v_dim: float) -> float:
    """Forward seconds of one flash call over `batch_heads` heads of `q` queries against `k`
    keys: its QK^T (`head_dim`) and PV (`v_dim`) products by the GEMM model, half of them for
    a causal square."""
    one = cluster_gemm_time(q, k, head_dim, cluster) + cluster_gemm_time(q, v_dim, k, cluster)
    return (0.5 if causal else 1.0) * batch_heads * one


def ring_core_time(cluster: ClusterSpec, batch_heads: float, s_local: float, cp: int,
                   head_dim: float,
                   v_dim: float | None = None) -> tuple[float, float, float, float]:
    """(forward, backward, forward of the first call, backward of the first call) seconds of
    a load-balanced context-parallel flash core on one rank, as the kernels are called
    (module docstring): the causal s_local square, then cp - 1 unmasked s_local x s_local / 2
    pairs; each backward 2.5x its forward where V is as wide as Q/K (5 GEMMs instead of 2,
    bwd_ratio otherwise; `v_dim` None: `head_dim`)."""
    v_dim = head_dim if v_dim is None else v_dim
    ratio = bwd_ratio(head_dim, v_dim)
    first_f = _call_fwd(cluster, batch_heads, s_local, s_local, head_dim, True, v_dim)
    rest_f = (cp - 1) * _call_fwd(cluster, batch_heads, s_local, s_local / 2, head_dim,
                                  False, v_dim)
    return first_f + rest_f, ratio * (first_f + rest_f), first_f, ratio * first_f


def torch_ring_bytes(e: float, k: float, cp: int) -> tuple[float, float]:
    """(forward, backward) HBM bytes per layer and rank of the ops around the flash calls
    (module docstring), for `e` query and `k` key elements on this rank."""
    fwd = 8.0 * k + 8.0 * k * (cp - 1) + 6.0 * e * cp + 32.0 * e * (cp - 1) + 6.0 * e
    bwd = (4.0 * e + 8.0 * k + 8.0 * k + 8.0 * k * (cp - 1) + 10.0 * (2 * k + e)
           + (26.0 * k + 10.0 * e) * (cp - 1) + 16.0 * k * cp + 6.0 * e + 12.0 * k)
    return fwd, bwd


def torch_ring_bytes_compiled(e: float, k: float, cp: int) -> tuple[float, float]:
    """(forward, backward) HBM bytes per layer and rank of the ops around the flash calls where
    torch.compile traces the ring (module docstring, 'Under torch.compile'): inductor's fused
    merges, one K/V cat per pass, the fp32 dk/dv accumulations written into their send
    buffers; for `e` query and `k` key elements on this rank (cp > 1)."""
    merges = 10.0 * e * (cp - 1) - 4.0 * e  # 6 E at cp 2; 8 E + 10 E (cp - 3) + 8 E above
    fwd = 8.0 * k + merges
    bwd = 8.0 * k + 12.0 * k + 18.0 * k * (cp - 1) + 2.0 * e * (cp + 1) + 12.0 * k
    return fwd, bwd


def torch_ring_exposed(k: float, cp: int, group: comm.Group, fab: comm.Fabric,
                       first_fwd: float, first_bwd: float, rest_bwd: float,
                       interference: float) -> tuple[float, float]:
    """(forward, backward) exposed seconds of the ring's collectives (module docstring): the
    bf16 K/V all-gather beside the first call of each pass, and in the backward each fp32
    dk/dv send beside the next call's backward (`rest_bwd` spread over the cp - 1 later
    calls), the last one exposed."""
    gather = comm.all_gather(4.0 * k * cp, group, fab)
    send = comm.send(8.0 * k, group.nodes > 1, fab)
    per_call = rest_bwd / (cp - 1)
    fwd = overlapped(gather, first_fwd, interference)
    bwd = (overlapped(gather, first_bwd, interference)
           + (cp - 1) * overlapped(send, per_call, interference) + send)
    return fwd, bwd


def torch_ring_launches(cp: int) -> tuple[int, int, int, int]:
    """(forward ops, backward ops, forward collectives, backward collectives) the host issues
    per layer for torch's ring beyond the one SDPA kernel and its backward that every flash
    layer issues (elementwise.kernels_per_layer), counted from the code of the module
    docstring for the rank with full-query calls. The ring's backward is Python code run from
    the SDPA backward's handler, not autograd's C++ engine, so every op costs the host a
    forward launch (the caller prices them at `dispatch_s`).

    Forward: K/V `.contiguous()` (2); one `torch.cat` of K/V before each of cp - 1 rotations;
    cp - 1 more flash calls; per call `out.to(float32)` and `lse.to(float32)` (2 cp); per
    later call the merge, out - sigmoid(block_lse - lse) * (out - block_out) (5 ops) and
    lse - logsigmoid(lse - block_lse) (3 ops); `results()` casting the output back (1);
    collectives: one all-gather of K/V (`_AllGatherRotater`).
    Backward: fp32 zeros for dq, dk, dv (3); K/V `.contiguous()` (2); a K/V cat before each of
    cp - 1 rotations; cp - 1 more flash backward calls; the first call's three `+=` (3); per
    later call dk and dv through `_partial_update` (an add into the chunk and a `torch.cat`:
    2 each) and dq's `+=` (5); an fp32 cat of dk/dv before each of the cp sends; dq, dk, dv
    back to bf16 (3); collectives: the K/V all-gather and cp dk/dv sends (`_AllToAllRotater`).
    """
    later = cp - 1
    fwd = 2 + later + later + 2 * cp + 8 * later + 1
    bwd = 3 + 2 + later + later + 3 + 5 * later + cp + 3
    return fwd, bwd, 1, 1 + cp


def te_ring_bytes(e_q: float, e_o: float, k: float, cp: int) -> tuple[float, float]:
    """(forward, backward) HBM bytes per layer and rank of the memory-bound ops Transformer
    Engine's p2p ring runs around its flash calls (module docstring), for `e_q` query, `e_o`
    output and `k` key elements on this rank, bf16."""
    fwd = 8.0 * k + 2.0 * e_q + 6.0 * e_o * cp  # the zeros at q's shape (module docstring)
    bwd = (8.0 * k + 4.0 * e_q + 6.0 * e_q * (cp - 1) + 4.0 * k * (cp - 1) + 8.0 * k
           + 4.0 * k + 6.0 * k * (cp - 2) + 12.0 * k)
    return fwd, bwd


def te_ring_launches(cp: int) -> tuple[int, int, int, int]:
    """(forward ops, backward ops, forward collectives, backward collectives) the host issues
    per layer for Transformer Engine's p2p ring beyond the one attention kernel and its
    backward that every flash layer issues (elementwise.kernels_per_layer), counted from
    `AttnFuncWithCPAndKVP2P` (module docstring) for the last rank; its backward is the
    autograd Function's Python, so each op costs a forward launch (`ring_issue`).

    Forward: the K/V cat (1); cp - 1 more fused-attention calls; at the second step `out`'s
    zeros and the lse clone and its cast to double (3); an lse correction at each later step
    (cp - 2); the lse cast back to float (1); an output correction per step (cp);
    collectives: one p2p exchange before each of the cp - 1 later steps (batched at cp 2).
    Backward: the K/V copy into the send buffer (1); cp - 1 more fused-attention backward
    calls; per step dq's copy or add, the dk/dv cat and dkv's copy or add (3 cp);
    collectives: one p2p exchange per step (K/V, then K/V with dK/dV, the last dK/dV)."""
    later = cp - 1
    fwd = 1 + later + 3 + (cp - 2) + 1 + cp
    bwd = 1 + later + 3 * cp
    return fwd, bwd, later, cp
