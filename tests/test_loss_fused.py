"""meshtron/model/loss.py's fused linear cross-entropy: gradients computed in the loss's
forward (weight gradient accumulated in fp32 inside the GEMM), backward only scaling them.

Checked against the plain whole-logits loss (`F.cross_entropy` on fp32-upcast logits): fp32,
bf16 parameters (FSDP2's mixed-precision compute copy), ignored targets, a bias, an upstream
gradient other than 1, no host synchronisation and no GEMM in backward, and under FSDP2 on 2
gloo ranks against one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.model.loss import IGNORE_INDEX, OutputHead, chunked_cross_entropy
from testkit.multiproc import run_on_ranks


def _data(dtype=torch.float32, bias=False, tokens=(2, 37), hidden=16, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = OutputHead(hidden, vocab, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.3)
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=g))
    h = torch.randn(*tokens, hidden, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, tokens, generator=g)
    return head, h, t


def _plain(head, h, t):
    """The reference: whole logits, fp32 cross-entropy, gradients in fp64 so that only the
    fused loss's own rounding shows."""
    w = head.weight.detach().double().requires_grad_()
    b = None if head.bias is None else head.bias.detach().double().requires_grad_()
    x = h.detach().double().requires_grad_()
    loss = F.cross_entropy(F.linear(x, w, b).flatten(0, 1), t.flatten(),
                           ignore_index=IGNORE_INDEX)
    grads = torch.autograd.grad(loss, [x, w] + ([b] if b is not None else []))
    return loss.detach(), grads


def _fused(head, h, t, chunk=None, scale=1.0):
    loss = chunked_cross_entropy(head, h, t, chunk=chunk)
    params = [h, head.weight] + ([head.bias] if head.bias is not None else [])
    grads = torch.autograd.grad(loss * scale, params)
    return loss.detach(), grads


def _close(got, want, rel):
    return float((got.double() - want).abs().max()) <= rel * float(want.abs().max()) + 1e-12


@pytest.mark.parametrize("bias", [False, True])
def test_fp32_loss_and_gradients_equal_the_plain_loss(bias):
    head, h, t = _data(bias=bias)
    t[0, :9] = IGNORE_INDEX  # the mean runs over the other 65 targets
    t[1, -3:] = IGNORE_INDEX
    want_loss, want = _plain(head, h, t)
    for chunk in (1, 5, 37, 500):
        loss, got = _fused(head, h, t, chunk=chunk)
        assert abs(float(loss) - float(want_loss)) < 1e-6 * float(want_loss)
        for a, b in zip(got, want):
            assert a.dtype == h.dtype and _close(a, b, 1e-5)


def test_bf16_parameters_accumulate_the_weight_gradient_in_fp32():
    """bf16 head and hidden states (FSDP2's bf16 compute copies): bf16 logits and GEMMs, fp32
    softmax, and the weight gradient summed over 16 chunks in fp32 before one cast to bf16.
    Its error is one bf16 rounding of the exact gradient (plus the bf16 logits' effect on the
    softmax), not 15 bf16 additions: compared with the plain loss on the same bf16 inputs."""
    head, h, t = _data(torch.bfloat16, tokens=(4, 64), hidden=32, vocab=512)
    t[2] = IGNORE_INDEX
    want_loss, want = _plain(head, h, t)
    loss, got = _fused(head, h, t, chunk=16)
    assert loss.dtype == torch.float32
    assert abs(float(loss) - float(want_loss)) < 1e-2 * float(want_loss)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and _close(a, b, 2e-2)
    # the bf16 result is the rounding of the fused loss's own fp32 sum: fp32 copies of the same
    # bf16 inputs give a gradient whose bf16 rounding it is, bit for bit, within one ulp
    head32 = OutputHead(32, 512, bias=False)
    head32.weight.data.copy_(head.weight.data.float())
    h32 = h.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, got32 = _fused(head32, h32, t, chunk=16)
    ulp = 2.0 ** -7 * got32[1].abs()
    assert bool(((got[1].float() - got32[1]).abs() <= ulp + 1e-30).all())


def test_all_targets_ignored_gives_nan_loss_and_zero_gradients_as_the_plain_loss():
    """A micro-batch whose targets are all ignored (a prompt-only sample): the loss is 0/0 =
    nan and every gradient 0, as F.cross_entropy gives; no nan reaches the parameters."""
    head, h, t = _data()
    t.fill_(IGNORE_INDEX)
    want = F.cross_entropy(head(h).flatten(0, 1), t.flatten())
    want_grads = torch.autograd.grad(want, [h, head.weight])
    got = chunked_cross_entropy(head, h, t, chunk=8)
    got_grads = torch.autograd.grad(got, [h, head.weight])
    assert torch.isnan(want) and torch.isnan(got)
    for a, b in zip(got_grads, want_grads):
        assert bool((b == 0).all()) and bool((a == 0).all())


