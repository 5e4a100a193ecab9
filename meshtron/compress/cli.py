"""`meshtron train` flags for gradient compression and DiLoCo, and how they reach the Plan.

They are Plan fields (meshtron/planner/plan.py), so a saved plan carries them and the ranks run
exactly what was saved: flags set them on a searched plan and may only restate a saved one.
The table and its parser are the planner's (planner/comm_flags.py), shared with `meshtron plan`.
"""

from __future__ import annotations

from typing import Any

from meshtron.errors import UserError
from meshtron.planner.comm_flags import FLAGS, add_arguments, requested, search_knobs

__all__ = ["FLAGS", "add_arguments", "apply", "requested", "search_knobs"]


def apply(plan, comm: dict[str, Any], saved: bool):
    """`plan` with the requested fields: set on a searched plan (validated: UserError), only
    restated on a saved one."""
    if not comm:
        return plan
    if saved:
        for name, value in comm.items():
            if getattr(plan, name) != value:
                flag = "--" + name.replace("_", "-")
                raise UserError(f"{flag}={value}: the saved plan has {name}="
                                f"{getattr(plan, name)!r}; edit the plan or drop the flag")
        return plan
    return plan.replace(**comm)
