"""Hugging Face interoperability: safetensors weights in (`load_into`, reading only this rank's
slices) and out (`save_hf`, `export_parallel`), name mapping for the types of
`layouts.SUPPORTED_TYPES` (Llama's family, Phi-3, Nemotron, StarCoder2, Gemma 3, OLMo 2, GPT-2
and five mixtures of experts)."""

import importlib

__all__ = ["Checkpoint", "SUPPORTED_TYPES", "check_checkpoint", "export_parallel", "hf_config",
           "load_into", "meshtron_to_hf", "save_hf"]

# Loaded on first use: `export` and `load` import torch, and `names` is read while the command
# line is built (`meshtron plan` and `--help` must start without torch).
_HOME = {"export_parallel": "export", "save_hf": "export", "Checkpoint": "load",
         "check_checkpoint": "load", "load_into": "load", "SUPPORTED_TYPES": "names",
         "hf_config": "names", "meshtron_to_hf": "names"}


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(f"meshtron.hf.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
