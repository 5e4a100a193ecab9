"""Hugging Face interoperability: safetensors weights in (`load_into`, reading only this rank's
slices) and out (`save_hf`, `export_parallel`), name mapping for Llama, Mistral, Qwen2, GPT-2."""

from meshtron.hf.export import export_parallel, save_hf
from meshtron.hf.load import Checkpoint, check_checkpoint, load_into
from meshtron.hf.names import SUPPORTED_TYPES, hf_config, meshtron_to_hf

__all__ = ["Checkpoint", "SUPPORTED_TYPES", "check_checkpoint", "export_parallel", "hf_config",
           "load_into", "meshtron_to_hf", "save_hf"]
