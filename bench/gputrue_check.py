"""Issue 31's device-explicit pieces on a real GPU, in one prepared call: each case runs in its
own process with its own time cap, and the JSON (`--out`) is rewritten after every case, so a
failure or a cap loses nothing else.

Cases: the environment and the private torch symbols meshtron registers; initialization of the
8B Llama-3 shape on the GPU (whole model and rank shards; goal < 5 s whole); init values equal
for every layout on the GPU (whole, shards, offloaded to the host); `meshtron train` one
process with --compile and with a MoE model (crashed at init before); the backend helper,
doctor and async-TP decision on a real "cuda:nccl,cpu:gloo" group; the checkpoint stager's
ordering after queued kernels; per-device RNG state; selective recompute keeping the bf16
grouped GEMM; context parallelism's compiled block masks (and their memory at 128k tokens);
and the CPU tests of these items under the device's torch.

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

BACKEND = r"""
import json, os, torch, torch.distributed as dist
from meshtron.backend import backend_for, group_is_nccl
from meshtron.doctor.session import _recorder
from meshtron.doctor.dump import flight_recorder_trace
from meshtron.parallel.compile import async_tp_problem
from meshtron.runtime import nccl_env
for k, v in nccl_env().items():
    os.environ.setdefault(k, v)
store = dist.FileStore(os.path.join(TMP, "store"), 1)
dev = torch.device("cuda", 0)
dist.init_process_group(backend_for("cuda"), store=store, rank=0, world_size=1, device_id=dev)
t = torch.ones(4, device=dev)
dist.all_reduce(t)
torch.cuda.synchronize()
trace = flight_recorder_trace()
print(json.dumps({"get_backend": str(dist.get_backend()), "group_is_nccl": group_is_nccl(),
                  "doctor_recorder": type(_recorder(0, 16)).__name__,
                  "async_tp_problem": async_tp_problem("cuda", dist.get_backend()),
                  "flight_trace_entries": (len(trace.get("entries", [])) if isinstance(trace, dict)
                                           else None),
                  "flight_trace_error": trace.get("error") if isinstance(trace, dict) else None}))
dist.destroy_process_group()
"""

STAGER = r"""
import json, torch
from meshtron.checkpoint.staging import OrderedStager, device_streams
x = torch.zeros(64 << 20, device="cuda")  # 256 MiB
a = torch.randn(4096, 4096, device="cuda")
stager = OrderedStager(True, device_streams())
ok = []
for trial in range(3):
    x.zero_()
    torch.cuda.synchronize()
    for _ in range(20):  # a queue of work the copy must wait for
        a = a @ a
        a = a / a.norm()
    x.add_(1.0)
    staged = stager.stage({"x": x}).result()
    ok.append(bool((staged["x"] == 1.0).all()))
    torch.cuda.synchronize()
stager.close()
print(json.dumps({"staged_after_queued_kernels": ok}))
"""

RNG = r"""
import json, torch
from meshtron.checkpoint.state import rng_state, set_rng_state
torch.cuda.manual_seed(3)
doc = rng_state()
want = torch.rand(4, device="cuda")
torch.rand(100, device="cuda")
set_rng_state(doc)
got = torch.rand(4, device="cuda")
print(json.dumps({"cuda_device": doc.get("cuda_device"), "restored": bool(torch.equal(want, got)),
                  "visible_gpus": torch.cuda.device_count()}))
"""

RECOMPUTE = r"""
import json, torch
from functools import partial
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from meshtron.parallel import recompute
class Count(TorchDispatchMode):
    calls = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default:
            Count.calls += 1
        return func(*args, **(kwargs or {}))
def f(x, w, offs):
    h = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    return torch.nn.functional.silu(h).float().sum()
def runs(saved):
    Count.calls = 0
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([64, 128, 192, 256], device="cuda", dtype=torch.int32)
    ctx = partial(create_selective_checkpoint_contexts, partial(recompute._selective_policy, saved))
    with Count():
        checkpoint(f, x, w, offs, use_reentrant=False, context_fn=ctx).backward()
    return Count.calls
saved = recompute._saved_ops()
print(json.dumps({"saved_runs": runs(saved),
                  "recomputed_runs": runs(saved - {torch.ops.aten._grouped_mm.default})}))
"""

CP_MASK = r"""
import json, time, torch, torch.nn.functional as F
from meshtron.parallel.context import ContextParallel, chunk_positions, flex_attention
dev = torch.device("cuda")
seq, batch = 1024, 2
cp = ContextParallel(None, cp=2, rank=1)
pos = chunk_positions(seq, 2, 1, dev)
first = cp.block_for(pos, None, None, batch, seq)
cached = cp.block_for(pos, None, None, batch, seq) is first
doc = torch.zeros(batch, seq, dtype=torch.long, device=dev); doc[:, 300:] = 1; doc[1, 700:] = 2
docs = cp.block_for(pos, doc[:, pos], doc, batch, seq)
q = torch.randn(batch, 8, seq // 2, 64, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(batch, 2, seq, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))
causal = torch.arange(seq, device=dev)[None, :] <= pos[:, None]
err = []
same_doc = doc[:, None, pos, None] == doc[:, None, None, :]
for block, mask in ((first, causal), (docs, causal & same_doc)):
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                          enable_gqa=True)
    err.append(float((flex_attention(q, k, v, block).float() - want).abs().max()))
# Memory of one block mask at 128k tokens over cp=8 (eager evaluated a dense grid: ~2 GB).
big = ContextParallel(None, cp=8, rank=3)
bpos = chunk_positions(131072, 8, 3, dev)
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
t0 = time.perf_counter()
big.block_for(bpos, None, None, 1, 131072)
torch.cuda.synchronize()
build_s = time.perf_counter() - t0
peak = torch.cuda.max_memory_allocated() - base
t0 = time.perf_counter()
big.block_for(bpos, None, None, 1, 131072)
again_s = time.perf_counter() - t0
print(json.dumps({"cached": cached, "max_abs_err_bf16": err, "mask_128k_peak_bytes": peak,
                  "mask_128k_build_s": round(build_s, 3), "mask_128k_again_s": round(again_s, 6)}))
"""

TESTS = ["tests/test_device_init.py", "tests/test_backend.py", "tests/test_staging.py",
         "tests/test_rng_state.py", "tests/test_recompute_ops.py", "tests/test_torch_compat.py"]


def cases(dry: bool, tmp: str) -> list[tuple[str, list[str], int]]:
    py = [sys.executable]
    dev = "cpu" if dry else "cuda"
    mt = py + ["-m", "meshtron"]
    steps = "2" if dry else "20"
    gpu_only = [("backend_nccl", py + ["-c", f"TMP={tmp!r}\n" + BACKEND], 90),
                ("stager_order", py + ["-c", STAGER], 60),
                ("rng_own_device", py + ["-c", RNG], 30),
                ("recompute_grouped_mm", py + ["-c", RECOMPUTE], 60),
                ("cp_block_mask", py + ["-c", CP_MASK], 180)]
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
