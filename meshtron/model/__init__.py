"""Model zoo: ModelSpec (shapes) and the plain single-process Transformer built from it.

The Transformer is imported lazily: the planner and the CLI read ModelSpecs without paying for
`import torch`.
"""

from meshtron.model.spec import (
    PRESETS,
    ModelSpec,
    from_hf_config,
    preset,
    resolve_model,
)

__all__ = ["PRESETS", "ModelSpec", "Transformer", "cross_entropy_loss", "from_hf_config",
           "preset", "resolve_model"]


def __getattr__(name: str):
    if name in ("Transformer", "cross_entropy_loss"):
        from meshtron.model import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'meshtron.model' has no attribute {name!r}")
