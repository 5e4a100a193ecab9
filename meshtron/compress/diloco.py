"""DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models", Algorithm 1): data-parallel replicas that synchronise every H steps.

Each replica (one index on the mesh's "dp_replicate" axis: all of dp with ZeRO-0; with ZeRO-2/3
and dp_replicate > 1, a group of dp_shard ranks that shard the replica with FSDP2 among
themselves; tensor and pipeline parallelism stay inside a replica) takes H inner optimizer steps
on its own data with no gradient exchange across replicas. Then the outer gradient
Delta = theta_global - theta_replica is averaged over the replicas (optionally compressed:
plan.grad_compression, with error feedback) and applied to theta_global by SGD with Nesterov
momentum; every replica restarts from the new theta_global. The inner optimizer keeps its
state across rounds, as in the paper.

Outer settings (`outer_settings`; plan.outer_lr / outer_momentum override them). The paper's
outer lr 0.7 with Nesterov 0.9 was tuned for H = 500 on a model pretrained for 24k steps. With
a steady outer gradient d, Nesterov's step tends to lr * d / (1 - mu) = 7 d: at small H, early
in training, the outer step extrapolates seven rounds of progress and overshoots. Measured here
(tiny, dp=2, 64 x 16 tokens, AdamW 2e-3 with warm-up 20, the mean loss of the last 5 of 60
steps; data parallelism 2.697): H=4 0.7/0.9 3.249 (+20%), 0.7/0.5 2.882, 1.0/0 2.649 (-2%);
H=16 0.7/0.9 2.830 (+5%), 1.0/0 2.737 (+1.5%); over 192 steps (DP 1.949) H=32 0.7/0.9 2.304,
1.0/0 2.178; H=64 2.248 vs 2.159. Twenty synchronous warm-up steps before the first round did
not help (H=4 3.095, H=16 2.857). So below the paper's H the default is lr 1, no momentum:
theta_global becomes the replicas' mean (parameter averaging, local SGD: Stich 2019, Lin et al.
2020), which equals data-parallel SGD at H = 1; from H = 500 on, the paper's 0.7 / 0.9.

Traffic: one all-reduce of the parameters every H steps instead of one of the gradients every
step (H times less; int8 another ~4x).

With H = 1, outer lr 1 and no momentum, theta_global - mean(Delta) = mean of the replicas'
parameters after one inner step, which for a plain SGD inner optimizer is exactly data-parallel
SGD (tests/test_compress_dist.py checks it).

`DiLoCo` is a Stateful: its `state_dict()` holds theta_global, the outer momentum (each laid out
like its parameter: DTensors reshard) and the number of inner steps taken, plus the outer
reduction's error-feedback residual twice, as meshtron/compress/runtime.py keeps the gradients'
(each rank's own, restored on the same layout: bit for bit; and the replicas' mean per
parameter, restored after a layout change).
"""

from __future__ import annotations

from typing import Any

import torch

from meshtron.compress.quant import Codec
from meshtron.compress.runtime import (_as_param_layout, _local, load_own_entries, own_entries,
                                       topology)
from meshtron.compress.collectives import Reducer
from meshtron.planner.compression import PAPER_H, outer_settings  # noqa: F401 (re-exported)

PREFIX = "diloco."


