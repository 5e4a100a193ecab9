"""The rehearsal's memory tracker must not keep a split backward's graph alive.

torch's ModTracker hooks every module input with a multi-grad hook whose closure holds the
input's grad_fn, stored on that node: a cycle Python cannot collect. Under zero bubble's
split backward (`stage_backward_input` with retain_graph=True, then `stage_backward_weight`)
the input path's saved tensors are freed only when the graph is dropped, so the cycle kept
every micro-batch's activations to the end of the step (the 'mid' model's zbv rank 1 read
7.65 GiB; 5.50 with the hooks released). rehearse/tracker_hooks.py releases them after W."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from meshtron.rehearse.memory import without_propagation as _without_propagation
from meshtron.rehearse.tracker_hooks import KeepingModTracker, release

WIDTH, TOKENS, LAYERS = 64, 256, 3


def _current_bytes(tracker) -> float:
    return sum(d["Total"] for d in tracker.get_tracker_snapshot("current").values())


def _split_step(tracker, model, keep_hooks: bool) -> tuple[float, float]:
    """(bytes alive after the forward, bytes alive after B, W and, when `keep_hooks`, the
    release of the tracker's hooks), beyond what was alive before the forward."""
    x = torch.randn(TOKENS, WIDTH).requires_grad_(True).view(TOKENS, WIDTH)
    with tracker:
        before = _current_bytes(tracker)
        out = model(x)
        hooked = tracker._mod_tracker.take() if keep_hooks else []
        forward = _current_bytes(tracker) - before
        grads, groups = stage_backward_input([out], [torch.ones_like(out)], [x],
                                             model.parameters())
        stage_backward_weight(model.parameters(), groups)
        del out, grads, groups, x
        release(hooked)
        after = _current_bytes(tracker) - before
    return forward, after


@pytest.mark.parametrize("keep_hooks", [True, False])
def test_split_backward_graph_is_freed_after_its_weight_gradient(keep_hooks):
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    tracker = _without_propagation(MemTracker)()
    tracker.track_external(model)
    if not keep_hooks:  # torch's own module tracker: what the rehearsal used before
        from torch.distributed._tools.mod_tracker import ModTracker

        tracker._mod_tracker = ModTracker()
    assert isinstance(tracker._mod_tracker, KeepingModTracker) == keep_hooks
    forward, after = _split_step(tracker, model, keep_hooks)
    saved = LAYERS * 2 * TOKENS * WIDTH * 4  # each Linear's and GELU's fp32 input
    assert forward >= saved
    weight_grads = sum(p.numel() * 4 for p in model.parameters())
    if keep_hooks:  # only the weight gradients W accumulated stay
        assert after <= weight_grads + TOKENS * WIDTH * 4, (after, weight_grads)
    else:  # the cycle keeps the input path's saved tensors: torch's tracker alone leaks
        assert after >= weight_grads + saved / 2, (after, weight_grads)
