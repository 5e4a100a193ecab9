"""The pipeline schedule's metadata-inference forward (first step) must not count router load
(meshtron/parallel/pipeline.py `_uncounted_metadata_forward`). torch 2.13's PipelineStage runs
it as `_forward_metadata_inference`, torch 2.11's (the H200 image) as `_shape_inference`, on
zeros: every token id 0, all of them to the same experts. Only the 2.13 name was wrapped, so on
2.11 that forward steered the balancing bias. The stage objects here have each release's
method (a real PipelineStage needs a pipeline group; what is tested is the name lookup)."""

from __future__ import annotations

import pytest
import torch

from meshtron.model import Transformer
from meshtron.model.moe import MoE
from meshtron.model.spec import preset
from meshtron.parallel.pipeline import METADATA_INFERENCE, _uncounted_metadata_forward


class _Stage:
    """PipelineStage's inference method under one torch release's name, recording whether
    the routers would count the tokens while it runs."""

    def __init__(self, module, name: str):
        self.flags: list[bool] = []

        def infer(args, kwargs=None):
            self.flags += [m.count_load for m in module.modules() if isinstance(m, MoE)]
            return "outputs"

        setattr(self, name, infer)


@pytest.mark.parametrize("name", METADATA_INFERENCE)
def test_the_inference_forward_counts_no_router_load_on_each_torch(name):
    with torch.device("meta"):
        module = Transformer(preset("tiny-moe-ds"))
    st = _Stage(module, name)
    _uncounted_metadata_forward(st, module)
    assert getattr(st, name)((torch.zeros(1, 4, dtype=torch.long),)) == "outputs"
    assert st.flags and not any(st.flags)  # every router off during the inference forward
    assert all(m.count_load for m in module.modules() if isinstance(m, MoE))  # and on after


def test_both_names_are_the_ones_torch_releases_call():
    from torch.distributed.pipelining import PipelineStage

    assert METADATA_INFERENCE == ("_forward_metadata_inference", "_shape_inference")
    assert any(callable(getattr(PipelineStage, n, None)) for n in METADATA_INFERENCE)
