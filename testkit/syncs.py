"""A CPU-testable detector of host synchronisations: every operation that, on CUDA, makes the
host wait for the device (test-only; issue 31).

On a CPU run nothing waits, so the detector records what *would* wait on a GPU, from two
interception points (both thread-local: only the thread that enters the detector is watched):

- `TorchDispatchMode` (aten level, also inside autograd's backward and checkpoint recompute):
  the ops whose CUDA kernels read device memory from the host. This is the list behind
  `torch.cuda.set_sync_debug_mode("warn")` (c10/cuda `warn_or_error_on_sync`, called by
  `_local_scalar_dense`, `nonzero`, blocking device<->host copies, and the ops built on them)
  plus ops whose output size depends on tensor values.
- `TorchFunctionMode` (Python level): the tensor methods that hand values to Python
  (`tolist`, `numpy`, `cpu`, `item`, `bool()`, `int()`, `float()`, `index()`). On a CPU tensor
  `tolist()`/`cpu()` dispatch no aten op at all, so the aten mode alone would miss them.

Not seen (say so where it matters): `torch.cuda.synchronize()` / stream or event waits (no
tensor op; on a CPU-only build they raise anyway), `.to("cpu")` of a CPU tensor (a no-op that
dispatches nothing), and other threads (the watchdog's, a data loader's).
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# aten ops that synchronise on CUDA whatever their arguments. `_local_scalar_dense` is what
# item()/bool()/int()/float() of a device tensor run; the others size their output by the data
# (they call nonzero or read a count on the host inside the CUDA kernel).
ALWAYS = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
    aten.is_nonzero.default, aten.equal.default, aten.allclose.default,
    aten._unique.default, aten._unique2.default, aten.unique_dim.default,
    aten.unique_consecutive.default, aten.unique_dim_consecutive.default,
    aten.bincount.default, aten.histc.default, aten.argwhere.default,
    aten.nonzero_numpy.default, aten._assert_async.msg,
}
# Sync unless the caller gives the output size.
NEEDS_SIZE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
# Boolean-mask indexing: CUDA converts the mask with nonzero first.
MASK_INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
              aten._index_put_impl_.default}
# Python-level reads (TorchFunctionMode): name -> shown op name.
PY_READS = {
    torch.Tensor.tolist: "Tensor.tolist", torch.Tensor.numpy: "Tensor.numpy",
    torch.Tensor.cpu: "Tensor.cpu", torch.Tensor.item: "Tensor.item",
    torch.Tensor.__bool__: "bool(tensor)", torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)", torch.Tensor.__index__: "index(tensor)",
}


@dataclass(frozen=True)
class Sync:
    """One host synchronisation: the op and where product code asked for it."""

    op: str
    site: str
    """Innermost frame in `meshtron/`: 'meshtron/x/y.py:func' (or the innermost frame)."""
    stack: tuple[str, ...]
    """Up to 6 frames, innermost last, 'path:line func'."""
    callers: frozenset[str] = frozenset()
    """Function names of every `meshtron/` frame on the stack (for `within`)."""
    inner: str = ""
    """The innermost frame outside testkit (inside torch when torch made the read)."""

    def __str__(self) -> str:
        return (f"{self.op} at {self.site} (innermost: {self.inner})\n    "
                + "\n    ".join(self.stack))


def _where() -> tuple[str, tuple[str, ...], frozenset[str], str]:
    every = [f for f in traceback.extract_stack() if "/testkit/syncs.py" not in f.filename]
    frames = [f for f in every if "/torch/" not in f.filename]
    ours = [f for f in frames if "/meshtron/" in f.filename]
    def rel(f):
        return str(Path(f.filename)).split("/meshtron/", 1)[-1] if "/meshtron/" in f.filename \
            else Path(f.filename).name
    site_frame = (ours or frames)[-1]
    site = f"meshtron/{rel(site_frame)}:{site_frame.name}" if ours else \
        f"{rel(site_frame)}:{site_frame.name}"
    return (site, tuple(f"{rel(f)}:{f.lineno} {f.name}" for f in (ours or frames)[-6:]),
            frozenset(f.name for f in ours),
            f"{every[-1].filename.split('/site-packages/')[-1]}:{every[-1].lineno} "
            f"{every[-1].name}" if every else "")


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _masked_fill_path(args, kwargs, indices) -> bool:
    """`t[mask] = 0`: index_put_ with one mask and a 0-dim host value runs `masked_fill_` with
    the host scalar (ATen's `canDispatchToMaskedFill`), no nonzero and no sync. On CPU a device
    scalar looks the same; Python's `t[mask] = 0` always makes a 0-dim CPU value."""
    value = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    return (not accumulate and len(indices) == 1 and isinstance(value, torch.Tensor)
            and value.dim() == 0 and value.device.type == "cpu")


def _aten_sync(func, args, kwargs) -> bool:
    if func in ALWAYS:
        return True
    if func in NEEDS_SIZE:
        return kwargs.get("output_size") is None
    if func in MASK_INDEX:
        indices = [i for i in (args[1] if len(args) > 1 else kwargs.get("indices", ())) or ()
                   if i is not None]
        if func is not aten.index.Tensor and _masked_fill_path(args, kwargs, indices):
            return False
        return any(_is_mask(i) for i in indices)
    if func in (aten._to_copy.default, aten.copy_.default):
        # a real device -> host copy (a GPU run); on CPU the Python-level reads catch it
        src = args[1] if func is aten.copy_.default else args[0]
        dst_dev = (args[0].device if func is aten.copy_.default
                   else kwargs.get("device") or src.device)
        return src.device.type not in ("cpu", "meta") and torch.device(dst_dev).type == "cpu"
    return False


class _AtenWatch(TorchDispatchMode):
    def __init__(self, found: list[Sync]):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _aten_sync(func, args, kwargs):
            self.found.append(Sync(f"aten.{func.__name__}".removesuffix(".default"), *_where()))
        return func(*args, **kwargs)


class _PyWatch(TorchFunctionMode):
    def __init__(self, found: list[Sync]):
        super().__init__()
        self.found = found
        self.depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = PY_READS.get(func)
        # one record per Python read: item() inside tolist() etc. is the same read
        if name is not None and self.depth == 0:
            self.found.append(Sync(name, *_where()))
        self.depth += name is not None
        try:
            return func(*args, **kwargs)
        finally:
            self.depth -= name is not None


class SyncDetector:
    """`with SyncDetector() as d: ...` records every host synchronisation in `d.syncs`.
    A Python read (`t.item()`) also dispatches `aten._local_scalar_dense`; both are recorded,
    `sites()` counts them once (the Python-level name wins)."""

    def __init__(self):
        self.syncs: list[Sync] = []
        self._modes = (_PyWatch(self.syncs), _AtenWatch(self.syncs))

    def __enter__(self) -> "SyncDetector":
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)

    def reads(self, within: str | None = None) -> list[Sync]:
        """The syncs, one per host read (the aten op right after a Python read at the same
        place is that read); `within`: only syncs with a `meshtron/` frame of that function
        name on their stack (e.g. the training loop's `_run_steps`)."""
        out: list[Sync] = []
        last_py = None
        for s in self.syncs:
            if within is not None and within not in s.callers:
                continue
            if s.op == "aten._local_scalar_dense" and last_py is not None \
                    and last_py.stack == s.stack:
                last_py = None
                continue
            last_py = s if not s.op.startswith("aten.") else None
            out.append(s)
        return out

    def sites(self, within: str | None = None) -> Counter:
        """(op, site) -> number of reads (`reads`)."""
        return Counter((s.op, s.site) for s in self.reads(within))

    def report(self, within: str | None = None) -> str:
        """Each distinct sync once, with its count and a stack (for a failing assertion)."""
        seen: dict[tuple[str, str], Sync] = {}
        for s in self.syncs:
            if within is None or within in s.callers:
                seen.setdefault((s.op, s.site), s)
        counts = self.sites(within)
        return "\n".join(f"{n} x {seen[k]}" for k, n in counts.items())
