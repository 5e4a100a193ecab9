"""The human (rich) output of a plan search: the ranked table (100 columns by default, `wide`
adds the breakdowns per plan, hardware FLOP/s and GPU-hours; numbers are never cut short), the
notes under it, the header and `render`, which prints them with the best plan's breakdown and
why the others lose. planner/report.py holds the JSON and its schema."""

from __future__ import annotations

from meshtron.planner.estimate import Estimate
from meshtron.planner.memory_options import FRAGMENTATION, RESERVED_RATIO_HIGH
from meshtron.planner.report_format import (
    breakdown_line, fmt_days, fmt_gib, fmt_s, fmt_tflops, fmt_tokens, framework_of, fmt_count,
    layers_per_gpu, memory_line, options_line)
from meshtron.planner.report_warnings import warnings
from meshtron.planner.search import SearchResult
from meshtron.planner.search_explain import split_text


def _plural(n: int, one: str, many: str) -> str:
    return one if n == 1 else many.format(n)


def _layout(est: Estimate) -> str:
    c = est.config
    ep = f" ep{c.ep}" if c.ep > 1 else ""  # folded over dp: not a factor of the world size
    if getattr(c, "etp", None) is not None:  # Megatron-Core's folding over tp x cp x dp
        ep += f"/etp{c.etp}"
    # HSDP: dp as replicas x shard group (dp_replicate x dp_shard)
    dp = f"{c.dp_replicate}x{c.dp_shard}" if c.zero >= 2 and c.dp_replicate > 1 else f"{c.dp}"
    if c.cp > 1:  # the column reads tp/pp/dp; context parallelism joins tp as tp.cp
        return f"{c.tp}x{c.cp}cp/{c.pp}/{dp}{ep}"
    return f"{c.tp}/{c.pp}/{dp}{ep}"


def _table(result: SearchResult, tokens: float, wide: bool):
    from rich import box
    from rich.table import Table

    n = result.cluster.num_gpus
    title = ("Pinned layout, PREDICTED NOT TO FIT (priced anyway)" if result.pinned else
             _plural(len(result.plans), 'Top plan', 'Top {} plans'))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1, 0, 0),
                  title=f"{title} (time for {fmt_tokens(tokens)} tokens)")
    # a plan over capacity (a pinned layout: pinned.layout_pinned) reads "197.4>80" in mem GiB
    cols = ["#", "tp/pp/dp", "zero", "mb", "recomp", "sp", "schedule", "mem GiB", "step s",
            "tok/s", "MFU", "days"]
    if wide:
        cols[7:8] = ["mem GiB p/g/o/act/total/cap"]
        cols[8:9] = ["step s", "comp/tp/pp/dp/bubble/opt s"]
        cols += ["TFLOP/s mdl/hw", "HFU", "GPU-h"]
    for col in cols:
        left = col in ("recomp", "schedule", "tp/pp/dp")
        # labels ("interleaved:4", "2x8cp/1/4") and "197.4>80" are never folded mid-word
        whole = col in ("schedule", "tp/pp/dp", "recomp", "mem GiB")
        table.add_column(col, justify="left" if left else "right", overflow="fold",
                         no_wrap=whole)
    for i, e in enumerate(result.plans, 1):
        c, mem, t = e.config, e.memory, e.time
        off = c.offload_label()  # host offload, as Plan.describe says it
        row = [str(i), _layout(e), f"{c.zero} {off}" if off else str(c.zero),
               str(c.micro_batch), c.recompute,
               "on" if c.sp else "off", c.schedule_label(), f"{fmt_gib(mem.total)}{_over(e)}",
               fmt_s(e.step_time_s),
               f"{e.tokens_per_s:,.0f}", f"{e.mfu * 100:.1f}%", fmt_days(e.days(tokens))]
        if wide:
            row[7] = "/".join(fmt_gib(x) for x in (mem.params, mem.grads, mem.optimizer,
                                                    mem.activations, mem.total)) + _over(e)
            row[8:9] = [fmt_s(e.step_time_s), "/".join(fmt_s(x) for x in (
                t.compute, t.tp_comm, t.pp_comm, t.dp_comm, t.bubble, t.optimizer))]
            row += [f"{fmt_tflops(e.model_tflops_per_gpu)}/"
                    f"{fmt_tflops(e.hardware_tflops_per_gpu)}",
                    f"{e.hfu * 100:.1f}%", f"{e.gpu_hours(tokens, n):,.0f}"]
        table.add_row(*row)
    return table


