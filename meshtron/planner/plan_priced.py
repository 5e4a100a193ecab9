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
    pricing options such as --stack): what `meshtron train` runs."""
    return plan.framework is None or plan.framework.split("@", 1)[0].strip().lower() == "meshtron"


def framework_runtime_problem(plan) -> str | None:
    """A plan priced for another stack: its layout, dtype and [predicted] figures are that
    stack's (its kernels, memory and schedules), not what meshtron's runtime would run."""
    if runs_on_meshtron(plan):
        return None
    return (f"plan.framework={plan.framework!r}: priced for that stack, not meshtron's "
            "runtime; re-plan without --framework (meshtron's runtime) to train it here")
