"""Sliding-window attention's CUDA branch inside a compiled block, run on CPU.

On CUDA, `Attention` calls `window_attention` with FlexAttention, and the band's block mask is
built on the first forward and kept in a process-wide cache (model/attention.py
`_window_block_mask`). Under `--compile` that happens inside each block's
`torch.compile(fullgraph=True)` graph (parallel/compile.py), a path no CPU run takes: CPU blocks
use query chunks. Here the kernel is injected (`Attention.window_kernel = "flex"`) and the
blocks are compiled by the runtime's own `apply_compile` (aot_eager: dynamo and AOT autograd
trace as with inductor): a graph break (the cache written from inside the graph, the mask
object built there) fails the fullgraph compile, and the logits must equal the eager chunked
path's. Forward only: FlexAttention has no CPU backward."""

from __future__ import annotations

import pytest
import torch

from meshtron.model.attention import _WINDOW_MASKS
from meshtron.model.spec import PRESETS
from meshtron.model.transformer import Attention, Transformer


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_compiled_block_runs_the_flex_window_path_and_equals_the_chunks():
    from meshtron.parallel.compile import apply_compile, compile_backend

    spec = PRESETS["debug"].replace(sliding_window=16)
    tokens = torch.randint(0, spec.vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    eager = Transformer(spec, init_seed=3)
    compiled = Transformer(spec, init_seed=3)
    for block in compiled.layers.values():
        block.attention.window_kernel = "flex"
    _WINDOW_MASKS.clear()  # built inside the first compiled block's graph
    torch._dynamo.reset()
    with compile_backend("aot_eager"):
        apply_compile(compiled)
    with torch.no_grad():
        want = eager(tokens)
        got = compiled(tokens)
        again = compiled(tokens)  # the kept mask, read from inside the graph
    assert Attention.window_kernel is None  # set on the blocks only
    assert len(_WINDOW_MASKS) == 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(again, want, rtol=1e-4, atol=1e-5)
