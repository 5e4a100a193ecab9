"""meshtron: plan, run, protect and explain LLM training across many GPUs."""

__version__ = "0.1.0"