def _over(e: Estimate) -> str:
    """The memory cell's capacity part: '/80', '>80' when the GPU is over capacity, '/80 host>'
    when only the host memory per node is (offload: the warning gives its figures)."""
    m = e.memory
    if m.total > m.capacity:
        return f">{m.capacity:g}"
    return f"/{m.capacity:g}" + ("" if m.host_fits else " host>")


def table_notes(result: SearchResult) -> list[str]:
    """What the table's compact labels and its order mean, when they need saying: the layout
    column's cp and ep marks, and plans tied on step time (ranked by simplicity, not memory:
    search.py)."""
    out = []
    if any(e.config.cp > 1 for e in result.plans):
        out.append("Layout column tp/pp/dp: 'TxCcp' is tensor parallelism T times context "
                   "parallelism C (each sequence split over C ranks), e.g. 2x8cp/1/4 = tp=2, "
                   "cp=8, pp=1, dp=4")
    if any(e.config.zero >= 2 and e.config.dp_replicate > 1 for e in result.plans):
        out.append("Layout column: dp 'RxS' is HSDP, R replicas of an S-rank sharded group "
                   "(dp_replicate=R), e.g. 2/1/2x4 = tp=2, pp=1, dp=8, dp_replicate=2")
    if any(e.config.ep > 1 for e in result.plans):
        out.append("Layout column: 'epE' is expert parallelism over E of the data ranks (not a "
                   "factor of the GPU count)"
                   + ("; 'epE/etpT': over E of the tensor x context x data ranks, each expert "
                      "split over T (Megatron-Core's folding)"
                      if any(getattr(e.config, "etp", None) is not None for e in result.plans)
                      else ""))
    if any(e.memory.total <= e.memory.capacity and not e.memory.host_fits
           for e in result.plans):
        out.append("Memory column: 'host>' is a plan whose GPUs fit but whose host memory per "
                   "node (host offload) does not")
    for note in (mfu_note(result), tight_note(result), megatron_zero_note(result)):
        if note:
            out.append(note)
    steps = [round(e.step_time_s, 9) for e in result.plans]
    ties = [i for i in range(1, len(steps)) if steps[i] == steps[i - 1]]
    if ties:
        i = ties[0]
        out.append(f"Plans {i} and {i + 1} tie on step time: ties go to the simpler plan (lower "
                   "ZeRO stage, less recomputation) even where it needs more memory, as long "
                   "as it fits")
    return out


def convention_notes(result: SearchResult) -> list[str]:
    """The notes a reader of `--json` needs to read its numbers as the stack means them (the
    table prints them among table_notes): what MFU counts, and what a Megatron-Core zero means."""
    return [n for n in (mfu_note(result), megatron_zero_note(result)) if n]


def tight_note(result: SearchResult) -> str | None:
    """The top plans whose headroom under the device is below the spread of the allocator
    allowance (memory_options.RESERVED_RATIO_HIGH: reserved/allocated up to 1.15 reported for
    LLM training, 8% allowed, FRAGMENTATION), one line, or None. Not with expandable segments
    (no allowance, no spread of it priced)."""
    mem = getattr(result.framework, "memory", None)
    frag = mem.fragmentation if mem is not None else FRAGMENTATION
    if frag <= 0:
        return None
    spread = RESERVED_RATIO_HIGH - 1.0 - frag
    tight = [(i, e) for i, e in enumerate(result.plans, 1)
             if e.memory.fits and e.memory.capacity - e.memory.total < spread * e.memory.allocated]
    if not tight:
        return None
    i, e = tight[0]
    ranks = ", ".join(str(j) for j, _ in tight)
    return (f"Tight: plan(s) {ranks} leave less headroom than the allocator allowance's spread "
            f"(plan {i}: {e.memory.capacity - e.memory.total:.1f} GiB free < "
            f"{spread * e.memory.allocated:.1f} GiB, {spread:.0%} of its tensors: reserved "
            f"memory runs up to {RESERVED_RATIO_HIGH:g}x the tensors, {frag:.0%} allowed); "
            "they may not fit at that end")


ATTENTION_SHARE_NOTED = 0.25
"""Share of the model FLOPs in the attention square from which the MFU column's convention is
said (`mfu_note`): 13% for a 70B Llama at 8k tokens, 71% at 128k."""