class DiLoCo:
    """The outer loop of DiLoCo over a ParallelModel's replicas (see module doc). Call
    `after_inner_step()` after every inner optimizer step (the training engine does, as an
    engine feature: meshtron/train/features.py)."""

    name = "compress"
    """Its checkpoint key (saved checkpoints use it)."""

    def __init__(self, pm, plan, last_step: int | None = None):
        from meshtron.model.init import clean_name

        self.pm = pm
        self.inner_steps = plan.diloco
        self.lr, self.momentum = outer_settings(plan)
        self.reducer = Reducer(topology(pm.mesh, "dp_replicate", plan),
                               Codec(plan.grad_compression, plan.grad_compression_block))
        self.replicas = self.reducer.topo.size
        self.named = [(clean_name(n), p) for part in pm.model_parts
                      for n, p in part.named_parameters() if p.requires_grad]
        with torch.no_grad():
            self.global_params = [_local(p).detach().float().clone() for _, p in self.named]
        # no buffer without momentum (the default below the paper's H): 4 B per local parameter
        # of memory that the update never reads (planner/memory_compress.py counts the same)
        self.momentum_bufs = [torch.zeros_like(g) if self.momentum > 0 else None
                              for g in self.global_params]
        self.step = 0
        """Inner steps taken so far (a sync happens when it reaches a multiple of H)."""
        self.syncs = 0
        """Outer syncs this process took (the final partial round's included)."""
        self.last_step = last_step
        """The run's last step: a round cut short there still syncs (`after_inner_step`)."""

    def after_inner_step(self) -> bool:
        """Count one inner step; every H-th, and at the run's last step, synchronise the
        replicas. True when it synced.

        The last step: DiLoCo's output is the outer model theta after an outer step (Douillard
        et al. 2023, Algorithm 1 returns theta^(T)); a run whose step count is not a multiple of
        H ends with a shorter round synced like the others, so the final evaluation, the last
        checkpoint and `--export` hold the one synced model every replica holds (no replica's
        last steps are lost). torchft's DiLoCo (torchft/local_sgd.py `DiLoCo.__exit__`, commit
        73dafea) only removes its hooks: the caller's model keeps the replica's unsynced weights,
        which is what this avoids."""
        self.step += 1
        if self.step % self.inner_steps and self.step != self.last_step:
            return False
        self.sync()
        return True

    def after_optimizer_step(self) -> None:
        self.after_inner_step()

    @torch.no_grad()
    def sync(self) -> None:
        """Average the outer gradient over the replicas and take one outer Nesterov step."""
        locals_ = [_local(p) for _, p in self.named]
        delta = torch.cat([(g - t.float()).reshape(-1)
                           for g, t in zip(self.global_params, locals_)])
        delta = self.reducer.all_reduce(delta, key="outer") / self.replicas
        offset = 0
        for g, buf, t in zip(self.global_params, self.momentum_bufs, locals_):
            d = delta[offset:offset + g.numel()].view_as(g)
            offset += g.numel()
            if self.momentum > 0:  # torch.optim.SGD(nesterov=True): v = mu v + d; d + mu v
                buf.mul_(self.momentum).add_(d)
                d = d.add(buf, alpha=self.momentum)
            g.sub_(d, alpha=self.lr)
            t.copy_(g.to(t.dtype))
        self.syncs += 1

    def held_tensors(self) -> list[torch.Tensor]:
        """What this outer loop keeps on the device: theta_global, and the momentum if any."""
        return self.global_params + [b for b in self.momentum_bufs if b is not None]

    def release(self) -> None:
        """Destroy the hierarchical subgroups (before the mesh is released)."""
        self.reducer.topo.release()

    # ---- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """theta_global, momentum (with outer momentum > 0) and mean residual per parameter,
        this rank's own residual,
        and the inner step count. A collective over the replicas (the residual's mean): every
        rank calls it."""
        out: dict[str, Any] = {PREFIX + "step": torch.tensor(self.step, dtype=torch.int64)}
        numel = sum(g.numel() for g in self.global_params)
        out.update(own_entries(self.reducer, self._buckets(), self.global_params[0].device))
        residual = self.reducer.mean_residual("outer", numel, "all_reduce",
                                              self.global_params[0].device)
        offset = 0
        for (name, p), g, buf in zip(self.named, self.global_params, self.momentum_bufs):
            r = residual[offset:offset + g.numel()].view_as(g).clone()
            offset += g.numel()
            out[f"{PREFIX}global.{name}"] = _as_param_layout(p, g)
            if buf is not None:  # plan.outer_momentum is kept on resume (resume_fields)
                out[f"{PREFIX}momentum.{name}"] = _as_param_layout(p, buf)
            out[f"{PREFIX}residual.{name}"] = _as_param_layout(p, r)
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from `state_dict()` (after `dcp.load` into it), for this layout: the
        residual is this rank's own when the template kept it (same layout), else the mean."""
        self.step = int(state_dict[PREFIX + "step"])
        self.syncs = self.step // self.inner_steps  # the rounds completed before the save
        pieces = []
        for (name, _), g, buf in zip(self.named, self.global_params, self.momentum_bufs):
            g.copy_(_local(state_dict[f"{PREFIX}global.{name}"]))
            if buf is not None:
                buf.copy_(_local(state_dict[f"{PREFIX}momentum.{name}"]))
            pieces.append(_local(state_dict[f"{PREFIX}residual.{name}"]).reshape(-1).float())
        if not load_own_entries(self.reducer, self._buckets(), state_dict):
            self.reducer.load_mean_residual("outer", torch.cat(pieces), "all_reduce")

    def _buckets(self) -> list[tuple[str, int, str]]:
        """The outer reduction's one residual bucket: (key, elements, layout)."""
        return [("outer", sum(g.numel() for g in self.global_params), "all_reduce")]


def attach(pm, plan, last_step: int | None = None) -> DiLoCo | None:
    """A DiLoCo outer loop for `pm` when plan.diloco > 0 (`last_step`: the run's, synced even
    mid-round; None: only every H steps)."""
    return DiLoCo(pm, plan, last_step) if plan.diloco > 0 else None
