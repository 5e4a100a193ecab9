"""What a saved plan was priced for beyond its layout (Plan.framework, Plan.framework_options):
their field rules, and the runtime rule that meshtron's runtime runs plans priced for meshtron
only (plan.runtime_problem). Torch-free; the stack itself is resolved by frameworks.for_plan."""

from __future__ import annotations

from typing import Any, Mapping

from meshtron.errors import UserError


def option_pairs(options: Any) -> tuple[tuple[str, Any], ...]:
    """plan.framework_options as (name, value) pairs: a file's table or the pairs themselves;
    each value a TOML scalar (what an [options] table or a flag gives)."""
    if isinstance(options, Mapping):
        options = tuple(options.items())
    if not isinstance(options, (tuple, list)) or not all(
            isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str)
            for p in options):
        raise UserError(f"plan.framework_options={options!r}: must be a table of option "
                        "values ([framework_options], as `meshtron plan --save` writes)")
    for name, value in options:
        if not isinstance(value, (bool, int, float, str)):
            raise UserError(f"plan.framework_options.{name}={value!r}: must be a number, a "
                            "string or true/false")
    return tuple((name, value) for name, value in options)


def framework_field_problem(framework: Any) -> str | None:
    """plan.framework's type (its name is resolved where the plan is priced:
    frameworks.for_plan); None when fine."""
    if framework is None or (isinstance(framework, str) and framework.strip()):
        return None
    return (f"plan.framework={framework!r}: must be a stack's NAME@ERA (meshtron plan "
            "--framework), or absent for meshtron's runtime")


def runs_on_meshtron(plan) -> bool:
    """The plan was priced for meshtron's runtime (no framework, or meshtron's own preset with
    options that runtime runs, plan_rules_options.RUNTIME_OPTIONS: e.g. --stack compiled with
    --compile; --stack fused needs --framework): what `meshtron train` runs."""
    return plan.framework is None or plan.framework.split("@", 1)[0].strip().lower() == "meshtron"


def framework_runtime_problem(plan) -> str | None:
    """A plan priced for another stack: its layout, dtype and [predicted] figures are that
    stack's (its kernels, memory and schedules), not what meshtron's runtime would run."""
    if runs_on_meshtron(plan):
        return None
    return (f"plan.framework={plan.framework!r}: priced for that stack, not meshtron's "
            "runtime; re-plan without --framework (meshtron's runtime) to train it here")


UNRECORDED_TOLERANCE = 0.02
"""How far a re-priced step or memory may sit from a file's [predicted] before a file with no
`framework` is taken for one saved before plans recorded their stack: the figures are saved
to 6 significant digits, and a planner change between saving and re-pricing moves them by
less than this on the published rows' plans; another stack's pricing moves them by more
(megatron@2024's llama3-8b dp=8 plan: 47.7 s and 76.4 GiB, as meshtron's 56.6 s and 81.3)."""


def unrecorded_stack_warning(plan, step_time_s: float, memory_gib: float) -> str | None:
    """One warning line when a plan file with no `framework` (priced for meshtron's runtime,
    or saved before plans recorded their stack: `meshtron plan --framework X --save` wrote
    none) re-prices as meshtron's runtime more than UNRECORDED_TOLERANCE away from its own
    [predicted] step or memory; None otherwise (or when the file has no [predicted])."""
    if plan.framework is not None or plan.framework_options:
        return None
    pred = plan.predicted or {}
    was_step, was_mem = pred.get("step_time_s"), pred.get("memory_gib")
    moved = [now / was - 1 for now, was in ((step_time_s, was_step), (memory_gib, was_mem))
             if was and was > 0]
    if not moved or max(abs(m) for m in moved) <= UNRECORDED_TOLERANCE:
        return None
    return (f"re-priced as meshtron's runtime: step {step_time_s:.2f} s, {memory_gib:.1f} GiB; "
            f"the file's [predicted]: {was_step or 0:.2f} s, {was_mem or 0:.1f} GiB: saved "
            "before plans recorded their stack? pass --framework NAME@ERA")
