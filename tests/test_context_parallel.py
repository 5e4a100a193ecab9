"""Context parallelism (meshtron/parallel/context.py) on real gloo process groups.

One 4-rank launch: cp=4 over the world, cp=2 over the pairs {0,1}, {2,3}, and tp=2 (with
sequence parallelism) x cp=2 on a ("cp", "tp") DeviceMesh; for each, causal
and packed-document masks (documents crossing chunk boundaries) and recomputation none / full /
selective, a GQA model with YaRN RoPE (global positions matter) runs 2 AdamW steps on its chunks
(loss / cp backward, gradients summed over the cp group) and must give the single-process loss,
every gradient and every parameter (fp32 tolerance). Two steps (session 53; three before): the
second is the first to run forward and backward on parameters and moments AdamW wrote, a third
repeated it. The same launch counts the collectives of
one forward + backward (kinds, counts, bytes) against the formula, and checks FlexAttention's
document block mask (the CUDA path; forward only, as CPU FlexAttention has no backward) against
the CPU mask path, and its sliding-window block masks (windows of 3 and 6, with and without
documents) against attend_window's CPU path over the real group, and the halo path's block
masks (all-sliding models, windows reaching into two and three chunks). Sliding blocks (a
Gemma-3-style model, float64, documents) at cp=4 and cp=2 with windows shorter than a chunk, of
a whole chunk, reaching into two and three chunks, and near the sequence: one process's loss
and gradients, and what moved (the halo all_to_all's rows, counted position by position, where
the halo pays; the whole-sequence all-gather otherwise). Bad input:
a sequence that does not split into 2*cp chunks, a model with learned positions -> one line.
"""

from __future__ import annotations

import pytest
import torch

from meshtron.errors import UserError
from testkit.multiproc import run_on_ranks

EOS = 258
SEQ, BATCH, STEPS = 32, 2, 2
TOL = 1e-5
EOS_AT = {0: (5, 13, 14, 27), 1: (2, 19)}  # documents cross the 4- and 8-token chunk boundaries


def _spec():
    from meshtron.model.spec import PRESETS

    return PRESETS["debug"].replace(rope_type="yarn", rope_factor=2.0, rope_original_max_seq=16)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        for row, cols in EOS_AT.items():
            x[row, list(cols)] = EOS
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _run(cp_group, cp, rank, documents, recompute, tp_mesh=None):
    """(losses, grads per step, final params) of the reference (cp_group None) or a cp rank;
    with `tp_mesh`, tensor + sequence parallelism first (the runtime's order: TP, recompute,
    then CP), loss under loss_parallel, gradients and parameters compared as full tensors."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from meshtron.model.transformer import Transformer, cross_entropy_loss
    from meshtron.parallel.context import apply_context_parallel, shard_batch
    from meshtron.parallel.recompute import apply_recompute
    from meshtron.parallel.tensor import apply_tensor_parallel

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.clone()

    model = Transformer(_spec(), init_seed=7)
    if documents:
        model.document_eos = EOS
    loss_context = contextlib.nullcontext
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import loss_parallel

        apply_tensor_parallel(model, tp_mesh, sp=True)
        loss_context = loss_parallel
    if cp_group is not None:
        apply_recompute(model, recompute)
        apply_context_parallel(model, cp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses, grads = [], []
    for x, y in _batches():
        if cp_group is None:
            loss = cross_entropy_loss(model(x), y)
            loss.backward()
        else:
            shard = shard_batch(x, y, cp, rank)
            with loss_context():
                loss = cross_entropy_loss(model(shard.tokens), shard.targets)
                (loss / cp).backward()  # the global mean: every rank holds seq/cp tokens
            loss = full(loss.detach())
            dist.all_reduce(loss, group=cp_group)
            loss /= cp
            for p in model.parameters():
                if isinstance(p.grad, DTensor):  # TP: grads laid out like their parameters
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad,
                                group=cp_group)
        losses.append(loss.item())
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): full(p.grad)
                      for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    params = {n.replace("_checkpoint_wrapped_module.", ""): full(p.detach())
              for n, p in model.named_parameters()}
    return losses, grads, params


def _worst(ref, got) -> dict:
    r_loss, r_grads, r_params = ref
    losses, grads, params = got
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, r_loss))
    grad = max(((g[n] - rg[n]).abs().max() / rg[n].abs().max().clamp_min(1e-6)).item()
               for g, rg in zip(grads, r_grads) for n in rg)
    param, worst = max((((params[n] - r_params[n]).abs().max()
                         / r_params[n].abs().max().clamp_min(1e-2)).item(), n) for n in r_params)
    return {"loss": loss, "grad": grad, "param": param, "worst": worst,
            "names": sorted(params) == sorted(r_params)}


def _count_collectives(group, cp, documents, recompute) -> dict:
    """Collective kinds, counts and bytes of one forward + backward, seen by a dispatch mode
    (functional collectives, as issued by context.py)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshtron.model.transformer import Transformer, cross_entropy_loss
    from meshtron.parallel.context import apply_context_parallel, shard_batch
    from meshtron.parallel.recompute import apply_recompute

    seen: dict[str, list[int]] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (func.namespace in ("_c10d_functional", "c10d")
                    and not func.__name__.startswith(("wait", "_wrap"))):  # not collectives
                kind = func.__name__.split(".")[0]
                entry = seen.setdefault(kind, [0, 0])
                entry[0] += 1
                entry[1] += out.numel() * out.element_size()
            return out

    model = Transformer(_spec(), init_seed=7)
    if documents:
        model.document_eos = EOS
    apply_recompute(model, recompute)
    apply_context_parallel(model, group)
    x, y = _batches()[0]
    shard = shard_batch(x, y, cp, group.rank())
    with Count():
        cross_entropy_loss(model(shard.tokens), shard.targets).backward()
    return {k: tuple(v) for k, v in seen.items()}


