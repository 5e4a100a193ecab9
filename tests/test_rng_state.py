"""Per-device RNG state (issue 31, item 3): a checkpoint saves and restores only the rank's own
device's generator; `get_rng_state_all` made every rank touch every visible GPU. The device
module is injected (a CPU machine has no CUDA generator); the CPU generator is real."""

from __future__ import annotations

import torch

from meshtron.checkpoint.state import rng_state, set_rng_state


class FourGpus:
    """`torch.cuda`'s generator API for a node of four GPUs, this rank on GPU 2, recording which
    device each call touched."""

    def __init__(self, current: int = 2):
        self.current = current
        self.touched: list[tuple[str, int]] = []
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(4)}

    def current_device(self) -> int:
        return self.current

    def get_rng_state(self, device: int) -> torch.Tensor:
        self.touched.append(("get", device))
        return self.states[device].clone()

    def set_rng_state(self, state: torch.Tensor, device: int) -> None:
        self.touched.append(("set", device))
        self.states[device] = state.clone()

    def get_rng_state_all(self):
        raise AssertionError("every visible GPU touched")

    set_rng_state_all = get_rng_state_all


def test_only_the_ranks_own_device_is_saved_and_restored():
    gpus = FourGpus(current=2)
    torch.manual_seed(3)
    doc = rng_state(gpus)
    want = torch.rand(4)
    assert gpus.touched == [("get", 2)] and doc["cuda_device"] == 2
    gpus.states[2] = torch.zeros(16, dtype=torch.uint8)  # the generator moved on
    torch.rand(100)
    set_rng_state(doc, gpus)
    assert gpus.touched == [("get", 2), ("set", 2)]
    assert torch.equal(gpus.states[2], torch.full((16,), 2, dtype=torch.uint8))
    assert torch.equal(torch.rand(4), want)  # the CPU generator, for real


def test_an_older_checkpoint_with_every_gpus_state_restores_the_own_one():
    import base64

    old = {"torch": rng_state(None)["torch"],
           "cuda": [base64.b64encode(bytes([10 + i] * 16)).decode() for i in range(4)]}
    gpus = FourGpus(current=1)
    set_rng_state(old, gpus)
    assert gpus.touched == [("set", 1)]
    assert torch.equal(gpus.states[1], torch.full((16,), 11, dtype=torch.uint8))
    lonely = FourGpus(current=3)  # saved with fewer visible GPUs than this rank's index
    set_rng_state(dict(old, cuda=old["cuda"][:2]), lonely)
    assert lonely.touched == []


def test_cpu_rank_saves_no_device_state():
    doc = rng_state()
    assert set(doc) == {"torch"}
