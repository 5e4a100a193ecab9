"""Issue 31's device-explicit pieces on a real GPU, in one prepared call: each case runs in its
own process with its own time cap, and the JSON (`--out`) is rewritten after every case, so a
failure or a cap loses nothing else.

Cases: the environment and the private torch symbols meshtron registers; initialization of the
8B Llama-3 shape on the GPU (whole model and rank shards; goal < 5 s whole); init values equal
for every layout on the GPU (whole, shards, offloaded to the host); `meshtron train` one
process with --compile and with a MoE model (crashed at init before); the backend helper,
doctor and async-TP decision on a real "cuda:nccl,cpu:gloo" group; the checkpoint stager's
ordering after queued kernels; per-device RNG state; selective recompute keeping the bf16
grouped GEMM; context parallelism's attention (flash kernels without documents, compiled block
masks with them, a mask's memory at 128k tokens); and the CPU tests of these items under the
device's torch. The device-only checks are the GPU kit's (bench/gpukit/gputrue.py), which runs
them as its `gputrue` case: prefer `bench/gpu_check.py`, which runs this and more in one call.

    python3 bench/gputrue_check.py --out $OUT/gputrue.json          # on the GPU machine
    python3 bench/gputrue_check.py --dry-run --out /tmp/g.json       # the plumbing, on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpukit.gputrue import CHECKS, script  # noqa: E402

ENV = r"""
import json, torch
from meshtron import torch_compat
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                  "missing_private_apis": torch_compat.missing()}))
"""

INIT_LAYOUT = r"""
import json, torch
from meshtron.model import init as minit
from meshtron.model.spec import preset
from meshtron.model.transformer import Transformer
dev = torch.device(DEVICE)
spec = preset("debug")
whole = Transformer(spec, init_seed=3, device=dev)
meta = Transformer(spec, init_seed=3, device="meta")
minit.materialize([meta], dev)
same = all(torch.equal(a, b) for a, b in zip(whole.parameters(), meta.parameters()))
host = Transformer(spec, init_seed=3, device="meta")
minit.materialize([host], dev, param_device=torch.device("cpu"))  # offload: drawn on dev
offload = all(torch.equal(a.cpu(), b) for a, b in zip(whole.parameters(), host.parameters()))
name = "layers.0.feed_forward.w1.weight"
shape = (3000, 1100)
full = minit.init_box(name, shape, (0, 0), shape, 5, 2, device=dev)
boxes = [((0, 0), (375, 1100)), ((700, 300), (900, 137)), ((2999, 1099), (1, 1))]
shards = all(torch.equal(minit.init_box(name, shape, o, s, 5, 2, device=dev),
                         full[o[0]:o[0] + s[0], o[1]:o[1] + s[1]]) for o, s in boxes)
print(json.dumps({"meta_equals_whole": same, "offload_equals_device": offload,
                  "shards_equal_slices": shards, "std": float(full.std())}))
"""

TESTS = ["tests/test_device_init.py", "tests/test_backend.py", "tests/test_staging.py",
         "tests/test_rng_state.py", "tests/test_recompute_ops.py", "tests/test_torch_compat.py"]


def cases(dry: bool, tmp: str) -> list[tuple[str, list[str], int]]:
    py = [sys.executable]
    dev = "cpu" if dry else "cuda"
    mt = py + ["-m", "meshtron"]
    steps = "2" if dry else "20"
    # the device-only checks are the GPU kit's (bench/gpukit/gputrue.py): the same scripts
    gpu_only = [(name, py + ["-c", script(body, "cuda", False, tmp)], 2 * cap)
                for name, body, cap in CHECKS]
    out = [
        ("env", py + ["-c", ENV], 60),
        ("init_layouts", py + ["-c", f"DEVICE={dev!r}\n" + INIT_LAYOUT], 90),
        ("init_llama3_8b", py + ["bench/init_speed.py", "--model", "debug" if dry else "llama3-8b",
                                 "--cases", "full,fsdp8,tp8", "--device", dev], 150),
        ("train_moe", mt + ["train", "--model", "tiny-moe-ds", "--steps", "2" if dry else "10",
                            "--run-dir", f"{tmp}/moe", "--overwrite"], 150),
        ("train_debug_compile", mt + ["train", "--model", "debug", "--steps", steps, "--compile",
                                      "--run-dir", f"{tmp}/debug", "--overwrite"], 180),
        *([] if dry else gpu_only),
        ("train_checkpoint", mt + ["train", "--model", "debug", "--steps", "4" if dry else "30",
                                   "--checkpoint-every", "2" if dry else "10",
                                   "--run-dir", f"{tmp}/ckpt", "--overwrite"], 150),
        ("train_resume", mt + ["train", "--model", "debug", "--steps", "4" if dry else "30",
                               "--checkpoint-every", "2" if dry else "10", "--resume",
                               "--run-dir", f"{tmp}/ckpt"], 150),
    ]
    out.append(("cpu_tests", py + ["-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   *TESTS], 300))
    return out


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--budget", type=float, default=520.0, help="seconds for all cases")
    ap.add_argument("--only", default="", help="comma list of case names")
    args = ap.parse_args()
    start = time.time()
    results: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cases": {}}
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as tmp:
        for name, cmd, cap in cases(args.dry_run, tmp):
            if args.only and name not in args.only.split(","):
                continue
            left = args.budget - (time.time() - start)
            if left < 10:
                results["cases"][name] = {"skipped": "budget spent"}
                continue
            t0 = time.time()
            try:
                proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                      timeout=min(cap, left))
                rc, text = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as exc:
                rc, text = "timeout", _text(exc.stdout) + _text(exc.stderr)
            lines = [ln for ln in text.splitlines() if ln.startswith("{")]
            parsed = []
            for ln in lines:
                try:
                    parsed.append(json.loads(ln))
                except json.JSONDecodeError:
                    pass
            results["cases"][name] = {"rc": rc, "seconds": round(time.time() - t0, 1),
                                      "json": parsed, "tail": text[-1500:]}
            print(f"[{time.time() - start:6.1f}s] {name}: rc={rc} "
                  f"{json.dumps(parsed)[:300] if parsed else text[-300:]!s}", flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
