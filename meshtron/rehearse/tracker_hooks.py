"""The memory tracker's own hooks, released when a micro-batch's backward is over.

torch's `ModTracker` (inside `MemTracker` / `FSDPMemTracker`) registers, before every
module's forward, `register_multi_grad_hook` on the module's inputs (torch 2.13
mod_tracker.py `_fw_pre_hook`, mode "all"). That hook's closure holds the inputs' grad_fn
nodes (autograd/graph.py: `grad_fns = list(map(_get_grad_fn_or_grad_acc, tensors))`) and is
stored on those same nodes: a cycle through C++ that Python's collector cannot see, so every
input node, and the graph behind it, lives as long as the process.

Under a whole backward that costs no tracked bytes: each node frees its saved tensors as it
runs (retain_graph=False). Under zero bubble's split backward it is the whole measurement:
`stage_backward_input` runs with retain_graph=True and `stage_backward_weight` only walks the
weight paths, so the input path's saved tensors are freed when the graph is dropped after W,
and the cycle keeps them (measured on the 'mid' model, pp=2, zbv, a middle stage: each W
freed 0.51 of the 1.16 GiB a micro-batch's F and B added; rank 1's peak 7.65 GiB was every
micro-batch's activations at once). A real run has no tracker and no cycle: after W the
stage drops `backward_state` and the graph goes (stage.py `backward_weight_one_chunk`).

`KeepingModTracker` is torch's tracker with one addition: it remembers the hook dictionary
of each input it hooked (`Tensor._backward_hooks`, the dictionary the node calls), so the
rehearsal can empty them (`take`, then `release`) when the micro-batch's backward is done:
the hooks have run by then (the input path ran in B), and emptying them breaks the cycle.
"""

from __future__ import annotations

from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_flatten


class KeepingModTracker(ModTracker):
    """torch's ModTracker that also lists the hook dictionaries of the inputs it hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.hooked: list[dict] = []

    def _fw_pre_hook(self, mod, input):
        super()._fw_pre_hook(mod, input)
        if self.is_bw:  # torch hooks nothing in backward (recomputation)
            return
        args, _ = tree_flatten(input)
        for a in args:
            hooks = getattr(a, "_backward_hooks", None)
            if hooks is not None and a.requires_grad:
                self.hooked.append(hooks)

    def take(self) -> list[dict]:
        """The hook dictionaries listed since the last call (one forward's)."""
        out, self.hooked = self.hooked, []
        return out


def release(hooked: list[dict]) -> None:
    """Empty the hook dictionaries of a micro-batch whose backward is done."""
    for hooks in hooked:
        hooks.clear()