def test_upstream_gradient_scales_every_gradient_and_backward_runs_no_gemm():
    """loss * 3 (a gradient-accumulation scale, say): every gradient triples. Backward sees a
    0-d upstream gradient and only multiplies; no matrix product runs there (the head is not
    replayed) and nothing reads a tensor value back to the host anywhere in the step."""
    head, h, t = _data(bias=True)
    t[0, 0] = IGNORE_INDEX
    _, want = _fused(head, h, t, chunk=7)
    ops: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Ops():
        loss = chunked_cross_entropy(head, h, t, chunk=7)
    forward_ops = list(ops)
    ops.clear()
    with Ops():
        got = torch.autograd.grad(loss * 3.0, [h, head.weight, head.bias])
    for a, b in zip(got, want):
        assert torch.allclose(a, 3.0 * b, rtol=1e-6, atol=1e-8)
    assert any(o.startswith("addmm") for o in forward_ops)
    assert not [o for o in ops if o.split(".")[0] in ("mm", "addmm", "bmm", "linear")], ops
    assert "_local_scalar_dense" not in {o.split(".")[0] for o in forward_ops + ops}


def test_second_backward_fails_loudly_instead_of_scaling_twice():
    head, h, t = _data()
    loss = chunked_cross_entropy(head, h, t, chunk=8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through it runs once"):
        loss.backward()


def test_no_grad_and_frozen_inputs():
    """Eval (no grad) gives the same loss without building any gradient buffer; a frozen head
    still gives the input's gradient (and a detached input the weight's)."""
    head, h, t = _data()
    want_loss, want = _plain(head, h, t)
    sizes, w_ptr = [], head.weight.untyped_storage().data_ptr()

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() != w_ptr:
                sizes.append(out.numel())  # new storage (views of the weight left out)
            return out

    with torch.no_grad(), Sizes():
        loss = chunked_cross_entropy(head, h, t, chunk=8)
    assert abs(float(loss) - float(want_loss)) < 1e-6 * float(want_loss)
    assert max(sizes) < head.weight.numel()  # no [vocab, hidden] accumulator, no [tokens, vocab]
    head.weight.requires_grad_(False)
    (gh,) = torch.autograd.grad(chunked_cross_entropy(head, h, t, chunk=8), [h])
    assert _close(gh, want[0], 1e-5)
    head.weight.requires_grad_(True)
    (gw,) = torch.autograd.grad(chunked_cross_entropy(head, h.detach(), t, chunk=8),
                                [head.weight])
    assert _close(gw, want[1], 1e-5)


# ---- FSDP2 on 2 gloo ranks -----------------------------------------------------------------
def _fsdp_rank(steps: int) -> dict:
    """A block (Linear) and the OutputHead, each its own FSDP2 unit over 2 ranks; each rank
    takes its half of the batch (no ignored targets: equal counts, so the mean of the ranks'
    means is the whole batch's). Returns the full gradients after `steps` backward passes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, x, t = _fsdp_model_and_data()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.block, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rank, half = dist.get_rank(), x.shape[0] // 2
    xs, ts = x[rank * half:(rank + 1) * half], t[rank * half:(rank + 1) * half]
    for _ in range(steps):
        model(xs, ts).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.Linear(24, 24)
        self.head = OutputHead(24, 130, bias=False)

    def forward(self, x, t):
        return self.head(torch.tanh(self.block(x)), t)


def _fsdp_model_and_data():
    torch.manual_seed(0)
    model = _Tiny()
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(4, 19, 24, generator=g), torch.randint(0, 130, (4, 19), generator=g)


def test_fsdp2_two_ranks_give_the_single_process_gradients():
    """FSDP2 gathers the head's weight once for its call (a plain tensor inside the fused
    loss) and reduce-scatters the fp32 gradient the loss returns: the averaged gradients of
    two ranks on halves of the batch equal one process's on the whole batch, over 2 backward
    passes (accumulated)."""
    model, x, t = _fsdp_model_and_data()
    half = x.shape[0] // 2
    for _ in range(2):
        for r in range(2):
            (model(x[r * half:(r + 1) * half], t[r * half:(r + 1) * half]) / 2).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    results = run_on_ranks(_fsdp_rank, 2, 2, timeout=300)
    for got in results:
        assert set(got) == set(want)
        for n, g in want.items():
            assert (got[n] - g).abs().max() <= 1e-5 * g.abs().max(), n


def test_planner_prices_what_the_fused_loss_holds():
    """planner/memory_acts.py `chunked_loss_bytes` (less the final norm's part) against torch's
    memory tracker on fake tensors: the loss's forward peak in bf16 (the fp32 accumulator, the
    input gradient, one chunk's logits and their fp32 copy) beyond the weight and the input,
    and its backward's (the accumulator and its bf16 cast: the cast is the unit gradient the
    planner counts elsewhere), within 2%."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from meshtron.model.spec import ModelSpec
    from meshtron.planner import memory

    tokens, vocab, hidden = 2048, 16000, 1024
    spec = ModelSpec(name="t", layers=1, hidden=hidden, heads=8, kv_heads=8, ffn_hidden=2048,
                     vocab=vocab, max_seq=tokens)
    mem = memory.MemoryOptions(dtype="bf16", framework="fsdp2")
    head = OutputHead(hidden, vocab, bias=False).to(device="meta", dtype=torch.bfloat16)
    peaks = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        head.to_empty(device="cpu")
        h = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        t = torch.randint(0, vocab, (1, tokens))
        for phase in ("forward", "step"):
            tracker = MemTracker()
            tracker.track_external(head, h)
            with tracker:
                loss = head(h, t)
                if phase == "step":
                    loss.backward()
            peaks[phase] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    before = 2 * vocab * hidden + 2 * tokens * hidden  # the weight and the input
    planned = (memory.chunked_loss_bytes(spec, tokens, mem)
               - memory.final_norm_bytes(spec, tokens, mem))
    assert peaks["forward"] - before == pytest.approx(planned, rel=0.02)
    unit = 2 * vocab * hidden
    assert peaks["step"] - before - unit <= planned


