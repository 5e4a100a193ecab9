"""What the parallel training engine attaches around its step, through one small interface.

A feature is an object with a `name`, `after_optimizer_step()` (called after every
`optimizer.step()`, before the learning-rate schedule steps, in the order the features were
built) and `release()` (before the mesh's process groups are destroyed). A feature that is also a
`Stateful` (`state_dict()` / `load_state_dict()`) is saved and restored with every checkpoint
under its `name`: the engine's `checkpoint_extras`.

`build_features` lists them for a plan, each only when the plan uses it: FP8 weight scales, the
MoE balancing bias, and the data-parallel compression state (DiLoCo's outer loop, or the error
feedback of compressed gradients). Compressed gradients are reduced after backward inside
`ParallelModel.forward_backward`, which `parallelize` sets up, so the Python API reduces a
compressed plan without this module; the engine lists that state here to checkpoint and release
it. A new feature is a class with these methods and one line in `build_features`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from meshtron.train import router


@runtime_checkable
class EngineFeature(Protocol):
    name: str

    def after_optimizer_step(self) -> None: ...

    def release(self) -> None: ...


class Fp8Scales:
    """FSDP2's FP8 all-gather needs the weights' scales recomputed after every optimizer step
    (tensorwise FP8 on CUDA); a no-op otherwise (`ParallelModel.after_optimizer_step`)."""

    name = "fp8_scales"

    def __init__(self, pm) -> None:
        self.pm = pm

    def after_optimizer_step(self) -> None:
        self.pm.after_optimizer_step()

    def release(self) -> None:
        pass


class MoEBias:
    """DeepSeek-V3's balancing-bias update of every sigmoid router, on the load summed over the
    ranks that route different tokens through the same experts (`data_group()`, made on first
    use), so every rank applies the same update (meshtron/train/router.py)."""

    name = "moe_bias"

    def __init__(self, parts: list, data_group: Callable[[], Any]) -> None:
        self.parts = parts
        self.data_group = data_group

    def after_optimizer_step(self) -> None:
        router.update_bias(self.parts, group=self.data_group())

    def release(self) -> None:
        pass


def build_features(pm, plan, moe_layers: list, data_group: Callable[[], Any],
                   last_step: int | None = None) -> list:
    """The features `plan` uses for `pm`, in the order they act after the optimizer step: FP8
    scales, the MoE bias (when this rank holds MoE layers), then DiLoCo's outer step or the
    compressed gradients' state (`meshtron.compress`; saved under "compress"). `last_step`: the
    run's last step, where DiLoCo syncs even mid-round (compress/diloco.py)."""
    from meshtron.compress import diloco

    features: list = [Fp8Scales(pm)]
    if moe_layers:
        features.append(MoEBias(pm.model_parts, data_group))
    compress = diloco.attach(pm, plan, last_step) or pm.grad_sync
    if compress is not None:
        features.append(compress)
    return features


def stateful_features(features: list) -> dict[str, Any]:
    """The Stateful features by name, saved and restored beside the model and optimizer."""
    return {f.name: f for f in features if hasattr(f, "state_dict")}
