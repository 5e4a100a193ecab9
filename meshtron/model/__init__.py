"""Model zoo: ModelSpec (shapes) and the plain single-process Transformer built from it."""

from meshtron.model.spec import PRESETS, ModelSpec, from_hf_config, preset, resolve_model

__all__ = ["PRESETS", "ModelSpec", "from_hf_config", "preset", "resolve_model"]

from meshtron.model.transformer import Transformer, cross_entropy_loss  # noqa: E402

__all__ += ["Transformer", "cross_entropy_loss"]
