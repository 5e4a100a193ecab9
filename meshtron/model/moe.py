"""Mixture-of-experts feed-forward: router, routed experts, shared experts; a plain nn.Module.

Routing (`Router`):
- 'softmax' (Mixtral, Jiang et al. 2024; Qwen3-MoE): softmax over all experts, top-k, the k
  weights renormalised to sum to 1 when `moe_norm_topk` (Mixtral always; Qwen3's
  `norm_topk_prob`).
- 'sigmoid' (DeepSeek-V3, Liu et al. 2024, section 2.1.2): sigmoid affinities; the experts are cut
  into `moe_groups` groups, a group's score is the sum of its two best biased affinities, a token
  routes only into its `moe_topk_groups` best groups (group-limited routing bounds the nodes a
  token reaches), then top-k inside them. The balancing bias only changes which experts are
  selected, never the weights (the affinities without bias, renormalised, times
  `moe_route_scale`); it is updated outside autograd by the sign rule b_i += gamma *
  sign(mean load - load_i) (auxiliary-loss-free balancing, Wang et al. 2024) by
  `update_router_bias`, once per optimizer step.

Load-balancing auxiliary loss (`moe_aux_loss` > 0): Switch Transformer's E * sum_i f_i P_i
(Fedus et al. 2022, eq. 4), with f_i the fraction of the T*k routed slots that go to expert i
(Megatron-Core's top-k normalisation: 1.0 at perfect balance). It enters the gradient through
`AuxLossInjector` (as Megatron-Core's `MoEAuxLossAutoScaler`): the layer's output is unchanged
and backward adds coefficient * d(aux)/d(router), so the training loop needs no change; its
value is in `last_stats`. With gradient accumulation over M micro-batches, set `aux_loss_scale`
to 1/M (the weight the loop gives each micro-batch's loss).

Experts (`GroupedExperts`): dropless, every token reaches its k experts (no capacity factor).
Tokens are sorted by expert; on CUDA in bf16, `torch._grouped_mm` runs all experts in one kernel
per matrix with the group offsets on the device (no host sync, as torchtitan's MoE); elsewhere
the exact fallback loops over experts with one matmul per contiguous slice
(`GroupedExperts.kernel` names the path; None chooses by device and dtype).

Token counts per expert (`MoE.counts_policy`): None (training) counts the router's choices on
the device (`expert_counts`). A policy (`StaticCounts`) gives them on the host instead, so every
tensor of the layer has a shape known before it runs: `meshtron rehearse` runs a rank under
fake tensors, which cannot size tensors by value (bincount's output, the per-expert slices and
the all-to-all splits). The router still runs (its memory and FLOPs are real); only which
expert a slot lands on is replaced, which changes no tensor's size beyond the counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.model.spec import ModelSpec

GROUPED_MM_ALIGN = 16
"""Rows per expert group are padded to this multiple for `torch._grouped_mm` (bf16 and fp8
kernels need 16-byte-aligned group offsets; torchtitan pads the same way)."""


class ExpertLinear(nn.Module):
    """The stacked weights [experts, out, in] of one projection of every routed expert (each
    expert an `nn.Linear` [out, in] slice; named `.weight` so checkpoints and init treat it as
    a linear layer)."""

    def __init__(self, experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))


class StaticCounts:
    """Tokens per expert fixed on the host (`MoE.counts_policy`): the mean T*k/E each, or with
    `imbalance` f > 1 the experts [hot[0], hot[1]) (an expert-parallel rank's: the rank a
    rehearsal runs) receive f times the mean and the others share the rest, so the rank
    holding them is the step's fullest one (the planner's `expert_imbalance`, max/mean load
    per ep rank). Every rank of a layer is assumed to route alike (the dispatcher's
    `_static_received`, meshtron/parallel/expert.py)."""

    def __init__(self, imbalance: float = 1.0, hot: tuple[int, int] | None = None):
        if not 1.0 <= imbalance:
            raise ValueError(f"imbalance={imbalance!r}: must be >= 1 (1: balanced)")
        self.imbalance, self.hot = float(imbalance), hot

    def __call__(self, slots: int, experts: int) -> list[int]:
        """Counts of `slots` routed slots (T*k) over `experts` experts; they sum to `slots`."""
        lo, hi = self.hot or (0, 0)
        n_hot = hi - lo
        if self.imbalance == 1.0 or not 0 < n_hot < experts:
            return _spread(slots, [1.0] * experts)
        hot_share = min(1.0, self.imbalance * n_hot / experts)
        cold = (1.0 - hot_share) / (experts - n_hot)
        return _spread(slots, [hot_share / n_hot if lo <= e < hi else cold
                               for e in range(experts)])


def _spread(total: int, weights: list[float]) -> list[int]:
    """Integers proportional to `weights` summing to `total` (largest remainders)."""
    norm = sum(weights)
    exact = [total * w / norm for w in weights]
    out = [int(x) for x in exact]
    rest = sorted(range(len(out)), key=lambda i: out[i] - exact[i])[:total - sum(out)]
    for i in rest:
        out[i] += 1
    return out


class GroupedExperts(nn.Module):
    """`experts` SwiGLU experts applied to tokens already sorted by expert."""

    kernel: str | None = None
    """'grouped' (`torch._grouped_mm`), 'loop' (one matmul per expert), None: grouped on CUDA
    in bf16 where torch has it, else loop. A rehearsal on CPU sets 'grouped' to run (under
    fake tensors) the kernel a GPU run uses."""

    grad_scale: float = 1.0
    """Factor on the gradient reaching the weights (expert parallelism under FSDP: 1/ep, as the
    experts' gradients sum the tokens of ep ranks; meshtron/parallel/expert.py)."""

    def __init__(self, experts: int, hidden: int, width: int):
        super().__init__()
        self.num_experts = experts
        self.w1 = ExpertLinear(experts, hidden, width)
        self.w3 = ExpertLinear(experts, hidden, width)
        self.w2 = ExpertLinear(experts, width, hidden)

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                host_counts: list[int] | None = None) -> torch.Tensor:
        """x [tokens, hidden] sorted by expert; counts [experts] tokens per expert (sum = rows of
        x) -> [tokens, hidden]. `host_counts`: the same counts known on the host (a
        `StaticCounts` policy), read instead of `counts`."""
        w1, w2, w3 = (_local(lin.weight) for lin in (self.w1, self.w2, self.w3))
        if self.grad_scale != 1.0:
            w1, w2, w3 = (ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        kernel = self.kernel
        if kernel is None:
            kernel = "grouped" if (x.is_cuda and x.dtype == torch.bfloat16
                                   and hasattr(torch, "_grouped_mm")) else "loop"
        if kernel == "grouped":
            return _grouped_mm_swiglu(x, counts, w1, w2, w3)
        out = torch.empty_like(x)
        start = 0
        # CPU / fp32 reference path: one host read of the counts, per-expert matmuls on
        # contiguous slices (exact: the same products as a dense matmul per expert).
        for e, n in enumerate(counts.tolist() if host_counts is None else host_counts):
            if n:
                xe = x[start:start + n]
                out[start:start + n] = (F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())) @ w2[e].t()
            start += n
        if not start:
            # No token reached these experts (under expert parallelism: no rank routed any to
            # this rank's experts, e.g. a pipeline's shape inference on uninitialized inputs,
            # or a collapsed router). The output must still hang off `x` and the weights:
            # autograd runs the dispatch all-to-all's backward, and FSDP2 the experts'
            # reduce-scatter, only where the graph reaches them, and every ep / FSDP rank must
            # join those collectives (else the other ranks hang in them). `x` has 0 rows here.
            out = x * 0 + (w1.sum() + w2.sum() + w3.sum()) * 0
        return out


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale` (inside the graph, so it
    holds for the unsharded parameters FSDP2 computes with, where a hook on the sharded
    parameter would not run)."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts: under expert parallelism the weights are DTensors sharded on the
    expert dimension (meshtron/parallel/expert.py); `to_local` is differentiable."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def expert_counts(slot_expert: torch.Tensor, experts: int) -> torch.Tensor:
    """Tokens per expert [experts] (int64) on the device. Not `torch.bincount`: on CUDA it
    reads the input's maximum on the host to size its output (one sync per MoE layer and
    micro-batch); a scatter-add into a fixed-size buffer needs no host read, and integer
    atomics keep it exact and deterministic."""
    return slot_expert.new_zeros(experts).scatter_add_(0, slot_expert,
                                                       torch.ones_like(slot_expert))


def _grouped_mm_swiglu(x, counts, w1, w2, w3):
    """All experts in one `torch._grouped_mm` per matrix: each group padded to
    GROUPED_MM_ALIGN rows with device-side index math, so the host never reads the counts."""
    experts = counts.numel()
    padded = (counts + GROUPED_MM_ALIGN - 1) // GROUPED_MM_ALIGN * GROUPED_MM_ALIGN
    padded = torch.where(counts == 0, GROUPED_MM_ALIGN, padded)  # empty groups: keep offsets valid
    ends = padded.cumsum(0)
    starts = ends - padded
    src_starts = counts.cumsum(0) - counts
    # Row i of x (expert e, rank j inside it) goes to padded row starts[e] + j. The padded buffer
    # has a static upper bound of rows, so its size needs no host sync either.
    expert_of = torch.repeat_interleave(torch.arange(experts, device=x.device), counts,
                                        output_size=x.shape[0])
    rank_in = torch.arange(x.shape[0], device=x.device) - src_starts[expert_of]
    dest = starts[expert_of] + rank_in
    bound = x.shape[0] + experts * GROUPED_MM_ALIGN
    buf = x.new_zeros(bound, x.shape[1]).index_copy(0, dest, x)
    offs = ends.to(torch.int32)
    h = F.silu(torch._grouped_mm(buf, w1.transpose(-2, -1), offs=offs)) \
        * torch._grouped_mm(buf, w3.transpose(-2, -1), offs=offs)
    out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    return out.index_select(0, dest)


class SharedExperts(nn.Module):
    """The shared experts of DeepSeek-MoE as one SwiGLU of width shared * expert width;
    `gated`: its output times sigmoid(x . w) per token (Qwen2-MoE `shared_expert_gate`, a
    [1, hidden] linear layer without bias)."""

    def __init__(self, hidden: int, width: int, gated: bool = False):
        super().__init__()
        self.w1 = nn.Linear(hidden, width, bias=False)
        self.w3 = nn.Linear(hidden, width, bias=False)
        self.w2 = nn.Linear(width, hidden, bias=False)
        self.gate = nn.Linear(hidden, 1, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out if self.gate is None else out * torch.sigmoid(self.gate(x))


@dataclass
class Routing:
    """One layer's routing of T tokens."""

    weights: torch.Tensor
    """[T, k] the weights of the selected experts (what multiplies their outputs)."""
    experts: torch.Tensor
    """[T, k] the selected expert ids."""
    probs: torch.Tensor
    """[T, E] the router's affinities (softmax or sigmoid), for the auxiliary loss."""


class Router(nn.Module):
    """Token-to-expert routing (see the module docstring)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.gate = nn.Linear(spec.hidden, spec.moe_experts, bias=False)
        # Balancing bias (DeepSeek-V3): state, not trained by the optimizer (no gradient ever
        # reaches it); a Parameter so FSDP, DCP and the deterministic init (zeros: its name
        # ends in "bias") handle it like the rest of the model.
        self.expert_bias = (nn.Parameter(torch.empty(spec.moe_experts), requires_grad=False)
                            if spec.moe_router == "sigmoid" else None)

    def forward(self, x: torch.Tensor) -> Routing:
        spec = self.spec
        logits = self.gate(x).float()  # routing in fp32, as Megatron-Core and DeepSeek do
        if spec.moe_router == "softmax":
            probs = logits.softmax(dim=-1)
            weights, experts = probs.topk(spec.moe_top_k, dim=-1)
        else:
            probs = logits.sigmoid()
            choice = probs.detach() + self.expert_bias.float()
            if spec.moe_groups > 1:
                choice = _limit_groups(choice, spec.moe_groups, spec.moe_topk_groups)
            experts = choice.topk(spec.moe_top_k, dim=-1).indices
            weights = probs.gather(-1, experts)
        if spec.moe_norm_topk and spec.moe_top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(weights * spec.moe_route_scale, experts, probs)


def _limit_groups(choice: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: a group's score is the sum of its two best
    scores; experts outside the `keep` best groups get -inf."""
    t, e = choice.shape
    grouped = choice.view(t, groups, e // groups)
    score = grouped.topk(min(2, e // groups), dim=-1).values.sum(dim=-1)
    best = score.topk(keep, dim=-1).indices
    mask = torch.ones(t, groups, dtype=torch.bool, device=choice.device).scatter_(1, best, False)
    return grouped.masked_fill(mask[:, :, None], float("-inf")).view(t, e)


class AuxLossInjector(torch.autograd.Function):
    """Identity on `out`; backward also sends gradient `scale` into `aux` (so aux * scale is
    part of the training objective without the loop adding it to the loss)."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def aux_loss(routing: Routing, counts: torch.Tensor, experts: int, top_k: int,
             total_tokens: int | None = None) -> torch.Tensor:
    """Switch load-balancing loss E * sum_i f_i P_i with f_i = counts_i / (T k); `counts`
    and `total_tokens` may be global (summed over ranks that route their own tokens), then
    the probabilities are this rank's part of the global mean (the ranks' terms sum to it)."""
    tokens = routing.probs.shape[0] if total_tokens is None else total_tokens
    f = counts.float() / (tokens * top_k)
    p = routing.probs.sum(dim=0) / tokens
    return experts * (f.detach() * p).sum()


class MoE(nn.Module):
    """The MoE feed-forward of one block: x [batch, seq, hidden] -> same shape."""

    aux_loss_scale: float = 1.0
    """Extra factor on the auxiliary loss's gradient (expert parallelism: x ep, expert.py)."""

    accum_scale: float = 1.0
    """The micro-batch's share of the step (1/M for M accumulated micro-batches, as its loss
    is weighted; set by the training loop, meshtron/train/router.py)."""

    count_load: bool = True
    """Count this forward's tokens into `load_since_update` (off while the pipeline schedule
    infers tensor shapes, meshtron/parallel/pipeline.py)."""

    counts_policy = None
    """None: tokens per expert counted from the router's choices (training). A `StaticCounts`:
    fixed on the host (a rehearsal under fake tensors; module docstring)."""

    dispatcher = None
    """Set by `meshtron.parallel.expert.apply_expert_parallel`: sends the sorted tokens to the
    ranks holding their experts and back (None: all experts are local)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.router = Router(spec)
        self.experts = GroupedExperts(spec.moe_experts, spec.hidden, spec.moe_ffn_hidden)
        self.shared = (SharedExperts(spec.hidden, spec.moe_shared_experts * spec.moe_ffn_hidden,
                                     spec.moe_shared_gate)
                       if spec.moe_shared_experts else None)
        self.last_stats: dict[str, torch.Tensor] = {}
        # Counts since the last bias update; created on the first forward (on the device of
        # the counts), so building on meta and materializing needs nothing extra.
        self.load_since_update: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat)
        k = spec.moe_top_k
        slot_expert = routing.experts.reshape(-1)  # [T*k]
        # Stable sort: the tokens of an expert keep their order (equal on every layout).
        order = slot_expert.argsort(stable=True)
        host = None
        if self.counts_policy is None:
            counts = expert_counts(slot_expert, spec.moe_experts)
        else:  # shapes known before the layer runs (module docstring)
            host = self.counts_policy(slot_expert.shape[0], spec.moe_experts)
            counts = torch.tensor(host, device=flat.device)
        tokens = flat.index_select(0, order // k)
        if self.dispatcher is None:
            out_sorted = self.experts(tokens, counts, host)
            global_counts, total = counts, None
        else:
            out_sorted, global_counts = self.dispatcher(self.experts, tokens, counts, host)
            total = flat.shape[0] * self.dispatcher.token_ranks
        # Combine: weight each slot's output and sum the k slots of every token.
        weights = routing.weights.reshape(-1).index_select(0, order).to(out_sorted.dtype)
        out = torch.zeros_like(flat).index_add_(0, order // k, out_sorted * weights[:, None])
        if self.shared is not None:
            out = out + self.shared(flat)
        self._record(global_counts)
        if spec.moe_aux_loss > 0 and self.training and torch.is_grad_enabled():
            aux = aux_loss(routing, global_counts, spec.moe_experts, k, total)
            self.last_stats["aux_loss"] = aux.detach()
            out = AuxLossInjector.apply(out, aux, spec.moe_aux_loss * self.aux_loss_scale
                                      * self.accum_scale)
        return out.view(shape)

    @torch.no_grad()
    def _record(self, counts: torch.Tensor) -> None:
        """Router statistics on the device (no host sync): load per expert, imbalance (max /
        mean load), dropped tokens (0 by construction: dropless)."""
        load = counts.float()
        if self.load_since_update is None:
            self.load_since_update = torch.zeros_like(load)
        if self.training and self.count_load:  # evaluation tokens do not steer the bias
            self.load_since_update += load
        self.last_stats = {"load": load, "imbalance": load.max() / load.mean().clamp_min(1e-9),
                           "dropped": torch.zeros((), device=load.device)}


@torch.no_grad()
def update_router_bias(model: nn.Module, reduce=None) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing step, once per optimizer step: every sigmoid
    router's bias moves by gamma * sign(mean load - load) on the load counted since the last
    update. `reduce(tensor)`: sums the counts over the data ranks (every rank must apply the
    same update); None in one process. The sign rule does not care if recomputation counted a
    forward twice (all loads double)."""
    for module in model.modules():
        if (isinstance(module, MoE) and module.router.expert_bias is not None
                and module.load_since_update is not None):
            load = module.load_since_update
            if reduce is not None:
                reduce(load)
            gamma = module.spec.moe_bias_update
            step = (load.mean() - load).sign()
            bias = module.router.expert_bias
            if hasattr(bias, "to_local"):  # sharded by FSDP: update this rank's rows only
                from meshtron.model.init import local_box

                _, offset, shape = local_box(bias)
                bias, step = bias.to_local(), step[offset[0]:offset[0] + shape[0]]
            bias.add_(step.to(bias.dtype), alpha=gamma)
            load.zero_()


def router_stats(model: nn.Module) -> dict[str, float]:
    """Mean router statistics over the MoE layers of `model` (reads the device: call at logging
    points only): imbalance, dropped tokens, auxiliary loss."""
    layers = [m.last_stats for m in model.modules() if isinstance(m, MoE) and m.last_stats]
    if not layers:
        return {}
    out = {"moe_imbalance": float(torch.stack([s["imbalance"] for s in layers]).mean()),
           "moe_dropped": float(sum(float(s["dropped"]) for s in layers))}
    if all("aux_loss" in s for s in layers):
        out["moe_aux_loss"] = float(torch.stack([s["aux_loss"] for s in layers]).mean())
    out["moe_load"] = torch.stack([s["load"] for s in layers]).sum(0).tolist()
    return out
