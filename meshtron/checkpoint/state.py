"""What a checkpoint holds, taken from and given back to a training engine.

Tensors go through torch.distributed.checkpoint (DCP), keyed by the plain model's parameter
names, so they reshard to any layout on load:

- "model.<fqn>": parameters (DTensor shards under FSDP2 / tensor parallelism; each pipeline
  stage saves its own names);
- "optim.state.<fqn>.<name>": AdamW moments and step counters, flattened (DCP's
  `flatten_optimizer_state_dict`), so ZeRO-1 shards and pipeline stages with different
  parameters save disjoint keys;
- "<name>.<key>": each extra `Stateful` the trainer registers (e.g. error-feedback residuals, an
  outer optimizer): its `state_dict()` must hold tensors only (DTensors, or plain tensors equal
  on every rank that holds the key).

DiLoCo replicas train alone between synchronisations: inside a round their parameters differ,
and their inner optimizers' moments always do, while their keys are the same. DCP would keep one
rank's copy of each key, chosen per key to balance the writes, i.e. a mix of replicas (an
exp_avg of one replica beside the exp_avg_sq of another: updates of hundreds on rows one replica
never saw). Under DiLoCo replica r > 0 therefore writes its model and optimizer under
"replica_<r>." (replica 0 keeps the plain keys, which export and resharding read); meta.json's
"replica_states" says how many replicas were saved.

The optimizer's hyper-parameter groups ("optim.param_groups.*") are not saved: they come from the
run config, and the learning rate from the schedule position, which keeps pickled Python
objects out of the tensor files. Everything else is JSON: meta.json (step, data-sampler position,
LR-schedule position, plan, run config) and one rank_<r>.json per rank (its RNG states).
"""

from __future__ import annotations

import base64
import json
import warnings
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from meshtron.checkpoint import store

_GROUP_PREFIX = "param_groups."
REPLICA_PREFIX = "replica_"


def replica_of(engine: Any) -> tuple[int, int]:
    """(index, count) of this rank's DiLoCo replica (the mesh's "dp_replicate" axis, as
    meshtron.compress.diloco reduces over it); (0, 1) when the replicas never diverge."""
    diloco = getattr(engine, "diloco", None)
    if diloco is None or diloco.replicas <= 1:
        return 0, 1
    return engine.mesh["dp_replicate"].get_local_rank(), diloco.replicas


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class EngineState:
    """The model and optimizer of a training engine (the single-process `LocalEngine` or the
    parallel `ParallelEngine`), as DCP state dicts with plain-model keys."""

    def __init__(self, engine: Any):
        self.engine = engine
        if hasattr(engine, "pm"):  # ParallelModel + ParallelOptimizer: DCP-ready already
            self.model_sd: Callable[[], dict] = engine.pm.state_dict
            self.load_model: Callable[[dict], None] = engine.pm.load_state_dict
            self.optim_sd: Callable[[], dict] = engine.optimizer.state_dict
            self.load_optim: Callable[[dict], None] = engine.optimizer.load_state_dict
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            model, opt = engine.model, engine.optimizer
            flat = StateDictOptions(flatten_optimizer_state_dict=True)
            self.model_sd = lambda: get_model_state_dict(model)
            self.load_model = lambda sd: set_model_state_dict(model, sd)
            self.optim_sd = lambda: get_optimizer_state_dict(model, opt, options=flat)
            self.load_optim = lambda sd: set_optimizer_state_dict(model, opt, sd, options=flat)
        self.extras: dict[str, Stateful] = dict(getattr(engine, "checkpoint_extras", {}) or {})
        self.replica, self.replicas = replica_of(engine)
        """This rank's DiLoCo replica and the replica count ((0, 1) without DiLoCo)."""

    def diverged(self) -> bool:
        """The replicas hold different states: always with DiLoCo, since its inner optimizers
        keep their own moments across rounds (only the parameters agree after a sync)."""
        return self.replicas > 1

    def _own_key(self, per_replica: bool) -> str | None:
        return f"{REPLICA_PREFIX}{self.replica}" if per_replica and self.replica > 0 else None

    def register(self, name: str, obj: Stateful) -> None:
        """Checkpoint `obj` too, under `name` (tensors only; see the module docstring)."""
        if name in ("model", "optim") or name in self.extras:
            raise ValueError(f"checkpoint state {name!r} is already registered")
        self.extras[name] = obj

    def tensors(self, per_replica: bool = False) -> dict[str, Any]:
        """The state dict DCP saves (and, from a fresh engine, the template it loads into).
        `per_replica`: each DiLoCo replica's own model and optimizer (see the module doc)."""
        optim = {k: v for k, v in self.optim_sd().items() if not k.startswith(_GROUP_PREFIX)}
        own: dict[str, Any] = {"model": self.model_sd(), "optim": optim}
        key = self._own_key(per_replica)
        out: dict[str, Any] = own if key is None else {key: own}
        for name, obj in self.extras.items():
            out[name] = obj.state_dict()
        return out

    def presize_optimizer(self, states: dict[str, tuple[torch.dtype, bool]]) -> bool:
        """Create the optimizer's (still empty) state tensors from a saved state's index, so
        that `tensors()` builds the load template without a zero-lr optimizer step.

        get_optimizer_state_dict fills an optimizer without state by torch's
        `_init_optim_state`: zero gradients, then one optimizer step at lr 0 over every
        parameter. Under FSDP2 that step runs through DTensor dispatch with cold sharding caches,
        and it was most of a restore's seconds (bench/recovery.py, cProfile: 0.8 of 1.1 s for
        a 134 MiB shard per rank); the load overwrites every value it produced. Here each state
        is allocated as the saved one says (`empty_like` the parameter for per-element states,
        a 0-d tensor for scalars such as AdamW's step) and the load writes into it.

        `states`: flat optimizer key 'state.<fqn>.<name>' -> (dtype, scalar). Returns False
        and changes nothing unless this is a ParallelOptimizer (FSDP2 / DTensor states, not
        compressed ZeRO-1 owners, no DiLoCo replicas) without state whose every parameter's
        plain-model name has states in `states`."""
        from meshtron.model.init import clean_name

        engine, opt = self.engine, getattr(self.engine, "optimizer", None)
        if not hasattr(engine, "pm") or self.replicas > 1 or getattr(opt, "zero1_owners", True) \
                or any(o.state for o in opt.optimizers):
            return False
        by_fqn: dict[str, dict[str, tuple[torch.dtype, bool]]] = {}
        for key, value in states.items():
            if key.startswith("state."):
                fqn, _, name = key[len("state."):].rpartition(".")
                by_fqn.setdefault(fqn, {})[name] = value
        todo = []
        for part, o in zip(engine.pm.model_parts, opt.optimizers):
            group_of = {id(p): g for g in o.param_groups for p in g["params"]}
            seen = 0
            for name, p in part.named_parameters():
                if id(p) not in group_of:
                    continue
                found = by_fqn.get(clean_name(name))
                if not found:
                    return False
                # Scalars where torch's Adam/AdamW put them: on the parameter's device when
                # fused or capturable, else on the host (no device sync to read the step).
                g = group_of[id(p)]
                where = p.device if g.get("fused") or g.get("capturable") else "cpu"
                todo.append((o, p, found, where))
                seen += 1
            if seen != len(group_of):
                return False
        with torch.no_grad():
            for o, p, found, where in todo:
                o.state[p] = {name: torch.zeros((), dtype=dt, device=where) if scalar
                              else torch.empty_like(p, dtype=dt)
                              for name, (dt, scalar) in found.items()}
        return True

    def load_tensors(self, loaded: dict[str, Any], per_replica: bool = False) -> None:
        """Hand the tensors DCP loaded into `tensors(per_replica)`'s template back."""
        key = self._own_key(per_replica)
        own = loaded if key is None else loaded[key]
        self.load_model(own["model"])
        groups = {k: v for k, v in self.optim_sd().items() if k.startswith(_GROUP_PREFIX)}
        self.load_optim({**own["optim"], **groups})
        for name, obj in self.extras.items():
            obj.load_state_dict(loaded[name])


