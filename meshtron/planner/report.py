"""Human (rich) and machine (JSON) output of a plan search.

The table fits 100 columns by default (`render(..., wide=False)`): layout, knobs, memory of
the fullest GPU against capacity, step time, tokens/s, MFU and days; the best plan's time and
memory breakdown follow on their own lines. `wide=True` (`meshtron plan --wide`) adds the
breakdowns per plan, hardware FLOP/s and GPU-hours. Numbers are never cut short: columns wrap
rather than end in an ellipsis. Every output states the cost model's options (all fields of
KernelOptions, e.g. the attention kernel and the software stack) and the run precision.

JSON schema "meshtron-plan-search/3" (`meshtron plan --json`)::

    {
      "schema": "meshtron-plan-search/3",
      "model": {"name": str, "params": int, "layers": int, "hidden": int, "heads": int,
                "kv_heads": int, "vocab": int},
      "cluster": {ClusterSpec fields..., "num_gpus": int},
      "global_batch": int, "seq_len": int, "tokens": float,      # tokens = training budget
      "options": {every KernelOptions field: "attention", "dropout", ..., "dtype": str},
      "framework": {"name", "era", "models", "source", "reduce_dtype", "overrides": {...},
                    "kernel": {KernelOptions}, "memory": {MemoryOptions but dtype}},
      "fits": bool,                                               # the best plan fits
      "pinned": bool,             # the knobs leave one layout and nothing of it fits: plans
                                  # = [its leanest candidate priced as candidates are (the
                                  # time-balanced layer split), "fits": false]
      "fit_change": {"change": str,                               # pinned: the fastest plan
                     "fixed_changed": {knob: [pinned, fits]},     # of the layout that fits
                     "searched_changed": {knob: [pinned, fits]},  # with one fixed knob freed
                     plan object} | null,                         # (else all of them)
      "warnings": [str],          # "... cannot split this pinned layout ...: priced instead
                                  # on ...", "predicted not to fit: ..."
      "memory_checked": str|null, # what the stack's memory figure was checked against
                                  # (report.memory_check; null: nothing)
      "evaluated": int,           # full evaluations, the searches for fit_change included
      "feasible": int, "search_time_s": float,
      "notes": [str],                                             # knob families left out, why
      "plans": [                  # best first, at most --top; every one fits unless "pinned"
        {"rank": int, "tp": int, "pp": int, "dp": int, "ep": int, "zero": int, "micro_batch": int,
         "num_microbatches": int, "recompute": str, "sp": bool,
         "schedule": str|null,                                    # null when pp = 1
         "virtual_stages": int, "dp_replicate": int, "dtype": str,
         "pipeline_runs": int,                                    # only when > 1
         "stage_layers": [int],
         "split": {"layers_per_stage": [int], "even": bool,      # pp > 1 only: the layers per
                   "why": str},                                 # rank and why (the plan's
                                                                # own, the stack's rule, or
                                                                # memory: split_text)
         "fits": bool,                                            # memory <= capacity (and
                                                                  # the host's, with offload)
         "memory_gib": {"params", "grads", "optimizer", "activations", "logits",
                        "workspace", "total", "capacity": float, "stage": int,
                        "host": float,                            # per node, host offload
                        "host_capacity": float|null},             # usable; null: unknown
         "time_s": {"compute", "tp_comm", "pp_comm", "dp_comm_exposed", "bubble",
                    "optimizer", "ep_comm": float,                # exact 0.0 when absent
                    "offload", "step_host", "fp8_sync": float},   # only when > 0
                    # (step_host: Composer's train-metric sync, planner/composer_metrics.py;
                    # fp8_sync: delayed scaling's amax all-reduces, planner/fp8_amax.py)
         "step_time_s": float, "tokens_per_s": float,
         "model_tflops_per_gpu": float, "hardware_tflops_per_gpu": float,
         "mfu": float, "hfu": float,                              # fractions of peak
         "days": float, "gpu_hours": float, "cost": float|null}   # for `tokens`
      ],
      "alternatives": [{"family": str, "reason": str, "fits": bool, "layout": str|null,
                        "step_time_s": float|null, "memory_gib": float|null}],
      "near_miss": plan object (as above, fits = false) | null    # only when nothing fits:
                                  # the least memory any candidate needs, on the layer split
                                  # that minimises it ("needs at least")
    }

Version 3 (was 2): a pinned layout that does not fit is answered (`plans` holds it with
"fits": false; top-level "fits" is false), and `pinned`, `fit_change` and `warnings` are new.
Version 2 (was 1): `schedule` is null without a pipeline, plans carry `dtype` and
`dp_replicate`, `options` carries `dtype`, and `notes` is new.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtron.planner.memory_options import FRAGMENTATION, RESERVED_RATIO_HIGH
from meshtron.planner.estimate import Estimate
from meshtron.planner.search import SearchResult
from meshtron.planner.search_explain import split_text

SCHEMA = "meshtron-plan-search/3"


def to_json(result: SearchResult, tokens: float) -> dict[str, Any]:
    n = result.cluster.num_gpus
    price = result.cluster.price_per_gpu_hour
    m = result.model
    plans = []
    for i, est in enumerate(result.plans, 1):
        plans.append({"rank": i, **est.to_dict(tokens, n, price), **split_json(est)})
    return {
        "schema": SCHEMA,
        "model": {"name": m.name, "params": m.num_params(), "layers": m.layers,
                  "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads, "vocab": m.vocab,
                  **({"active_params": m.num_params(active=True)} if m.is_moe else {})},
        "cluster": {**result.cluster.to_dict(), "num_gpus": n},
        "global_batch": result.global_batch, "seq_len": result.seq_len, "tokens": tokens,
        "options": {**options_dict(result.options), "dtype": result.dtype},
        "framework": _framework(result).to_dict(),
        "fits": result.fits, "pinned": result.pinned,
        "fit_change": (result.fit_change.to_dict(tokens, n, price)
                       if result.fit_change is not None else None),
        "warnings": warnings(result),
        "memory_checked": memory_check(result.framework),
        "evaluated": result.evaluated, "feasible": result.feasible,
        "search_time_s": result.seconds,
        "notes": list(result.notes),
        "plans": plans,
        "alternatives": [a.to_dict() for a in result.alternatives],
        "near_miss": (result.near_miss.to_dict(tokens, n, price)
                      if result.near_miss is not None else None),
    }


def split_json(est: Estimate) -> dict[str, Any]:
    """{"split": ...} for a pipelined plan (search_explain.split_text), else {}."""
    why = split_text(est)
    if why is None:
        return {}
    per_gpu = _per_gpu(est)
    return {"split": {"layers_per_stage": per_gpu, "even": len(set(per_gpu)) == 1,
                      "why": why}}


def _framework(result: SearchResult):
    from meshtron.planner.frameworks import preset

    return result.framework if result.framework is not None else preset(None)


# ---- number formatting -------------------------------------------------------------------------
def options_dict(options: Any) -> dict[str, Any]:
    """Every field of the cost model's options (a dataclass), whatever fields it grows."""
    if dataclasses.is_dataclass(options):
        return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    return dict(vars(options))


