"""What the planner's search does with the knobs the user fixed before it enumerates anything
(the `PinnedKnobs` part of SearchSpace): they go through the plan's own validity function and
the search's refusals (tp beyond a node, ep on a stack without expert parallelism), and a
pinned layout the priced stack's layer-to-stage rule cannot split is priced on the nearest
rule its engine could be configured to (`SplitFallback`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtron.errors import UserError
from meshtron.planner.pipeline_split import NEAREST
from meshtron.planner.plan import plan_problems
from meshtron.planner.plan_rules import ep_rule, most_chunks, split_problem
from meshtron.planner.search_schedules import VIRTUAL_STAGES


@dataclasses.dataclass(frozen=True)
class SplitFallback:
    """A pinned layout the priced stack's layer-to-stage rule cannot split, priced on the
    nearest rule its engine could be configured to (pipeline_split.NEAREST): the same spirit
    as a pinned layout predicted not to fit (planner/pinned.py). An open search keeps leaving
    such layouts out: there it proposes what the stack runs."""

    stack: str
    """The stack's own rule (memory_options.PIPELINE_SPLITS)."""
    priced: str
    """The rule priced instead."""
    refusal: str
    """The stack rule's one-line refusal of the pinned layout."""


def runs_ep(framework: Any) -> bool:
    """The stack runs expert parallelism (meshtron's runtime does: framework None)."""
    return framework is None or bool(getattr(framework, "expert_parallel", ""))


class PinnedKnobs:
    """SearchSpace's checks of the fixed knobs and its settling of the layer split (it sets
    `ep_rule`, `ep_ok`, `split`, `mem`, `split_fallback`; it reads the knobs, the model, the
    stack's rules and `_layouts`, `_valid_layouts` of SearchSpace)."""

    def _check_fixed(self, gpn: int) -> None:
        """The fixed knobs through the validity function, and the search's own refusals: tp
        beyond a node, ep on a stack without expert parallelism (`ep_ok`)."""
        k, model, framework = self.knobs, self.model, self.framework
        fixed = {**k.to_dict(), **self.context}
        # the stack's ep folding (plan_rules.EP_FOLDS): only Megatron-Core's takes plan.etp
        self.ep_rule = ep_rule(self.mem.framework)
        problems = plan_problems(fixed, self.n, model, self.runtime, self.split, self.engine,
                                 self.mem.host_offload, self.mem.zero_stages, self.ep_rule,
                                 self.stack, self.mem.layouts, self.option_values)
        if problems:
            nearer = self._nearer_split(fixed)
            if nearer is None:
                raise UserError(problems[0])
            # kept only if the knobs leave one layout (`_settle_split`), else refused
            self._refusal, self.split = problems[0], nearer
        if k.tp is not None and (k.tp > gpn or gpn % k.tp):
            raise UserError(f"tp={k.tp}: must divide gpus_per_node={gpn} "
                             "(tensor parallelism stays inside a node)")
        # expert parallelism: searched for mixtures of experts on the stacks that run it
        self.ep_ok = runs_ep(framework)
        if k.ep is not None and k.ep > 1 and not self.ep_ok:
            from meshtron.planner.framework_presets import PRESETS

            running = ", ".join(key for key, f in PRESETS.items() if f.expert_parallel)
            raise UserError(f"plan.ep={k.ep}: framework {framework.label} has no expert "
                             f"parallelism priced (frameworks.py: {running} price it); "
                             "use ep=1")
        why = getattr(framework, "moe_no_tp", "")
        if model.is_moe and k.tp is not None and k.tp > 1 and why:
            raise UserError(f"plan.tp={k.tp}: framework {framework.label} trains a mixture of "
                            f"experts without tensor parallelism ({why}); use tp=1")
        if model.is_moe and not k.ep and not self.ep_ok:
            self.notes.append(f"expert parallelism left out: {framework.label} has none priced "
                              "(ep=1: every rank holds every expert)")

    def _nearer_split(self, fixed: dict[str, Any]) -> str | None:
        """The nearest rule (pipeline_split.NEAREST) under which the plan `fixed` has no
        problem, or None: a problem other than the stack's split."""
        for rule in NEAREST.get(self.split, ()):
            # with the stack's other rules: a problem they find is not the split's
            if not plan_problems(fixed, self.n, self.model, self.runtime, rule, self.engine,
                                 self.mem.host_offload, self.mem.zero_stages, self.ep_rule,
                                 layout_rule=self.mem.layouts, options=self.option_values):
                return rule
        return None

    def _settle_split(self, notes: list[str]) -> None:
        """Price a pinned layout (exactly one left: pinned.layout_pinned) that the stack's rule
        cannot split on the nearest rule that can (`SplitFallback`); refuse a layout the rule
        cannot split when the knobs leave more than one. `notes`: those before the layouts."""
        if self._refusal is not None and len(self._layouts) != 1:
            raise UserError(self._refusal)  # the planner chose the layout: the stack's refusal
        if self._refusal is None and not self._layouts:
            # the knobs fix a layout only the split refuses, pp then forced by the GPU count
            stack, fixed = self.split, {**self.knobs.to_dict(), **self.context}
            stack_notes = self.notes
            for rule in NEAREST.get(stack, ()):
                self.split, self.notes = rule, list(notes)
                layouts = self._valid_layouts()
                if len(layouts) == 1:
                    tp, cp, pp, dp, ep = layouts[0]
                    lay = {**fixed, "tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep}
                    self._refusal = plan_problems(lay, self.n, self.model, self.runtime,
                                                  stack, self.engine)[0]
                    self._layouts = layouts
                    break
            else:
                self.split, self.notes = stack, stack_notes
        if self._refusal is None and len(self._layouts) == 1:
            self._interleaving_refusal(self._layouts[0][2])
        if self._refusal is not None:
            self.split_fallback = SplitFallback(self.mem.split_rule, self.split, self._refusal)
            self.mem = dataclasses.replace(self.mem, split_priced=self.split)

    def _interleaving_refusal(self, pp: int) -> None:
        """`--schedule interleaved` without virtual stages on a pinned layout: when the stack's
        rule splits none of the searched counts (`schedules`) and a nearer rule splits one,
        price on that rule (the schedule the user fixed is the published run's)."""
        k, layers = self.knobs, self.model.layers
        if k.schedule != "interleaved" or k.virtual_stages or pp <= 1:
            return
        vs = [v for v in VIRTUAL_STAGES if v <= most_chunks(self.split, layers, pp)]
        problems = [split_problem(self.split, layers, pp, v) for v in vs]
        if not vs or not all(problems):
            return
        for rule in NEAREST.get(self.split, ()):
            if any(split_problem(rule, layers, pp, v) is None for v in vs):
                self._refusal = (f"plan.schedule='interleaved' on pp={pp}: no searched "
                                 f"virtual_stages ({', '.join(map(str, vs))}) is a split of "
                                 f"the stack's: {problems[0]}")
                self.split = rule
                return
