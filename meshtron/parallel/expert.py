"""Expert parallelism: the routed experts of every MoE layer sharded over an `ep` mesh dimension.

Layout (GShard, Lepikhin et al. 2020; as torchtitan and Megatron-Core fold it): the ep ranks are
data ranks too. Each rank routes its own tokens; rank r holds experts [r*E/ep, (r+1)*E/ep) as
`DTensor`s sharded on dim 0 over the ep mesh (`Shard(0)`), so the deterministic init, the
Hugging Face reader (each rank reads only its experts' tensors) and DCP see the global shapes.
The router, shared experts, attention and embeddings stay replicated over ep (FSDP shards them
over the data ranks in a full run).

One MoE layer's forward on a rank (`ExpertParallel.__call__`), tokens already sorted by expert:
1. a small all-to-all of the per-expert counts ([ep, E/ep] int64): how many tokens every rank
   sends to each of my experts;
2. dispatch: `all_to_all_single` with uneven splits (the only host read of the step's layer:
   the split sizes, as torchtitan's token dispatcher does);
3. the received tokens (ordered by source rank, then expert) regrouped by local expert, the
   local experts applied (grouped GEMM on CUDA), and put back in arrival order;
4. combine: the reverse all-to-all; then the caller weights and sums each token's k outputs;
5. the global per-expert counts (an all-reduce of the counts over the ep group: the same on
   every rank) for the auxiliary loss and the balancing bias.
Backward runs the two token all-to-alls in reverse (the autograd of `all_to_all_single`).
From a plan (`parallelize` with plan.ep > 1, ExpertParallel(global_counts=False)) step 5 is
skipped: the auxiliary loss and router statistics use this rank's counts, and per MoE layer
and micro-batch the ep group sees 1 counts all-to-all (E int64) + 4 token all-to-alls of
T*k*hidden elements on average (tests/test_ep_collectives.py checks that contract).

Gradient convention (what the test checks against one process on the union of the ranks'
data): each rank back-propagates its share of the global mean loss (local mean / ep); the
gradients of replicated parameters are then summed over the ep group (with FSDP over
dp_shard x ep that is its reduce-scatter); the experts' gradients already hold every rank's
tokens and are not reduced over ep. The auxiliary loss is computed from global counts with
this rank's probabilities over the global token count, so the ranks' terms sum to the global
loss under the same convention.
"""

from __future__ import annotations

from typing import Any

import torch

from meshtron.errors import UserError


def check_expert_parallel(experts: int, ep: int) -> None:
    if ep < 1 or experts % ep:
        raise UserError(f"ep={ep}: expert parallelism must divide model.moe_experts={experts} "
                         "(every rank holds the same number of experts)")


