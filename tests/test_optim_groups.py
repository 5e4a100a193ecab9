"""meshtron/train/optim.py's AdamW groups where tensor parallelism leaves some parameters plain
(an MoE's experts beside DTensor weights): split by kind for fused/foreach AdamW, and still a
state that torch's distributed checkpoint (get/set_optimizer_state_dict) saves and loads.
DCP accepts at most one parameter group with no parameters; the split made two when each of
the weight-decay groups held one kind only."""

from __future__ import annotations

from testkit.multiproc import run_on_ranks


def _round_trip() -> list[int]:
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from meshtron.train.optim import param_groups

    mesh = init_device_mesh("cpu", (1,))
    model = nn.Module()
    # the weight (decayed) a DTensor as tensor parallelism leaves it, the bias (not decayed)
    # plain as an expert's: each group holds one kind
    model.weight = nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh, [Replicate()]))
    model.bias = nn.Parameter(torch.randn(4))

    def adamw():
        return torch.optim.AdamW(param_groups(model.parameters(), 0.1), lr=1e-3, foreach=True)

    opt = adamw()
    (torch.randn(2, 4) @ model.weight.to_local().T + model.bias).sum().backward()
    opt.step()
    state = get_optimizer_state_dict(model, opt)
    again = adamw()
    set_optimizer_state_dict(model, again, state)
    assert torch.equal(again.state[model.bias]["exp_avg"], opt.state[model.bias]["exp_avg"])
    return [len(g["params"]) for g in again.param_groups]


def test_split_groups_save_and_load_through_dcp():
    (sizes,) = run_on_ranks(_round_trip, 1)
    assert sorted(sizes) == [1, 1], sizes
