"""Issue 31's device-explicit pieces, checked on the device (the `gputrue` case): each check is
a short script run in its own process (a CUDA fault or an NCCL group in one cannot take the
others down), its JSON line recorded, its failure recorded and not fatal.

stager_order     the checkpoint stager (checkpoint/staging.py, meshtron's own since torch
                 2.11's DefaultStager failed) copies a tensor only after the kernels queued
                 before `stage` (no host sync on the training thread)
rng_own_device   the RNG state saved and restored is the rank's own device's
recompute_grouped_mm  selective recompute saves the bf16 grouped GEMM (CUDA's MoE experts)
cp_attention     context parallelism: without documents SDPA's flash kernels per chunk (no
                 mask; forward and backward against dense SDPA), with documents the
                 FlexAttention block mask (compiled builder) against the dense mask, and one
                 document mask's build time and memory at 128k tokens over cp=8
backend_nccl     the one backend helper on a real "cuda:nccl,cpu:gloo" group: group_is_nccl,
                 doctor's Flight Recorder, the async-TP decision
loss_window      code added after the first GPU run: which weight-gradient GEMM the fused loss
                 takes (model/loss.py: addmm into fp32 where the probe finds it exact) and its
                 loss and gradients in bf16 against whole fp32 logits; sliding-window
                 attention's FlexAttention band (model/attention.py, compiled on CUDA) forward
                 and backward against the chunked path (CPU: forward, eager); the same with
                 packed documents, and a context-parallel rank's band with documents

Each script reads DEV (the device) and SMALL (dry run: toy sizes) from its first lines, so the
dry run executes the same scripts on the CPU (where the CUDA-only parts say what they skip).
bench/gputrue_check.py runs the same scripts standalone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from gpukit import common as C

STAGER = r"""
import json, torch
from meshtron.checkpoint.staging import OrderedStager, device_streams
dev = torch.device(DEV)
x = torch.zeros((1 << 16) if SMALL else (64 << 20), device=dev)  # 256 MiB on the GPU
a = torch.randn(256 if SMALL else 4096, 256 if SMALL else 4096, device=dev)
stager = OrderedStager(True, device_streams() if dev.type == "cuda" else None)
ok = []
for trial in range(3):
    x.zero_()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    for _ in range(20):  # a queue of work the copy must wait for
        a = a @ a
        a = a / a.norm()
    x.add_(1.0)
    staged = stager.stage({"x": x}).result()
    ok.append(bool((staged["x"] == 1.0).all()))
    if dev.type == "cuda":
        torch.cuda.synchronize()
stager.close()
print(json.dumps({"staged_after_queued_kernels": ok, "pinned": staged["x"].is_pinned()}))
"""

RNG = r"""
import json, torch
from meshtron.checkpoint.state import rng_state, set_rng_state
dev = torch.device(DEV)
torch.manual_seed(3)
if dev.type == "cuda":
    torch.cuda.manual_seed(3)
doc = rng_state()
want = torch.rand(4, device=dev)
torch.rand(100, device=dev)
set_rng_state(doc)
got = torch.rand(4, device=dev)
print(json.dumps({"cuda_device": doc.get("cuda_device"), "restored": bool(torch.equal(want, got)),
                  "visible_gpus": torch.cuda.device_count()}))
"""

RECOMPUTE = r"""
import json, torch
from functools import partial
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from meshtron.parallel import recompute
dev = torch.device(DEV)
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # CPU: fp32 grouped GEMM
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
    x = torch.randn(256, 128, device=dev, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 64, 128, device=dev, dtype=dtype, requires_grad=True)
    offs = torch.tensor([64, 128, 192, 256], device=dev, dtype=torch.int32)
    ctx = partial(create_selective_checkpoint_contexts, partial(recompute._selective_policy, saved))
    with Count():
        checkpoint(f, x, w, offs, use_reentrant=False, context_fn=ctx).backward()
    return Count.calls
saved = recompute._saved_ops()
print(json.dumps({"dtype": str(dtype), "saved_runs": runs(saved),
                  "recomputed_runs": runs(saved - {torch.ops.aten._grouped_mm.default})}))