class ExpertParallel:
    """The token dispatcher of expert parallelism over a 1-D ep DeviceMesh; set as
    `MoE.dispatcher` by `apply_expert_parallel`."""

    def __init__(self, mesh, experts: int, global_counts: bool = True):
        self.mesh = mesh
        self.group = mesh.get_group()
        self.ep = mesh.size()
        self.rank = mesh.get_local_rank()
        self.local = experts // self.ep
        self.global_counts = global_counts
        """Return the per-expert counts summed over the ep group (one all-reduce per layer),
        else this rank's own counts (the training runtime: auxiliary loss, statistics and the
        balancing load per micro-batch of this rank, exactly as one process computes them on
        the same micro-batch)."""

    @property
    def token_ranks(self) -> int:
        """Ranks whose tokens one layer's counts sum over (for the global token count)."""
        return self.ep if self.global_counts else 1

    def __call__(self, experts: torch.nn.Module, tokens: torch.Tensor, counts: torch.Tensor,
                 host_counts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(outputs in `tokens`' order, global per-expert counts). `host_counts`: the counts
        fixed on the host by the layer's `StaticCounts` policy (a rehearsal): the splits and
        what arrives come from it instead of the device (the counts all-to-all still runs)."""
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep, local = self.ep, self.local
        send = counts.view(ep, local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)
        if host_counts is None:
            # The split sizes must be known on the host to size the buffers: one read per layer
            # (both directions in one copy; two `tolist()` would wait for the device twice).
            in_splits, out_splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()
            rows = None
        else:
            rows = _static_received(host_counts, self.rank, ep)
            recv = torch.tensor(rows, device=counts.device, dtype=counts.dtype)
            in_splits = [sum(host_counts[r * local:(r + 1) * local]) for r in range(ep)]
            out_splits = [sum(r) for r in rows]
        arrived = all_to_all_single_autograd(tokens.contiguous(), out_splits, in_splits,
                                             self.group)
        # Arrival order is (source rank, local expert); the experts need (expert, source).
        segments = torch.repeat_interleave(torch.arange(ep * local, device=tokens.device),
                                           recv.reshape(-1), output_size=arrived.shape[0])
        key = (segments % local) * ep + segments // local
        order = key.argsort(stable=True)
        mine = None if rows is None else [sum(col) for col in zip(*rows)]
        out_local = experts(arrived.index_select(0, order), recv.sum(0), mine)
        back = torch.empty_like(out_local).index_copy(0, order, out_local)
        out = all_to_all_single_autograd(back, in_splits, out_splits, self.group)
        if not self.global_counts:
            return out, counts
        global_counts = counts.clone()
        dist.all_reduce(global_counts, group=self.group)
        return out, global_counts


def _static_received(host_counts: list[int], rank: int, ep: int) -> list[list[int]]:
    """[source rank][local expert] rows `rank` receives when every rank routes as
    `host_counts` says (meshtron.model.moe.StaticCounts: the ranks route alike)."""
    local = len(host_counts) // ep
    mine = host_counts[rank * local:(rank + 1) * local]
    return [list(mine) for _ in range(ep)]


def apply_expert_parallel(model: Any, mesh, average_grads: bool = False,
                          global_counts: bool = True) -> ExpertParallel:
    """Shard the routed experts of every MoE layer of `model` over the 1-D DeviceMesh `mesh`
    (rank r keeps experts r*E/ep .. (r+1)*E/ep - 1 as DTensor Shard(0) parameters; a meta model
    stays on meta, to be materialized shard-locally by `meshtron.model.init.materialize`) and
    route tokens through all-to-alls.

    `average_grads`: the convention of FSDP/DDP over the same ranks (each rank back-propagates
    its local mean loss; replicated gradients are averaged): the experts' gradients, which sum
    every rank's tokens, are then divided by ep (a gradient hook), and each rank's auxiliary
    loss term is injected ep times (its share of the global loss, averaged). Without it, the
    module docstring's convention (local mean / ep, replicated gradients summed).

    `global_counts=False` (`parallelize` from a plan): the auxiliary loss and router statistics
    use each rank's own counts (ExpertParallel.global_counts), no counts all-reduce; the
    experts' gradients are scaled by 1/ep inside the graph (`GroupedExperts.grad_scale`) and
    FSDP2 averages them over the data ranks outside ep (meshtron/parallel/data_parallel.py):
    together 1/(dp x cp), the data ranks' mean. `average_grads` must then stay False."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Shard

    from meshtron.model.moe import MoE

    spec = model.spec
    if not spec.is_moe:
        raise UserError(f"model={spec.name!r}: expert parallelism needs a mixture-of-experts "
                         "model (model.moe_experts > 0)")
    check_expert_parallel(spec.moe_experts, mesh.size())
    dispatcher = ExpertParallel(mesh, spec.moe_experts, global_counts)
    lo = dispatcher.rank * dispatcher.local
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        for lin in (module.experts.w1, module.experts.w2, module.experts.w3):
            full = lin.weight.detach()
            part = full[lo:lo + dispatcher.local].clone()
            lin.weight = nn.Parameter(DTensor.from_local(part, mesh, [Shard(0)],
                                                         run_check=False,
                                                         shape=full.shape,
                                                         stride=full.stride()))
            if average_grads:
                lin.weight.register_hook(lambda g, ep=dispatcher.ep: g / ep)
        module.experts.num_experts = dispatcher.local
        if not global_counts:  # FSDP averages over the data ranks outside ep (data_parallel.py)
            module.experts.grad_scale = 1.0 / dispatcher.ep
        module.dispatcher = dispatcher
        if average_grads and global_counts:
            module.aux_loss_scale *= dispatcher.ep
    return dispatcher