def _flex_matches_mask_path(group, cp, rank) -> float:
    """The CUDA path (FlexAttention block mask) against the CPU path, causal and documents,
    and with sliding windows (3: shorter than a chunk of 4; 6) through attend_window."""
    from meshtron.model.transformer import document_positions
    from meshtron.parallel.context import (ContextParallel, _gather_sequence, block_mask,
                                           chunk_positions, flex_attention)

    g = torch.Generator().manual_seed(rank)
    q = torch.randn(BATCH, 4, SEQ // cp, 16, generator=g)
    k = torch.randn(BATCH, 2, SEQ // cp, 16, generator=g)
    v = torch.randn(BATCH, 2, SEQ // cp, 16, generator=g)
    doc, _ = document_positions(_batches()[0][0], EOS)
    pos = chunk_positions(SEQ, cp, rank)
    worst = 0.0
    with torch.no_grad():
        for q_doc, kv_doc in ((None, None), (doc[:, pos], doc)):
            for window in (0, 3, 6):
                ref = (ContextParallel(group).attend_window(q, k, v, window, kv_doc) if window
                       else ContextParallel(group).attend(q, k, v, q_doc, kv_doc))
                block = block_mask(pos, q_doc, kv_doc, BATCH, SEQ, window)
                flex = flex_attention(q, _gather_sequence(k, group, cp, 2),
                                      _gather_sequence(v, group, cp, 2), block)
                worst = max(worst, (flex - ref).abs().max().item())
    return worst


def _flex_model_matches_mask_path(group) -> dict:
    """What a GPU runs under CP, layer by layer (`ContextParallel.kernel = "flex"`: the block
    masks `context` hands each layer, eager FlexAttention, forward) against the CPU path: a
    Gemma-3-style debug model (block 0 slides in a window of 3, shorter than a chunk of 4, at a
    RoPE base of its own; block 1 global) and all-sliding ones (windows of 6 and 13, reaching
    into two and three chunks: no plain document mask built), with and without documents.
    Returns the worst logit difference and which block masks were built (the flex path must
    have run)."""
    from meshtron.model.transformer import Transformer
    from meshtron.parallel.context import apply_context_parallel, shard_batch

    out = {"worst": 0.0, "blocks": {}}
    for window, every in ((3, 2), (6, 0), (13, 0)):
        spec = _spec().replace(sliding_window=window, window_every=every, rope_local_theta=100.0)
        for documents in (False, True):
            model = Transformer(spec, init_seed=7)
            model.document_eos = EOS if documents else None
            cp = apply_context_parallel(model, group)
            tokens = shard_batch(_batches()[0][0], None, cp.cp, cp.rank).tokens
            with torch.no_grad():
                want = model(tokens)
                cp.kernel = "flex"
                got = model(tokens)
                ctx = cp.context(tokens, model)
            out["worst"] = max(out["worst"], (got - want).abs().max().item())
            out["blocks"][window, documents] = (ctx.attend.keywords["block"] is not None,
                                               ctx.window_attend.keywords["block"] is not None)
    return out


class _Count:
    """Collective kinds -> (calls, output bytes) seen by a dispatch mode (functional
    collectives, as issued by context.py)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if (func.namespace in ("_c10d_functional", "c10d")
                        and not func.__name__.startswith(("wait", "_wrap"))):
                    entry = seen.setdefault(func.__name__.split(".")[0], [0, 0])
                    entry[0] += 1
                    entry[1] += out.numel() * out.element_size()
                return out

        self.mode = Mode()


# cp -> windows (c = SEQ / 2cp): shorter than a chunk, reaching into two chunks, into three (cp 4:
# chunk b's rows before it include the rank's chunk a), a whole chunk (cp 2), and long enough
# that the halo would move as much as the gather (the whole sequence gathered instead)
HALO_WINDOWS = {4: (3, 6, 13, 25), 2: (3, 9, 12, 17)}
FP32_WINDOWS = {4: (6, 13), 2: (12,)}
"""The windows over several chunks run in float32 too (the dtype a run trains in)."""


def _halo_rows_moved(seq: int, cp: int, rank: int, window: int) -> tuple[int, int] | None:
    """(rows received, rows sent) by `rank` in the halo exchange, counted position by
    position (the keys each rank's queries see, less the rows it holds), or None where they
    are not fewer than the gather's (cp-1)/cp x seq on every rank."""
    c = seq // (2 * cp)

    def own(r):
        return set(range(r * c, (r + 1) * c)) | set(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))

    def needed(r):
        return {p for q in own(r) for p in range(max(0, q - window + 1), q + 1)} - own(r)

    if max(len(needed(r)) for r in range(cp)) >= (cp - 1) * seq // cp:
        return None
    return len(needed(rank)), sum(len(needed(d) & own(rank)) for d in range(cp) if d != rank)


def _window_matches_one_process(group, cp: int, rank: int) -> dict:
    """A Gemma-3-style debug model (block 0 slides, block 1 global), documents crossing the
    chunk borders: one forward + backward under CP against one process for each of
    HALO_WINDOWS[cp] in float64 and FP32_WINDOWS[cp] in float32; (worst loss and gradient
    differences, collectives seen) per (dtype, window)."""
    import torch.distributed as dist

    from meshtron.model.transformer import Transformer, cross_entropy_loss
    from meshtron.parallel.context import apply_context_parallel, shard_batch

    x, y = _batches()[0]
    out = {}
    for dtype, window in ([("float64", w) for w in HALO_WINDOWS[cp]]
                          + [("float32", w) for w in FP32_WINDOWS[cp]]):
        torch.set_default_dtype(getattr(torch, dtype))
        spec = _spec().replace(sliding_window=window, window_every=2, rope_local_theta=100.0)
        ref = Transformer(spec, init_seed=7)
        ref.document_eos = EOS
        ref_loss = cross_entropy_loss(ref(x), y)
        ref_loss.backward()
        model = Transformer(spec, init_seed=7)
        model.document_eos = EOS
        apply_context_parallel(model, group)
        shard = shard_batch(x, y, cp, rank)
        count = _Count()
        with count.mode:
            loss = cross_entropy_loss(model(shard.tokens), shard.targets)
            (loss / cp).backward()
        loss = loss.detach()
        dist.all_reduce(loss, group=group)
        grad = 0.0
        for (n, p), rp in zip(model.named_parameters(), ref.parameters()):
            dist.all_reduce(p.grad, group=group)
            grad = max(grad, ((p.grad - rp.grad).abs().max() / rp.grad.abs().max()).item())
        out[dtype, window] = {"loss": abs(loss.item() / cp - ref_loss.item()), "grad": grad,
                       "collectives": {k: tuple(v) for k, v in count.seen.items()}}
    torch.set_default_dtype(torch.float32)
    return out


# (dtype, cp, documents, recompute): the default suite runs one of each kind; float64 shows the
# computation is the single-process function up to rounding.
DEFAULT_CASES = [("float32", 4, False, "none"), ("float32", 4, True, "selective"),
                 ("float32", 2, False, "full"), ("float32", 2, True, "none"),
                 ("float32", "tp2cp2", True, "selective"), ("float64", 4, True, "none")]
ALL_CASES = [(d, cp, doc, rc) for d in ("float32", "float64") for cp in (4, 2, "tp2cp2")
             for doc in (False, True) for rc in ("none", "full", "selective")]


def cp_rank_fn(cases: list[tuple]) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    layouts = {4: (dist.group.WORLD, rank), 2: (pairs[rank // 2], rank % 2)}
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))  # torchtitan's order
    out: dict = {"equal": {}}
    refs: dict = {}
    for dtype, cp, doc, recompute in cases:
        torch.set_default_dtype(getattr(torch, dtype))
        if (dtype, doc) not in refs:
            refs[dtype, doc] = _run(None, 1, 0, doc, "none")
        if cp == "tp2cp2":
            got = _run(mesh["cp"].get_group(), 2, mesh.get_local_rank("cp"), doc, recompute,
                       tp_mesh=mesh["tp"])
        else:
            group, cp_rank = layouts[cp]
            got = _run(group, cp, cp_rank, doc, recompute)
        out["equal"][(dtype, cp, doc, recompute)] = _worst(refs[dtype, doc], got)
    torch.set_default_dtype(torch.float32)
    out["collectives"] = {(doc, rc): _count_collectives(dist.group.WORLD, 4, doc, rc)
                          for doc in (False, True) for rc in ("none", "full", "selective")}
    out["flex"] = _flex_matches_mask_path(dist.group.WORLD, 4, rank)
    out["flex_model"] = _flex_model_matches_mask_path(dist.group.WORLD)
    out["window"] = {4: _window_matches_one_process(dist.group.WORLD, 4, rank),
                     2: _window_matches_one_process(pairs[rank // 2], 2, rank % 2)}
    return out


def test_context_parallel_matches_one_process():
    _check(run_on_ranks(cp_rank_fn, 4, DEFAULT_CASES, timeout=300))


@pytest.mark.slow
def test_context_parallel_every_combination():
    _check(run_on_ranks(cp_rank_fn, 4, ALL_CASES, timeout=600))


def _check(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        for key, worst in res["equal"].items():
            assert worst["names"], (rank, key)
            # fp32: summation order differs (attention per chunk, gradients summed over ranks):
            # gradients agree to ~3e-6 of their largest element, and AdamW's normalised step
            # amplifies that on elements whose gradient is ~eps (parameters to ~1.5e-5). In
            # float64 the same runs agree to ~1e-14: the computation is the same function.
            # (The loss is computed in fp32 in both: cross_entropy_loss.)
            tol = {"float32": (TOL, TOL, 5e-5), "float64": (TOL, 1e-12, 1e-12)}[key[0]]
            if key[:2] == ("float64", "tp2cp2"):
                # cross_entropy_loss runs in fp32, and loss_parallel's vocabulary-parallel
                # backward rounds dlogits differently from aten's: ~1e-7 of the gradients.
                tol = (TOL, 1e-6, 1e-6)
            assert (worst["loss"] < tol[0] and worst["grad"] < tol[1]
                    and worst["param"] < tol[2]), (rank, key, worst)
        assert res["flex"] < 1e-5, (rank, res["flex"])
        # (global blocks' document mask, sliding blocks' band mask) built; none for global
        # blocks without documents (flash kernels) or where every block slides
        assert res["flex_model"]["worst"] < 1e-5, (rank, res["flex_model"])
        assert res["flex_model"]["blocks"] == {(3, False): (False, True), (3, True): (True, True),
                                               (6, False): (False, True), (6, True): (False, True),
                                               (13, False): (False, True),
                                               (13, True): (False, True)}, res["flex_model"]
        _check_windows(rank, res["window"])
    spec = _spec()
    # Per layer, forward: all-gather of K and of V, each the full sequence's kv heads in fp32;
    # backward: one reduce-scatter each of the same size (its input; a rank receives 1/cp).
    # Full recomputation gathers K and V again in backward; selective keeps the gathered
    # tensors (collective outputs are saved). Documents add one all-gather of the token ids
    # per forward (outside the recomputed blocks).
    L = spec.layers
    kv_bytes = BATCH * spec.kv_heads * SEQ * spec.head_dim * 4
    for (doc, recompute), seen in results[0]["collectives"].items():
        gathers = 2 * L * (2 if recompute == "full" else 1)
        expected = {"all_gather_into_tensor": (gathers + doc, gathers * kv_bytes + doc * BATCH * SEQ * 8),
                    "reduce_scatter_tensor": (2 * L, 2 * L * kv_bytes // 4)}
        assert seen == expected, (doc, recompute, seen)


def _check_windows(rank: int, windows: dict) -> None:
    """Sliding blocks under CP: the one-process loss and gradients (float64: the same
    function), and what moved: where the halo pays, the rows before the local chunks that
    their windows reach, each once, from the ranks holding them (one all_to_all of K and V;
    backward the same rows' gradients the other way) and K/V gathered only for the global
    block; a window so long that the halo would move as much as the gather gathers
    everything."""
    spec = _spec()
    row = BATCH * spec.kv_heads * 2 * spec.head_dim  # one position's K and V, elements
    for cp, results in windows.items():
        cp_rank = rank % cp
        for (dtype, window), got in results.items():
            # float64: the same function up to rounding; float32: the fp32 runs' tolerance
            tol = 1e-12 if dtype == "float64" else TOL
            assert got["loss"] < TOL and got["grad"] < tol, (rank, cp, window, got)
            seen = got["collectives"]
            moved = _halo_rows_moved(SEQ, cp, cp_rank, window)
            if moved is not None:
                size = {"float64": 8, "float32": 4}[dtype]
                assert seen["all_to_all_single"] == (2, sum(moved) * row * size), (rank, cp,
                                                                                 window, seen)
                assert seen["all_gather_into_tensor"][0] == 2 + 1, seen  # global K, V; doc ids
            else:
                assert "all_to_all_single" not in seen, (rank, cp, window, seen)
                assert seen["all_gather_into_tensor"][0] == 2 * spec.layers + 1, seen


def test_bad_input_is_one_line():
    from meshtron.model.spec import PRESETS
    from meshtron.model.transformer import Transformer
    from meshtron.parallel.context import apply_context_parallel, chunk_positions

    with pytest.raises(UserError, match=r"^data.seq_len=36: context parallelism cp=4 cuts every "
                                        r"sequence into 2\*cp=8 equal chunks; use a multiple of 8$"):
        chunk_positions(36, 4, 0)
    with torch.device("meta"):
        gpt = Transformer(PRESETS["tiny-gpt"], init_seed=0)
    with pytest.raises(UserError, match=r"^model.position='learned': context parallelism needs"):
        apply_context_parallel(gpt, None)


def test_chunks_cover_the_sequence_balanced():
    from meshtron.parallel.context import chunk_positions

    for cp in (1, 2, 4):
        allpos = torch.cat([chunk_positions(32, cp, r) for r in range(cp)])
        assert sorted(allpos.tolist()) == list(range(32))
        # causal work (sum of positions + 1) is equal on every rank
        work = {int((chunk_positions(32, cp, r) + 1).sum()) for r in range(cp)}
        assert len(work) == 1


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.seen[name] = self.seen.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_without_documents_each_chunk_runs_the_flash_kernels_without_a_mask(dtype):
    """Issue 31: a query chunk's attention is SDPA's flash kernel on the square diagonal block
    (is_causal) and on the prefix before it (no mask), merged by log-sum-exp; forward and
    backward equal the masked reference (the CPU kernel here; the CUDA one is the same code
    with the CUDA ops, checked by the GPU kit's gputrue case). Chunk 0 has no prefix."""
    import torch.nn.functional as F

    from meshtron.parallel.cp_sdpa import chunk_attention, kernel_for

    g = torch.Generator().manual_seed(0)
    b, heads, kv, d, c = 2, 8, 2, 16, 8
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 0.04}[dtype]
    for chunk in (0, 1, 3):
        seq = (chunk + 2) * c  # keys beyond the chunk's prefix exist and get no gradient
        q = torch.randn(b, heads, c, d, generator=g, dtype=torch.float64)
        k, v = (torch.randn(b, kv, seq, d, generator=g, dtype=torch.float64)
                for _ in range(2))
        dout = torch.randn(b, heads, c, d, generator=g, dtype=torch.float64)
        got_in = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        ops = _CountOps()
        with ops:
            out = chunk_attention(*got_in, chunk, kernel_for(got_in[0]))
            out.backward(dout.to(dtype))
        flash = ops.seen.get("_scaled_dot_product_flash_attention_for_cpu", 0)
        assert flash == (1 if chunk == 0 else 2), ops.seen
        assert ops.seen.get("_scaled_dot_product_flash_attention_for_cpu_backward") == flash
        assert "tril" not in ops.seen and "logical_and" not in ops.seen  # no mask is built
        ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        end = (chunk + 1) * c
        mask = torch.ones(c, end, dtype=torch.bool).tril(end - c)
        ref = F.scaled_dot_product_attention(ref_in[0], ref_in[1][:, :, :end],
                                             ref_in[2][:, :, :end], attn_mask=mask,
                                             enable_gqa=True)
        ref.backward(dout)
        assert (out.double() - ref).abs().max() < tol, (chunk, dtype)
        for a, r in zip(got_in, ref_in):
            assert (a.grad.double() - r.grad).abs().max() < tol * 2, (chunk, dtype)
        assert not got_in[1].grad[:, :, end:].any()


def test_document_block_mask_is_exact_and_compiled_on_cuda():
    """With documents the CUDA path's FlexAttention block mask (built per forward by the
    compiled builder on CUDA) equals the dense causal-and-document mask."""
    import torch.nn.functional as F

    from meshtron.model.attention import _compiled
    from meshtron.parallel.context import block_mask, chunk_positions, flex_attention
    from meshtron.parallel.cp_flex import mask_builder

    pos = chunk_positions(SEQ, 2, 1)
    doc = torch.zeros(BATCH, SEQ, dtype=torch.long)
    doc[:, SEQ // 2:] = 1
    doc[1, 3 * SEQ // 4:] = 2
    block = block_mask(pos, doc[:, pos], doc, BATCH, SEQ)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, 4, SEQ // 2, 16, generator=g)
    k, v = (torch.randn(BATCH, 2, SEQ, 16, generator=g) for _ in range(2))
    mask = (torch.arange(SEQ)[None, :] <= pos[:, None]) & (doc[:, None, pos, None]
                                                             == doc[:, None, None, :])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with torch.no_grad():
        assert (flex_attention(q, k, v, block) - want).abs().max() < 1e-5
    assert mask_builder(torch.device("cuda")) is _compiled("create_block_mask")
    assert mask_builder(torch.device("cpu")) is not _compiled("create_block_mask")


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor",
                                                               marks=pytest.mark.slow)])
def test_flash_chunks_trace_under_fullgraph_compile(backend):
    """The last SDPA attempt (lower-right causal bias) did not trace under
    torch.compile(fullgraph=True), which compiled blocks use; the per-chunk flash path does and
    gives eager's output and gradients."""
    from meshtron.parallel.cp_sdpa import chunk_attention, kernel_for

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 64, 16, generator=g, requires_grad=True) for _ in range(2))

    def rank_attention(q, k, v):  # rank 1 of cp=4: chunks 1 and 6 of 8
        kern = kernel_for(q)
        return torch.cat([chunk_attention(q[:, :, :8], k, v, 1, kern),
                          chunk_attention(q[:, :, 8:], k, v, 6, kern)], dim=2)

    want = rank_attention(q, k, v)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    torch._dynamo.reset()
    got = torch.compile(rank_attention, fullgraph=True, backend=backend)(q, k, v)
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    assert (got - want).abs().max() < 1e-5
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max() < 1e-5