"""

CP_ATTENTION = r"""
import json, time, torch, torch.nn.functional as F
from meshtron.parallel.context import block_mask, chunk_positions, flex_attention
from meshtron.parallel.cp_sdpa import chunk_attention, kernel_for
dev = torch.device(DEV)
cuda = dev.type == "cuda"
dtype = torch.bfloat16 if cuda else torch.float32
out = {"dtype": str(dtype)}
# No documents: SDPA's flash kernels per chunk, no mask (forward and backward vs dense SDPA).
c = 64 if SMALL else 512
q = torch.randn(2, 8, c, 128, device=dev, dtype=dtype, requires_grad=True)
k, v = (torch.randn(2, 2, 4 * c, 128, device=dev, dtype=dtype, requires_grad=True)
        for _ in range(2))
kern = kernel_for(q)
out["sdpa_kernel"] = None if kern is None else kern.name
if kern is not None:
    got = chunk_attention(q, k, v, 2, kern)
    dout = torch.randn_like(got)
    gq, gk, gv = torch.autograd.grad(got, (q, k, v), dout)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    end = 3 * c
    mask = torch.ones(c, end, dtype=torch.bool, device=dev).tril(end - c)
    want = F.scaled_dot_product_attention(qf, kf[:, :, :end], vf[:, :, :end], attn_mask=mask,
                                          enable_gqa=True)
    wq, wk, wv = torch.autograd.grad(want, (qf, kf, vf), dout.float())
    out["sdpa_max_abs_err"] = [float((a.float() - b).abs().max())
                               for a, b in ((got, want), (gq, wq), (gk, wk), (gv, wv))]
