"""What an answer to a plan search does not say by itself: how far short of memory a plan is
(`need_text`) and how far to trust that (`memory_check`, `trust_text`), the warnings of a
pinned layout (`warnings`: the stack cannot split it, it is predicted not to fit) and the
explanation of a model that fits nowhere (`render_no_fit`)."""

from __future__ import annotations

from typing import Any

from meshtron.planner.estimate import Estimate
from meshtron.planner.report_format import fmt_s, framework_of, layers_per_gpu
from meshtron.planner.search import SearchResult


def need_text(est: Estimate, parts: bool = True, lean: Estimate | None = None) -> str:
    """'needs 93.1 GiB per GPU > 80 GiB (params .. + ..)' (`parts`: with the breakdown; `lean`:
    the same config on the layer split needing the least, stated as 'at least' when lower), or
    the host's shortfall when the devices fit and only the host memory per node does not."""
    m = est.memory
    if m.total <= m.capacity and not m.host_fits:
        return (f"needs {m.host:.1f} GiB of host memory per node > {m.host_capacity:.4g} GiB "
                f"usable (offload={est.config.offload})")
    text = (f"needs {m.total:.1f} GiB per {m.device} > {m.capacity:g} GiB"
            + (f" ({m.describe()})" if parts else ""))
    if lean is not None and lean.config == est.config and lean.memory.total < m.total - 0.05:
        text += (f"; at least {lean.memory.total:.1f} GiB on the layer split needing the "
                 f"least ({layers_per_gpu(lean)} layers per {m.device})")
    return text


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
    per_gpu, v = layers_per_gpu(est), est.config.virtual_stages
    chunks = f" ({v} chunks each)" if v > 1 else ""
    label = framework_of(result).label
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
        f"{mem.total:.1f} GiB per {mem.device} ({mem.describe()}) > {mem.capacity:g} GiB; "
        f"it would run at {fmt_s(nm.step_time_s)} s per step if it fitted.")
    return (f"model={result.model.name}: fits on no layout of {result.cluster.name}; needs at "
            f"least {mem.total:.1f} GiB per {mem.device} > {mem.capacity:g} GiB (near miss: "
            f"{nm.config.describe()})")
