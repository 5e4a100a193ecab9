"""The rehearsal's memory accounting: torch's memory tracker for a rank's model parts, blind
to DTensor's metadata-only sharding propagation, and its categories folded into the ones
compare.py sets beside the planner's (params, grads, optimizer, gathered, activations,
temporaries)."""

from __future__ import annotations

import sys

import torch


def _in_sharding_propagation(code) -> bool:
    """Whether the op being dispatched runs inside DTensor's sharding propagation (`code`):
    there it computes output metadata on global-shaped fake tensors in the active fake mode,
    ours, so torch's tracker would count tensors no rank ever holds (measured: 8 bytes per
    global logit under loss_parallel, i.e. tp times the local logits). Read off the stack:
    nothing of torch is patched."""
    frame = sys._getframe(2)
    for _ in range(48):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def without_propagation(cls):
    """torch's tracker class `cls`, blind to DTensor's metadata-only propagation ops, keeping
    the rank's peak only: torch's `_update_peak_stats` also updates the peak of every module
    it tracks that is running, walking all of them (a weak dictionary) after every op, a
    cost that grows with the layers (measured: 4.3 s of a 46 s 7-layer rehearsal; an
    80-layer rank did not finish in 10 minutes). The rank's peak is computed as torch's."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    from meshtron.rehearse.tracker_hooks import KeepingModTracker

    code = ShardingPropagator._propagate_tensor_meta_non_cached.__code__

    class Tracker(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # torch's module tracker, listing the hooks it leaves on a forward's graph, so a
            # micro-batch's graph can go after its backward (tracker_hooks.py)
            self._mod_tracker = KeepingModTracker()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _in_sharding_propagation(code):
                return func(*args, **(kwargs or {}))
            self._op = func  # named by `peak_at` if this op's outputs make the peak
            return super().__torch_dispatch__(func, types, args, kwargs)

        others: tuple = ()
        """(the rank's other stages, its first stage): their shards registered at every entry
        (`_other_stages`), as torch registers its root's."""

        def _register_module_and_optimizer_hooks(self) -> None:  # FSDPMemTracker's, on entry
            super()._register_module_and_optimizer_hooks()
            if self.others:
                _other_stages(self, *self.others)

        def _fsdp_state_pre_forward(self, fsdp_mod, orig):  # FSDPMemTracker's only
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def again(*args, **kwargs):
                # tied embeddings leave their parameter in the root unit (data_parallel.py
                # `_units`), so the root has a parameter group and torch's tracker watches
                # its forward, which it refuses to see twice ("multiple iterative calls"):
                # the root runs once per micro-batch. Its per-module statistics (unused here:
                # the rank's peak is kept in `_update_peak_stats`) start again instead.
                if fsdp_mod is self._root_mod and not self._mod_tracker.is_bw:
                    self.memory_tracking.pop(fsdp_mod, None)
                return inner(*args, **kwargs)

            return again

        host: tuple[tuple[str, ...], float] | None = None
        """With host offload: (tracker categories, constant bytes) held in host memory."""
        on_host = False
        """While set (the optimizer step of an offloaded rank, run on the host), the
        device's peak is not updated."""

        def _update_peak_stats(self, peak_state) -> None:
            if self.on_host:
                return
            for dev, snap in self._curr_mem_snap.items():
                value = snap[_TOTAL_KEY] - host_bytes(snap, self.host)
                if self._peak_mem.get(dev, 0) < value:
                    self._peak_mem[dev] = value
                    self._peak_mem_snap[dev] = dict(snap)
                    self._peak_where = (self._op, self._mod_tracker.is_bw,
                                        tuple(self._mod_tracker.parents))

        _op = None
        _peak_where: tuple = (None, False, ())

        def peak_at(self) -> str:
            """Where the peak was reached: forward or backward, the innermost module the
            module tracker had entered (the longest name; "Global" alone: outside every
            module, e.g. the loss or the optimizer's step) and the op whose outputs made it
            (the moment the planner prices, docs/measurements.md #gpipe-moments)."""
            op, backward, parents = self._peak_where
            inner = max(parents, key=len, default="")
            if inner in ("", "Global"):
                inner = "no module (Global: the loss, the optimizer's step)"
            return f"{'backward' if backward else 'forward'} of {inner}, {op}"

    return Tracker


def make_tracker(pm, optimizer):
    """torch's tracker for this rank's model parts. FSDPMemTracker follows one FSDP root and
    lets a module run once per micro-batch (MemTracker refuses a second call in a step): with
    several pipeline stages on the rank it follows the first, and the other stages' parameter
    shards and buffers, made before tracking starts, are registered with it here as what they
    are (`_other_stages`); everything they create during the step is tracked."""
    from torch.distributed.fsdp import FSDPModule

    parts = pm.model_parts
    if isinstance(parts[0], FSDPModule):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        for part in parts[1:]:  # FSDP2's first-forward set-up, which re-pads a padded
            # shard into a new storage (`FSDPParamGroup.lazy_init`: `reset_sharded_param`;
            # seen with fake tensors), before the shards are registered: as in a steady step
            part._get_fsdp_state()._lazy_init()
        tracker = without_propagation(FSDPMemTracker)(parts[0], optimizer)
        tracker.others = (parts[1:], parts[0])
        _other_stages(tracker, *tracker.others)
        return tracker
    if len(parts) > 1:
        from meshtron.errors import UserError

        raise UserError("rehearse: several pipeline stages per rank without FSDP (fp32, "
                        "dp=1) cannot be tracked on CPU; rehearse it on a GPU")
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = without_propagation(MemTracker)()
    tracker.track_external(*parts, optimizer)
    return tracker


def _other_stages(tracker, parts, exclude) -> None:
    """Register the parameter shards and buffers of `parts` (the rank's other pipeline
    stages) not in `exclude` with `tracker` as sharded parameters and buffers, as torch's
    tracker registers its root's (fsdp2_mem_tracker.py `_instrument_fsdp_sharded_params_grads`).
    Unregistered, the tracker meets them first as the outputs of AdamW's in-place foreach
    updates and files them as optimizer states for the rest of the process (its `_track`
    never re-files a storage), so adding their bytes apart counted them twice (measured on
    the 'mid' model, pp=2, zbv: 0.084 GiB on rank 1, 0.103 on rank 0). Registered again on
    every entry (`others`), as torch does for its root: FSDP2 may replace a padded shard's
    storage as it runs (with fake tensors the head's, which the tracker then met as an
    activation; with real ones not)."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    seen = {id(t) for t in list(exclude.parameters()) + list(exclude.buffers())}
    for part in parts:
        for kind, tensors in ((_FSDPRefType.SHARDED_PARAM, part.parameters()),
                              (_FSDPRefType.BUFFER, part.buffers())):
            for t in tensors:
                if id(t) not in seen:
                    seen.add(id(t))
                    tracker._update_and_maybe_create_winfos(t, kind)


_CATEGORY = {"Sharded Param": "params", "Parameter": "params", "Buffer": "params",
             "Sharded Grad": "grads", "Gradient": "grads", "Optstate": "optimizer",
             "OptState": "optimizer",  # FSDPMemTracker's spelling (MemTracker's above)
             "Unsharded Param": "gathered", "Unsharded Grad": "gathered",
             "All Gather": "gathered", "Reduce Scatter": "gathered",
             "Activation": "activations", "Inputs": "activations", "Temp": "temporaries"}


CATEGORIES = ("params", "grads", "optimizer", "gathered", "activations", "temporaries")

OFFLOADED = ("Sharded Param", "Sharded Grad")
"""FSDP2 tracker categories that plan.offload='full' keeps in host memory: CPUOffloadPolicy
leaves the parameter shards on the host and copies each reduced gradient shard back to it
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py `offload_to_cpu`, _fsdp_collectives.py
`foreach_reduce`: `new_sharded_grad.to(cpu)`); AdamW's states follow their parameters. The
buffers are moved to the device (_fsdp_init.py `_move_states_to_device`). On a CPU rehearsal
host and device are one device: the host's part is taken out by category."""


def host_bytes(snap: dict, host: tuple[tuple[str, ...], float] | None) -> float:
    """Bytes of one device's tracker snapshot `snap` that live in host memory (`host`: the
    categories there and constant bytes there, e.g. the optimizer states); 0 without
    offload."""
    if host is None:
        return 0.0
    names, const = host
    return const + sum(v for k, v in snap.items() if getattr(k, "value", k) in names)


def categories(snapshot: dict, host: tuple[str, ...] = ()) -> dict[str, float]:
    """Tracker categories (per device) folded into CATEGORIES, bytes; categories in `host`
    (held in host memory) left out of them and of the total."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    total = 0.0
    for dev_snap in snapshot.values():
        for key, value in dev_snap.items():
            name = getattr(key, "value", key)
            if name == "Total":
                total += value
            elif name in host:
                total -= value
            else:
                out[_CATEGORY.get(name, "temporaries")] += value
    out["total"] = total
    return out


def state_bytes(optimizer) -> float:
    """Bytes of the optimizer states this rank holds (local shards)."""
    from torch.distributed.tensor import DTensor

    total = 0.0
    for opt in optimizer.optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    v = v.to_local() if isinstance(v, DTensor) else v
                    total += v.numel() * v.element_size()
    return total

