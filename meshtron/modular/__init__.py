"""Modular training: dense models become mixtures of experts after they were trained.

- Sparse upcycling (Komatsuzaki et al. 2022, "Sparse Upcycling: Training Mixture-of-Experts from
  Dense Checkpoints"): one dense checkpoint -> an MoE whose experts are copies of its MLP and
  whose logits equal the dense model's before any step (`meshtron.modular.upcycle`).
- Branch-Train-MiX (Sukhbaatar et al. 2024, "Branch-Train-MiX: Mixing Expert LLMs into a
  Mixture-of-Experts LLM"): N dense branches of one base, trained apart on different data ->
  one MoE whose expert i is branch i's MLP, every other parameter averaged over the branches,
  router fresh; its router is then trained with `meshtron train --init-from`.

`meshtron merge` (meshtron/modular/cli.py) does both; `branches.py` reads and checks the
inputs (run folders or exported weights), `upcycle.py` builds the MoE state dict.
"""