def set_schedule_position(scheduler: torch.optim.lr_scheduler.LRScheduler,
                          last_epoch: int) -> None:
    """Put the LR schedule at `last_epoch` and write its learning rate into every parameter
    group, exactly as the uninterrupted run's `scheduler.step()` computed it (same formula,
    same inputs)."""
    scheduler.last_epoch = last_epoch - 1
    with warnings.catch_warnings():
        # "lr_scheduler.step() before optimizer.step()": expected here, nothing is skipped
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*", category=UserWarning)
        scheduler.step()


def _own_device(accel: Any) -> tuple[Any, int] | None:
    """(device module, index) of this rank's accelerator: `accel` (injected by tests) or
    torch.cuda when available; None on a CPU rank."""
    if accel is None:
        accel = torch.cuda if torch.cuda.is_available() else None
    return None if accel is None else (accel, accel.current_device())


def rng_state(accel: Any = None) -> dict[str, Any]:
    """This rank's RNG states as JSON-safe text: the CPU generator's and its own device's
    (only that one: every rank touching every visible GPU, as `get_rng_state_all` does, makes a
    context on each of them)."""
    doc: dict[str, Any] = {"torch": _b64(torch.get_rng_state())}
    own = _own_device(accel)
    if own is not None:
        module, index = own
        doc["cuda"] = _b64(module.get_rng_state(index))
        doc["cuda_device"] = index
    return doc


def set_rng_state(doc: dict[str, Any], accel: Any = None) -> None:
    """Restore what `rng_state` saved into this rank's generators (its own device only)."""
    torch.set_rng_state(_unb64(doc["torch"]))
    own = _own_device(accel)
    if own is None or "cuda" not in doc:
        return
    module, index = own
    saved = doc["cuda"]
    if isinstance(saved, list):  # written before: one state per visible GPU
        if index >= len(saved):
            return
        saved = saved[index]
    module.set_rng_state(_unb64(saved), index)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def write_rank_file(folder: Path, rank: int) -> None:
    store.write_json(folder / f"rank_{rank}.json", {"rank": rank, "rng": rng_state()})


def read_rank_file(folder: Path, rank: int, saved_world: int) -> dict[str, Any]:
    """Rank `rank`'s file; under another world size, rank `rank % saved_world`'s (meshtron's
    training draws no random numbers itself; the states matter for code that does, e.g.
    dropout, and are exact whenever the world size is unchanged)."""
    path = folder / f"rank_{rank % max(1, saved_world)}.json"
    return json.loads(path.read_text())