HEADLINE_OPTIONS = ("stack", "attention", "dropout", "sharding")
"""Cost-model options every text output states; the others appear only when they differ from
their defaults (a planning run for meshtron's own runtime leaves them all at default). The JSON
output carries all of them."""


def options_line(options: Any, dtype: str) -> str:
    """'stack=eager, attention=flash, ..., dtype=bf16': the assumptions behind every figure."""
    values = options_dict(options)
    defaults = options_dict(type(options)()) if dataclasses.is_dataclass(options) else {}
    shown = [n for n in HEADLINE_OPTIONS if n in values]
    shown += [n for n in values if n not in HEADLINE_OPTIONS and defaults.get(n, ...) != values[n]]
    parts = []
    for name in shown:
        value = values[name]
        if isinstance(value, bool):
            value = "on" if value else "off"
        parts.append(f"{name}={value}")
    return ", ".join(parts + [f"dtype={dtype}"])


def fmt_count(x: float) -> str:
    """1234 -> '1.23K', 6.7e9 -> '6.74B': three significant digits with a unit (rounded
    before the unit is picked: 999.9e6 -> '1B', not '1e+03M')."""
    x = float(f"{x:.3g}")
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def fmt_tokens(x: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= div:
            return f"{x / div:g}{unit}"
    return f"{x:g}"


def fmt_s(x: float) -> str:
    """Seconds, three significant digits; an exact zero stays '0'."""
    if x == 0:
        return "0"
    if x >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def fmt_days(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def _plural(n: int, one: str, many: str) -> str:
    return one if n == 1 else many.format(n)


def _layout(est: Estimate) -> str:
    c = est.config
    ep = f" ep{c.ep}" if c.ep > 1 else ""  # folded over dp: not a factor of the world size
    if getattr(c, "etp", None) is not None:  # Megatron-Core's folding over tp x cp x dp
        ep += f"/etp{c.etp}"
    if c.cp > 1:  # the column reads tp/pp/dp; context parallelism joins tp as tp.cp
        return f"{c.tp}x{c.cp}cp/{c.pp}/{c.dp}{ep}"
    return f"{c.tp}/{c.pp}/{c.dp}{ep}"


def breakdown_line(est: Estimate) -> str:
    t = est.time
    return (f"step {fmt_s(est.step_time_s)} s = compute {fmt_s(t.compute)} + tensor-parallel "
            f"{fmt_s(t.tp_comm)} + pipeline {fmt_s(t.pp_comm)} + data-parallel exposed "
            f"{fmt_s(t.dp_comm)} + bubble {fmt_s(t.bubble)} + optimizer {fmt_s(t.optimizer)}"
            + (f" (on the host) + host-link copies {fmt_s(t.offload)} (offload="
               f"{est.config.offload})" if est.config.offload != "none" else "")
            + (f" + expert all-to-all {fmt_s(t.ep_comm)}" if t.ep_comm else "")
            # TimeBreakdown.step_host is Composer's train-metric sync, no other stack's
            + (f" + train-metric sync on the host at the step's end {fmt_s(t.step_host)}"
               if t.step_host else "")
            # TimeBreakdown.fp8_sync: Transformer Engine's delayed-scaling amax all-reduces
            + (f" + FP8 amax all-reduces {fmt_s(t.fp8_sync)}" if t.fp8_sync else ""))


def memory_line(est: Estimate) -> str:
    m = est.memory
    return (f"memory of the fullest GPU (stage {m.stage}, {m.dtype}): {m.describe()} = "
            f"{m.total:.3g} of {m.capacity:g} GiB" + host_text(m))


def host_text(m) -> str:
    """'; host memory per node ...' for a plan with host offload, else ''."""
    if not m.host:
        return ""
    cap = "unknown capacity" if m.host_capacity is None else f"{m.host_capacity:.4g} GiB usable"
    return f"; host memory per node (offload): {m.host:.4g} GiB of {cap}"


# ---- the table ----------------------------------------------------------------------------------
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
               "on" if c.sp else "off", c.schedule_label(), f"{mem.total:.1f}{_over(e)}",
               fmt_s(e.step_time_s),
               f"{e.tokens_per_s:,.0f}", f"{e.mfu * 100:.1f}%", fmt_days(e.days(tokens))]
        if wide:
            row[7] = (f"{mem.params:.1f}/{mem.grads:.1f}/{mem.optimizer:.1f}/"
                      f"{mem.activations:.1f}/{mem.total:.1f}{_over(e)}")
            row[8:9] = [fmt_s(e.step_time_s), "/".join(fmt_s(x) for x in (
                t.compute, t.tp_comm, t.pp_comm, t.dp_comm, t.bubble, t.optimizer))]
            row += [f"{e.model_tflops_per_gpu:.0f}/{e.hardware_tflops_per_gpu:.0f}",
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
    for note in (mfu_note(result), tight_note(result)):
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
    under a causal count (half the square, what causal attention kernels compute)."""
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
            f"causal half, the best plan's MFU is {causal * 100:.1f}%")


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
        f"Stack: {_framework(result).label} ({_framework(result).models})",
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
        per_gpu = _per_gpu(best)
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


def need_text(est: Estimate, parts: bool = True, lean: Estimate | None = None) -> str:
    """'needs 93.1 GiB per GPU > 80 GiB (params .. + ..)' (`parts`: with the breakdown; `lean`:
    the same config on the layer split needing the least, stated as 'at least' when lower), or
    the host's shortfall when the devices fit and only the host memory per node does not."""
    m = est.memory
    if m.total <= m.capacity and not m.host_fits:
        return (f"needs {m.host:.1f} GiB of host memory per node > {m.host_capacity:.4g} GiB "
                f"usable (offload={est.config.offload})")
    text = (f"needs {m.total:.1f} GiB per GPU > {m.capacity:g} GiB"
            + (f" ({m.describe()})" if parts else ""))
    if lean is not None and lean.config == est.config and lean.memory.total < m.total - 0.05:
        text += (f"; at least {lean.memory.total:.1f} GiB on the layer split needing the "
                 f"least ({_per_gpu(lean)} layers per GPU)")
    return text


def _per_gpu(est: Estimate) -> list[int]:
    """Layers per pipeline rank (stage_layers lists the virtual stages in pipeline order; torch's
    V holds stages r and 2pp-1-r on rank r: Estimate.layers_per_rank)."""
    return est.layers_per_rank


def memory_check(framework: Any) -> str | None:
    """What the memory figure of a plan priced for `framework` was checked against, per stack
    (None: nothing). Only meshtron's runtime is rehearsed (`meshtron rehearse` runs its own
    modules; the 5% table is tests/test_rehearse.py); an FSDP2 stack (torchtitan, llm-foundry)
    shares the layout that rehearsal checks but not its code; Megatron-Core's terms are checked
    against its code (tests/test_memory_megatron.py), not against a run; DeepSpeed's against
    nothing."""
    if framework is None or framework.name == "meshtron":
        return "within 5% of a rehearsal of meshtron's runtime"
    kind = framework.memory.framework
    if kind == "fsdp2":
        return (f"FSDP2's layout, which a rehearsal of meshtron's runtime checks within 5%; "
                f"{framework.label}'s own code is not rehearsed")
    if kind == "megatron":
        return ("term by term against Megatron-Core's and Transformer Engine's code, not "
                "against a rehearsal or a run")
    return None


def trust_text(est: Estimate, framework: Any,
               check: str = "`--rehearse` checks this rank") -> str:
    """How far to trust a GPU-memory shortfall: what the figure was checked against for the
    stack priced (`memory_check`); another stack's own savings are not modelled (nor is the
    host memory of offload rehearsed)."""
    if est.memory.total <= est.memory.capacity:
        return ""
    checked = memory_check(framework)
    if framework is None or framework.name == "meshtron":
        return f"the memory model is {checked}; {check}; "
    against = f"checked: {checked}" if checked else "checked against no rehearsal or run"
    return (f"{framework.label}'s memory is modelled, not rehearsed ({against}; its own "
            "savings beyond the model are not counted); ")


def warnings(result: SearchResult) -> list[str]:
    """What the answer to a pinned layout does not say by itself: the stack's rule could not
    split it (`split_warning`), it is predicted not to fit (`pinned_warning`)."""
    out = [split_warning(result)] if result.split_fallback is not None and result.plans else []
    return out + ([pinned_warning(result)] if result.pinned else [])


def split_warning(result: SearchResult, est: Estimate | None = None) -> str:
    """The one warning of a pinned layout the stack's layer-to-stage rule cannot split, priced
    on the nearest split its engine could be configured to (search_space.SplitFallback), as
    `est` (default: the best plan) splits it."""
    from meshtron.planner.pipeline_split import configured_as

    fb, est = result.split_fallback, est or result.best
    per_gpu, v = _per_gpu(est), est.config.virtual_stages
    chunks = f" ({v} chunks each)" if v > 1 else ""
    label = _framework(result).label
    return (f"{label} cannot split this pinned layout as published: {fb.refusal}; priced "
            f"instead on {','.join(map(str, per_gpu))} layers per stage{chunks}, "
            f"{configured_as(fb.stack, fb.priced, per_gpu, v)}. The split (and a --save'd "
            f"plan, which meshtron's runtime runs as priced) is not {label}'s own")


def pinned_warning(result: SearchResult) -> str:
    """The one warning of a pinned layout priced although predicted not to fit: what it needs,
    how far to trust that, and the cheapest change that fits (pinned.FitChange)."""
    est = result.best
    change = result.fit_change
    if change is not None:
        fit = change.estimate
        delta = fit.step_time_s / est.step_time_s - 1.0  # step time vs the pinned plan
        to_fit = (f"to fit: {change.label} ({fmt_s(fit.step_time_s)} s per step, {delta:+.1%} "
                  f"vs the pinned plan; {fit.memory.total:.1f} GiB)")
    else:
        # each fixed knob was freed, then all together: every value was tried
        to_fit = ("no value of recompute, zero, micro-batch, sp, schedule or offload fits this "
                  "layout: change the layout")
    return (f"predicted not to fit: {need_text(est, lean=result.near_miss)}; "
            f"{trust_text(est, result.framework)}{to_fit}")


def render_no_fit(result: SearchResult, console) -> str:
    """Explain a model that fits nowhere; returns the one-line error for stderr."""
    nm = result.near_miss
    if nm is None:
        if result.refused:
            return f"no plan: {result.refused}"
        return "no plan: no layout is valid for this model, cluster and batch"
    mem = nm.memory
    if mem.total <= mem.capacity and not mem.host_fits:
        console.print(
            f"[bold red]Nothing fits.[/] The leanest plan, {nm.config.describe()}, fits in "
            f"device memory only with host offload, and then needs {mem.host:.1f} GiB of host "
            f"memory per node > {mem.host_capacity:.4g} GiB usable.")
        return (f"model={result.model.name}: fits on no layout of {result.cluster.name}; with "
                f"host offload it needs {mem.host:.1f} GiB of host memory per node > "
                f"{mem.host_capacity:.4g} GiB usable (cluster.host_memory_gib; near miss: "
                f"{nm.config.describe()})")
    console.print(
        f"[bold red]Nothing fits.[/] The leanest plan, {nm.config.describe()}, needs "
        f"{mem.total:.1f} GiB per GPU ({mem.describe()}) > {mem.capacity:g} GiB; "
        f"it would run at {fmt_s(nm.step_time_s)} s per step if it fitted.")
    return (f"model={result.model.name}: fits on no layout of {result.cluster.name}; needs at "
            f"least {mem.total:.1f} GiB per GPU > {mem.capacity:g} GiB (near miss: "
            f"{nm.config.describe()})")