# Documents: FlexAttention's block mask (compiled builder on CUDA) vs the dense mask.
seq, batch = (256 if SMALL else 1024), 2
pos = chunk_positions(seq, 2, 1, dev)
doc = torch.zeros(batch, seq, dtype=torch.long, device=dev); doc[:, seq // 4:] = 1
doc[1, 2 * seq // 3:] = 2
block = block_mask(pos, doc[:, pos], doc, batch, seq)
q = torch.randn(batch, 8, seq // 2, 64, device=dev, dtype=dtype)
k, v = (torch.randn(batch, 2, seq, 64, device=dev, dtype=dtype) for _ in range(2))
mask = (torch.arange(seq, device=dev)[None, :] <= pos[:, None]) & (
    doc[:, None, pos, None] == doc[:, None, None, :])
want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                      enable_gqa=True)
out["flex_max_abs_err"] = float((flex_attention(q, k, v, block).float() - want).abs().max())
# Memory and time of one document block mask at 128k tokens over cp=8 (built every forward).
big_seq = 8192 if SMALL else 131072
bpos = chunk_positions(big_seq, 8, 3, dev)
bdoc = (torch.arange(big_seq, device=dev) // 4096)[None]  # 32 documents of 4096 tokens
if cuda:
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
for i in range(2):  # the first call compiles the builder
    t0 = time.perf_counter()
    block_mask(bpos, bdoc[:, bpos], bdoc, 1, big_seq)
    if cuda:
        torch.cuda.synchronize()
    out["mask_build_s" if i == 0 else "mask_again_s"] = round(time.perf_counter() - t0, 4)
if cuda:
    out["mask_peak_bytes"] = torch.cuda.max_memory_allocated() - base
out["mask_tokens"] = big_seq
print(json.dumps(out))
"""

BACKEND = r"""
import json, os, torch, torch.distributed as dist
from meshtron.backend import backend_for, group_is_nccl
from meshtron.doctor.session import _recorder
from meshtron.doctor.dump import flight_recorder_trace
from meshtron.parallel.compile import async_tp_problem
from meshtron.runtime import nccl_env
dev = torch.device(DEV)
if dev.type == "cuda":
    dev = torch.device("cuda", 0)
    for k, v in nccl_env().items():
        os.environ.setdefault(k, v)
store = dist.FileStore(os.path.join(TMP, f"store-{os.getpid()}"), 1)
dist.init_process_group(backend_for(dev.type), store=store, rank=0, world_size=1,
                        device_id=dev if dev.type == "cuda" else None)
t = torch.ones(4, device=dev)
dist.all_reduce(t)
if dev.type == "cuda":
    torch.cuda.synchronize()
trace = flight_recorder_trace()
print(json.dumps({"get_backend": str(dist.get_backend()), "group_is_nccl": group_is_nccl(),
                  "doctor_recorder": type(_recorder(0, 16)).__name__,
                  "async_tp_problem": async_tp_problem(dev.type, dist.get_backend()),
                  "flight_trace_entries": (len(trace.get("entries", [])) if isinstance(trace, dict)
                                           else None),
                  "flight_trace_error": trace.get("error") if isinstance(trace, dict) else None}))
dist.destroy_process_group()
"""

LOSS_WINDOW = r"""
import json, torch, torch.nn.functional as F
from meshtron.model.attention import window_attention
from meshtron.model.loss import OutputHead, _addmm_out_dtype, chunked_cross_entropy
dev = torch.device(DEV)
cuda = dev.type == "cuda"
dtype = torch.bfloat16 if cuda else torch.float32
g = torch.Generator().manual_seed(0)
out = {"dtype": str(dtype), "fp32_addmm": _addmm_out_dtype(str(dev), torch.bfloat16)}
# The fused loss (every gradient in its forward) against whole fp32 logits.
tokens, hidden, vocab = (256, 64, 1000) if SMALL else (8192, 1024, 32000)
head = OutputHead(hidden, vocab, bias=False)
with torch.no_grad():
    head.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.05)
head = head.to(dev, dtype)
h = (torch.randn(1, tokens, hidden, generator=g)).to(dev, dtype).requires_grad_()
t = torch.randint(0, vocab, (1, tokens), generator=g).to(dev)
loss = chunked_cross_entropy(head, h, t)
gh, gw = torch.autograd.grad(loss, (h, head.weight))
x, w = h.detach().float().requires_grad_(), head.weight.detach().float().requires_grad_()
ref = F.cross_entropy(F.linear(x, w).flatten(0, 1), t.flatten())
rh, rw = torch.autograd.grad(ref, (x, w))
rel = lambda a, b: float((a.float() - b).norm() / b.norm())
out["loss_rel_err"] = [abs(float(loss) - float(ref)) / float(ref), rel(gh, rh), rel(gw, rw)]
# Sliding-window attention: the FlexAttention band against the chunked path.
seq, window = (256, 64) if SMALL else (4096, 1024)
q = torch.randn(2, 8, seq, 128, generator=g).to(dev, dtype).requires_grad_()
k, v = (torch.randn(2, 2, seq, 128, generator=g).to(dev, dtype).requires_grad_()
        for _ in range(2))
if cuda:  # flex is the CUDA default; forward and backward
    got, want = window_attention(q, k, v, window), window_attention(q, k, v, window, "chunks")
    dout = torch.randn_like(got)
    grads = [torch.autograd.grad(o, (q, k, v), dout) for o in (got, want)]
    pairs = [(got, want), *zip(*grads)]
else:  # FlexAttention has no CPU backward (it refuses inputs that need one): the forward
    q, k, v = (x.detach() for x in (q, k, v))
    pairs = [(window_attention(q, k, v, window, "flex"),
              window_attention(q, k, v, window, "chunks"))]
out["window_rel_err"] = [rel(a, b.float()) for a, b in pairs]
# Windows with packed documents (one block mask of band and documents, built as the document
# mask is) and a context-parallel rank's band (cp=4, rank 1; with documents), each against the
# exact chunks (model/attention.py band_attention) on the same device.
from meshtron.model.attention import band_attention, document_mask
from meshtron.parallel.context import block_mask, chunk_positions, flex_attention
doc = (torch.arange(seq, device=dev) // (window // 2 + 3)).expand(2, seq).contiguous()
pos = chunk_positions(seq, 4, 1, dev)
c = seq // 8
lq = q.detach()[:, :, pos].requires_grad_(cuda)
runs = [(lambda: window_attention(q, k, v, window, mask=document_mask(doc, "flex", window)),
         lambda: window_attention(q, k, v, window, mask=document_mask(doc, "segments", window)),
         (q, k, v)),
        (lambda: flex_attention(lq, k, v, block_mask(pos, doc[:, pos], doc, 2, seq, window)),
         lambda: torch.cat([band_attention(lq[:, :, i * c:(i + 1) * c], k, v, window, j * c, doc)
                            for i, j in enumerate((1, 6))], dim=2), (lq, k, v))]
pairs = []
for flex_run, exact_run, inputs in runs:
    got, want = flex_run(), exact_run()
    pairs.append((got, want))
    if cuda:
        dout = torch.randn_like(got)
        pairs += zip(*[torch.autograd.grad(o, inputs, dout) for o in (got, want)])
out["window_documents_rel_err"] = [rel(a, b.float()) for a, b in pairs]
print(json.dumps(out))
"""

# (name, script, GPU cap seconds): never verified on a GPU first; backend_nccl passed there.
CHECKS = [("stager_order", STAGER, 40), ("rng_own_device", RNG, 30),
          ("recompute_grouped_mm", RECOMPUTE, 30), ("cp_attention", CP_ATTENTION, 90),
          ("backend_nccl", BACKEND, 30),
          # two more FlexAttention compiles (windows with documents, a CP rank's band): never
          # run on a GPU, estimated ~10 s each from cp_attention's flex compile (7-9 s there)
          ("loss_window", LOSS_WINDOW, 90)]


def script(body: str, device: str, small: bool, tmp: str) -> str:
    """A check's program: its inputs as the first lines, then the check."""
    return f"DEV = {device!r}\nSMALL = {small!r}\nTMP = {tmp!r}\n" + body


def run_check(name: str, body: str, cap: float, device: str, small: bool,
              tmp: Path) -> dict:
    """One check in its own process: its JSON line, exit code, seconds; the output's tail on
    failure."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", script(body, device, small, str(tmp))],
                              capture_output=True, text=True, timeout=cap, env=C.child_env(),
                              cwd=tmp)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        rc, text = "timeout", out.decode(errors="replace") if isinstance(out, bytes) else out
    rec: dict = {"exit_code": rc, "seconds": round(time.perf_counter() - t0, 2)}
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    try:
        rec["result"] = json.loads(lines[-1]) if lines else None
    except ValueError:
        rec["result"] = None
    if name == "shared":
        rec["lines"] = lines
    if rc != 0 or rec["result"] is None:
        rec["output_tail"] = text.splitlines()[-12:]
    return rec


def verdicts(results: dict) -> dict:
    """What each check's figures say (None: the check did not report)."""
    def get(name, key):
        return ((results.get(name) or {}).get("result") or {}).get(key)

    staged = get("stager_order", "staged_after_queued_kernels")
    sdpa, flex = get("cp_attention", "sdpa_max_abs_err"), get("cp_attention", "flex_max_abs_err")
    loss, window = get("loss_window", "loss_rel_err"), get("loss_window", "window_rel_err")
    window_docs = get("loss_window", "window_documents_rel_err")
    return {"stager_ordered": None if staged is None else all(staged),
            "rng_restored": get("rng_own_device", "restored"),
            "grouped_mm_saved": None if get("recompute_grouped_mm", "saved_runs") is None
            else get("recompute_grouped_mm", "saved_runs")
            < get("recompute_grouped_mm", "recomputed_runs"),
            # bf16 on the GPU: a few units of its last place against an fp32 reference
            "cp_sdpa_exact": None if sdpa is None else max(sdpa) < 0.05,
            "cp_flex_exact": None if flex is None else flex < 0.05,
            # relative errors (norms): bf16 on the GPU against fp32 references
            "fused_loss_exact": None if loss is None else max(loss) < 0.02,
            "window_flex_exact": None if window is None else max(window) < 0.02,
            "window_documents_flex_exact": None if window_docs is None
            else max(window_docs) < 0.02}


SHARED = r"""
import contextlib, io, json, traceback
for name, body in CHECKS_IN:
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(body, name, "exec"), {"__name__": "__check__"})
        print(json.dumps({"check": name, "exit_code": 0, "out": buf.getvalue()}), flush=True)
    except BaseException:
        print(json.dumps({"check": name, "exit_code": 1, "out": buf.getvalue(),
                          "error": traceback.format_exc().splitlines()[-12:]}), flush=True)
"""


def run_shared(device: str, small: bool, tmp: Path, cap: float) -> dict:
    """Every check in one process, one after another (one torch import instead of five);
    each check's line is printed as it ends, so those before a crash keep their result."""
    bodies = [(n, script(b, device, small, str(tmp))) for n, b, _ in CHECKS]
    rec = run_check("shared", f"CHECKS_IN = {bodies!r}\n" + SHARED, cap, device, small, tmp)
    t = rec["seconds"]
    out = {}
    for line in (rec.get("lines") or []):
        r = json.loads(line)
        body = [ln for ln in r["out"].splitlines() if ln.startswith("{")]
        out[r["check"]] = {"exit_code": r["exit_code"], "seconds": None, "shared_process_s": t,
                           "result": json.loads(body[-1]) if body else None,
                           **({"output_tail": r["error"]} if r.get("error") else {})}
    for name, _, _ in CHECKS:  # a check the shared process never reached (cap, crash)
        out.setdefault(name, {"exit_code": rec["exit_code"], "result": None,
                              "output_tail": rec.get("output_tail", [])})
    return out


def case_gputrue(ctx: C.Ctx) -> None:
    """Every check in one process (one torch import and CUDA start-up, ~7 s on the H200,
    instead of five); a check that did not report there (a CUDA fault or a hang took the
    process down before it ran, or it failed) runs again alone, in its own process, so one
    check never costs another's result."""
    device = "cpu" if ctx.dry_run else "cuda"
    tmp = ctx.work / "gputrue"
    tmp.mkdir(exist_ok=True)
    cap = 240 if ctx.dry_run else sum(c for *_, c in CHECKS)
    results = run_shared(device, ctx.dry_run, tmp, cap)
    ctx.emit(checks=results, verdicts=verdicts(results), shared_process=True)
    for name, body, cap in CHECKS:
        if results[name]["exit_code"] != 0 or results[name]["result"] is None:
            first = results[name]
            results[name] = run_check(name, body, cap * (3 if ctx.dry_run else 1), device,
                                      ctx.dry_run, tmp)
            results[name]["shared_process_attempt"] = first
            ctx.emit(checks=results, verdicts=verdicts(results))
    failed = [n for n, r in results.items() if r["exit_code"] != 0]
    if failed:
        raise RuntimeError(f"gputrue checks failed: {', '.join(failed)}")


# The CPU tests of the device-explicit pieces and of what this kit checks, under the torch the
# GPU image carries (2.11 there; CI pins 2.13): private symbols, the torchrun argv, staging,
# RNG state, recompute ops, the CP flash kernels, the calibration choice, sliding windows'
# FlexAttention path traced inside compiled blocks.
TORCH_TESTS = ["tests/test_torch_compat.py", "tests/test_device_init.py", "tests/test_backend.py",
               "tests/test_staging.py", "tests/test_rng_state.py", "tests/test_recompute_ops.py",
               "tests/test_device_cluster.py", "tests/test_cp_sdpa_cuda_calls.py",
               "tests/test_pipeline_inference_names.py", "tests/test_window_compiled.py",
               "tests/test_loss_fused.py::test_zero_bubble_split_backward_gets_each_gradient_once",
               "tests/test_loss_fused.py::test_zero_bubble_loss_node_outlives_the_detached_stage_"
               "output",
               "tests/test_context_parallel.py::test_flash_chunks_trace_under_fullgraph_compile",
               "tests/test_launcher.py::test_torchrun_argv_parses_with_torchruns_own_parser",
               "tests/test_launcher.py::test_every_rank_group_is_made_in_one_place",
               "tests/test_launcher.py::test_a_rank_takes_its_local_gpu_and_makes_it_current",
               "tests/test_fp8_numerics.py::test_fp8_needs_compute_capability_8_9_on_cuda",
               "tests/test_train_syncs.py::test_batch_bound_for_cuda_is_page_locked_first",
               "tests/test_doctor_recorder.py::test_recording_group_is_judged_by_the_methods_"
               "torch_has",
               "tests/test_rehearse_moe.py::test_a_stage_of_dense_first_blocks_is_priced_as_its_"
               "own_blocks",  # builds an ep mesh: DeviceMesh._unflatten by index (2.11)
               "tests/test_context_parallel.py::test_without_documents_each_chunk_runs_the_"
               "flash_kernels_without_a_mask"]


def case_torch_tests(ctx: C.Ctx) -> None:
    """pytest on TORCH_TESTS (dry run: the last one only, the plumbing); pass/fail counts and
    the failures' summary lines. Needs pytest on the machine (its wheels can travel in .whl/:
    pytest, pluggy, iniconfig, packaging)."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        ctx.emit(skipped="pytest is not installed here (carry its wheels in .whl/)")
        return
    files = TORCH_TESTS[-1:] if ctx.dry_run else TORCH_TESTS
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-m", "not slow", "-rf", *files], capture_output=True, text=True,
                          cwd=C.ROOT, env=C.child_env())
    lines = proc.stdout.splitlines()
    ctx.emit(files=files, exit_code=proc.returncode, seconds=time.perf_counter() - t0,
             summary=lines[-1] if lines else "", failed=[x for x in lines
                                                          if x.startswith("FAILED")][:30])
    if proc.returncode != 0:
        raise RuntimeError(f"torch tests: {lines[-1] if lines else proc.stderr[-300:]}")
