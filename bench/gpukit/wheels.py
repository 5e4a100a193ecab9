"""Which modules the GPU kit needs that a GPU image may lack (nothing installs from a registry
there: their wheels travel in `.whl/`, bench/gpu_check.py's docstring), found before any case
starts, without importing them; a case whose module is missing is skipped by name.
"""

from __future__ import annotations

WHEELS = {"tomli_w": "tomli_w==1.2.0", "torchao": "torchao==0.18.0", "transformers": None,
          "pytest": "pytest==9.2.0", "pluggy": "pluggy==1.7.0", "iniconfig": "iniconfig==2.3.1",
          "pygments": "pygments==2.21.0", "packaging": "packaging==26.3",
          "pynvml": "nvidia-ml-py==13.615.71"}
"""Modules the kit may need that a GPU image may lack, and the wheels that bring them (None:
in the image; ../shared/notes/gpu-h200-facts.md: the H200 image has transformers, rich, hence
pygments, and packaging; pytest 9.2 needs all four of its last entries)."""
NEEDS = {"fp8": ("torchao",), "cli_fp8": ("torchao",), "hf": ("transformers",),
         "torch_tests": ("pytest", "pluggy", "iniconfig", "pygments", "packaging")}
"""Modules a case needs beyond meshtron's own (tomli_w: every case imports meshtron, whose
Plan writes TOML); pynvml is optional (clocks fall back to torch.cuda, then nvidia-smi)."""


def preflight(installed=None) -> dict:
    """Which of WHEELS this Python lacks, found without importing them (seconds each)."""
    if installed is None:
        import importlib.util

        def installed(mod: str) -> bool:
            return importlib.util.find_spec(mod) is not None
    missing = [m for m in WHEELS if not installed(m)]
    return {"missing": missing, "carry": [WHEELS[m] for m in missing if WHEELS[m]]}


def unmet(name: str, pre: dict) -> str | None:
    """Why case `name` cannot run with the modules preflight found missing, or None."""
    lacking = [m for m in ("tomli_w", *NEEDS.get(name, ())) if m in pre["missing"]]
    if not lacking:
        return None
    return (f"{', '.join(lacking)} not installed (carry "
            f"{' '.join(filter(None, (WHEELS[m] for m in lacking))) or 'its wheel'} in .whl/)")