@pytest.mark.parametrize("dtype,which", [(torch.float32, 1), (torch.bfloat16, 0)])
def test_planner_prices_every_elementwise_pass_of_a_chunk(dtype, which):
    """compute_edges.FUSED_LOSS_BYTES against the passes `_chunk` runs (torch's CPU profiler,
    ATen's own kernels: torch.logsumexp is amax, a subtraction into a new tensor, exp_ and sum,
    four passes, not one read). Each elementwise or reduction kernel over the [chunk, vocab]
    logits reads them at 4 bytes (fp32), writes 4 in place or into a new tensor; each dtype
    copy moves 2 + 4. GEMMs and the one-per-token gather/scatter are left out."""
    from torch.profiler import ProfilerActivity, profile

    from meshtron.model.loss import _chunk
    from meshtron.planner.compute_edges import FUSED_LOSS_BYTES

    c, hidden, vocab = 8, 16, 300
    g = torch.Generator().manual_seed(0)
    x = torch.randn(c, hidden, generator=g).to(dtype)
    w = torch.randn(vocab, hidden, generator=g).to(dtype)
    t = torch.randint(0, vocab, (c,), generator=g)
    grads = (torch.empty(c, hidden, dtype=dtype), torch.zeros(vocab, hidden), None)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 profile_memory=True) as prof:
        _chunk(x, w, None, t, torch.tensor(c), grads)
    passes = {"aten::amax", "aten::sum", "aten::sub", "aten::sub_", "aten::exp_",
              "aten::mul_", "aten::copy_"}
    per_logit, seen = 0.0, []
    for e in prof.events():
        if e.name not in passes or [c, vocab] not in e.input_shapes:
            continue
        seen.append(e.name)
        if e.name == "aten::copy_":  # a 16-bit <-> fp32 conversion
            per_logit += 2.0 + 4.0
            continue
        per_logit += 4.0 * sum(s == [c, vocab] for s in e.input_shapes)  # reads
        if e.name.endswith("_") or e.cpu_memory_usage >= 4 * c * vocab:  # writes
            per_logit += 4.0
    assert seen.count("aten::exp_") == 2 and "aten::amax" in seen, seen
    assert per_logit == FUSED_LOSS_BYTES[which], (seen, per_logit)


def _addmm_fp32_out(acc, a, b, out_dtype, out):
    """addmm with an fp32 output as CUDA's kernel has it (CPU: by upcasting)."""
    return torch.addmm(acc, a.float(), b.float(), out=out)