def mfu_note(result: SearchResult) -> str | None:
    """Where the attention square is a large share of the model FLOPs (long sequences), one
    line saying the MFU column counts it whole, as Megatron-LM (Narayanan et al. 2021, eq. 3)
    and PaLM (Chowdhery et al. 2022, appendix B: 6N + 12 L H Q T) do, with the best plan's MFU
    under a causal count (half the square, what causal attention kernels compute), and that
    HFU counts what the kernels execute (compute_flops.executed_square_share)."""
    best, model, seq = result.best, result.model, result.seq_len
    if best is None:
        return None
    total = model.flops_per_token(seq)
    square = total - model.flops_per_token(0)  # ModelSpec.flops_per_token's attention term
    share = square / total if total > 0 else 0.0
    if share < ATTENTION_SHARE_NOTED:
        return None
    causal = best.mfu * (total - square / 2) / total
    return (f"MFU column: model FLOPs count attention as the full {seq} x {seq} square "
            f"(Megatron-LM's and PaLM's convention), {share:.0%} of them here; counting the "
            f"causal half, the best plan's MFU is {causal * 100:.1f}%; the HFU column (--wide) "
            "counts the FLOPs the kernels execute (a causal flash kernel runs half the square, "
            "plus recomputation)")


def megatron_zero_note(result: SearchResult) -> str | None:
    """Which Megatron-Core sharding a shown zero 2 or 3 is (plan_rules_zero.STACK_ZEROS): only
    its own FSDP runs them; the distributed optimizer a user would reach for is zero 1, and
    keeps the whole gradient buffer (megatron/core/distributed/param_and_grad_buffer.py)."""
    if framework_of(result).memory.zero_stages != "megatron-core":
        return None
    if not any(e.config.zero >= 2 and e.config.dp > 1 for e in result.plans):
        return None
    return ("Zero column (Megatron-Core): zero 2 and 3 mean Megatron-FSDP (--use-custom-fsdp, "
            "--use-megatron-fsdp from core 0.14, with --data-parallel-sharding-strategy "
            "optim_grads for zero 2, optim_grads_params for zero 3), not "
            "--use-distributed-optimizer, which is zero 1 (the whole gradient buffer kept)")


def header(result: SearchResult) -> list[str]:
    m, cl = result.model, result.cluster
    n = cl.num_gpus
    device = cl.gpu or f"{cl.peak_tflops:g} TFLOP/s device"
    return [
        f"[bold]{m.name}[/] ({fmt_count(m.num_params())} params"
        f"{f', {fmt_count(m.num_params(active=True))} active' if m.is_moe else ''}) on "
        f"[bold]{cl.name}[/] "
        f"({n} x {device}, {cl.memory_gib:g} GiB); global batch {result.global_batch} x "
        f"{result.seq_len} tokens; {_plural(result.evaluated, '1 plan', '{} plans')} evaluated in "
        f"{result.seconds * 1000:.0f} ms",
        f"Stack: {framework_of(result).label} ({framework_of(result).models})",
        f"Cost model: {options_line(result.options, result.dtype)}",
    ]


def render(result: SearchResult, tokens: float, console, wide: bool = False) -> None:
    """Print the ranked table, the best plan's breakdown, what the search left out and why
    the others lose."""
    for line in header(result):
        console.print(line)
    for note in result.notes:
        console.print(f"Note: {note}")
    if not result.plans:
        return
    console.print(_table(result, tokens, wide))
    for line in table_notes(result):
        console.print(line)
    best = result.plans[0]
    n = result.cluster.num_gpus
    cl = result.cluster
    what = "Pinned plan" if result.pinned else "Best plan"
    for line in warnings(result):
        console.print(f"[bold red]Warning:[/] {line}")
    console.print(f"{what}: {breakdown_line(best)}")
    console.print(f"{what}: {memory_line(best)}")
    from meshtron.planner.snapshot_memory import snapshot_line

    if best.config.offload == "none":  # offloaded states already live on the host
        console.print(f"{what}: {snapshot_line(best.memory, best.config)}")
    if cl.price_per_gpu_hour is not None:
        cost = best.gpu_hours(tokens, n) * cl.price_per_gpu_hour
        console.print(f"{what} costs about {cost:,.0f} for {fmt_tokens(tokens)} tokens "
                      f"at {cl.price_per_gpu_hour:g} per GPU-hour.")
    c = best.config
    if c.pp > 1:
        per_gpu = layers_per_gpu(best)
        chunks = f" in {c.virtual_stages} chunks each" if c.virtual_stages > 1 else ""
        ends = ("embedding, LM head + loss on the first stage (torch's V)"
                if best.split is not None and best.split.head_first
                else "embedding on the first stage, LM head + loss on the last")
        console.print(f"Layers per pipeline rank of the {what.lower()}: {per_gpu}{chunks} "
                      f"({ends})")
        why = split_text(best)
        if why is not None and len(set(per_gpu)) > 1:
            console.print(f"Uneven split: {why}")
    if result.alternatives:
        console.print("[bold]Why the others lose[/] (vs the best plan):")
        for alt in result.alternatives:
            console.print(f"  - {alt.label}: {alt.reason}")