def _addmm_ignoring_acc(acc, a, b, out_dtype, out):
    """A kernel that writes the product over `out` (beta 0): the weight gradient would keep
    only the last chunk's."""
    return torch.mm(a.float(), b.float(), out=out)


def _addmm_rounding(acc, a, b, out_dtype, out):
    """A kernel that sums in the operands' 16-bit type before writing fp32."""
    return out.copy_(torch.addmm(acc.to(a.dtype), a, b))


def _addmm_refusing(acc, a, b, out_dtype, out):
    raise RuntimeError("addmm: out_dtype is not supported for these inputs")


@pytest.mark.parametrize("addmm, used", [(_addmm_fp32_out, True), (_addmm_ignoring_acc, False),
                                         (_addmm_rounding, False), (_addmm_refusing, False)])
def test_the_fp32_output_gemm_is_used_only_where_it_accumulates_exactly(addmm, used):
    """The CUDA branch of the weight-gradient accumulation (addmm into the fp32 buffer with
    out_dtype) runs only where the device's kernel adds to the buffer in fp32: probed with the
    kernel injected, since CPU torch has none. A kernel that overwrote the buffer or summed in
    bf16 would pass a probe that only checks the call is accepted."""
    from meshtron.model.loss import accumulates_in_fp32

    assert accumulates_in_fp32(addmm, torch.device("cpu"), torch.bfloat16) is used


def test_zero_bubble_split_backward_gets_each_gradient_once():
    """A zero-bubble schedule's last stage runs the loss node's backward twice: input
    gradients (retain_graph), then weight gradients from the saved incoming gradient (torch's
    own `stage_backward_input` / `stage_backward_weight`). With `split_backward` (set by
    meshtron/parallel/pipeline.py) both passes get the one-pass gradients, scaled once; a third
    backward still fails loudly."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    head, h, t = _data(bias=True)
    x = h * 1.0  # a stage input with a grad_fn, as a received activation's first use
    want = torch.autograd.grad(chunked_cross_entropy(head, x, t, chunk=8) * 0.5,
                               [h, head.weight, head.bias])
    head.split_backward = True
    loss = chunked_cross_entropy(head, h * 1.0, t, chunk=8) * 0.5
    (got_h,), groups = stage_backward_input([loss], None, [h], head.parameters())
    assert head.weight.grad is None  # the input pass leaves the weights alone
    stage_backward_weight(head.parameters(), groups)
    for a, b in zip((got_h, head.weight.grad, head.bias.grad), want):
        assert torch.equal(a, b)
    head.zero_grad()
    loss = chunked_cross_entropy(head, h, t, chunk=8)
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)  # the second expected pass: the same gradients again
    assert torch.equal(head.weight.grad, 2 * want[1] * 2)
    with pytest.raises(RuntimeError, match="backward through it runs once"):
        loss.backward()


def test_zero_bubble_loss_node_outlives_the_detached_stage_output():
    """The zero-bubble schedule detaches the last stage's output (the loss, as the stage
    returned it: parallel_model.py `stage_loss`) after the input pass and runs the weight pass
    later from the loss node. An autograd.Function's node is held only weakly by its Python
    object: torch 2.11 freed it with the detached output, and the weight pass raised
    "Attribute '_input_metadata' is invalid" (`meshtron train --nproc 2 --plan pp=2`, the
    planner's zb, on torch 2.11.0; the test above fails there without the anchor). The stage
    returns a copy; the Function's own output, kept on the head, owns the node until the
    next step releases it."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from meshtron.model.loss import release_anchors

    head, h, t = _data(bias=True)
    want = torch.autograd.grad(chunked_cross_entropy(head, h * 1.0, t, chunk=8),
                               [h, head.weight, head.bias])
    head.split_backward = True
    loss = chunked_cross_entropy(head, h * 1.0, t, chunk=8)
    fused = loss.grad_fn.next_functions[0][0]  # the Function's node, behind the copy
    assert type(fused).__name__ == "_FusedLinearCrossEntropyBackward"
    (got_h,), groups = stage_backward_input([loss], None, [h], head.parameters())
    assert loss.grad_fn is None  # detached by torch; the node lives on in the anchor
    assert [a.grad_fn for a in head.loss_anchors] == [fused]
    stage_backward_weight(head.parameters(), groups)
    for a, b in zip((got_h, head.weight.grad, head.bias.grad), want):
        assert torch.equal(a, b)
    release_anchors(head)
    assert "loss_anchors" not in head.__dict__
