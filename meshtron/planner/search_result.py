"""What a search answers: the ranked plans, the near miss when nothing fits, and why the best
plan of each other family (or knob value) loses (planner/search.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshtron.model.spec import ModelSpec
from meshtron.planner.cluster import ClusterSpec
from meshtron.planner.compute import KernelOptions
from meshtron.planner.estimate_results import Estimate
from meshtron.planner.search_space import DEFAULT_DTYPE


@dataclass
class Alternative:
    """Why the best plan of another family (or another knob value) loses."""

    label: str
    """Family or knob description."""
    estimate: Estimate | None
    """Its best plan (feasible), or its leanest infeasible plan, or None if the family is empty."""
    reason: str
    """One-line explanation."""

    def to_dict(self) -> dict[str, Any]:
        est = self.estimate
        return {"family": self.label, "reason": self.reason,
                "fits": bool(est and est.fits),
                "layout": est.config.describe() if est else None,
                "step_time_s": est.step_time_s if est and est.fits else None,
                "memory_gib": est.memory.total if est else None}


@dataclass
class SearchResult:
    """Ranked plans and the explanation of the ranking."""

    model: ModelSpec
    """The model planned for."""
    cluster: ClusterSpec
    """The cluster planned for."""
    global_batch: int
    """Sequences per step."""
    seq_len: int
    """Tokens per sequence."""
    options: KernelOptions
    """Kernel assumptions of the cost model."""
    plans: list[Estimate]
    """Best feasible plans, fastest first (at most top_k)."""
    alternatives: list[Alternative] = field(default_factory=list)
    """Why other families lose."""
    near_miss: Estimate | None = None
    """When nothing fits: the plan needing the least memory, under the layer split that needs
    the least (its memory is what "needs at least X GiB" states)."""
    near_miss_priced: Estimate | None = None
    """When nothing fits: the near miss's config evaluated as the search prices every candidate
    (`exact_memory=False`: the time-balanced layer split, or the plan's own `stage_layers`), so
    its step time compares with a fitting plan's; its memory is that split's."""
    layouts: tuple[tuple[int, int, int, int, int], ...] = ()
    """The (tp, cp, pp, dp, ep) layouts the knobs leave to the search (valid ones, before host
    offload drops pipelines); exactly one: the layout is pinned (planner/pinned.py)."""
    evaluated: int = 0
    """Configs evaluated in full by the cost model."""
    enumerated: int = 0
    """Configs in the search space (evaluated, or bounded away without evaluation)."""
    feasible: int = 0
    """Configs that fit in memory."""
    seconds: float = 0.0
    """Wall time of the search."""
    notes: list[str] = field(default_factory=list)
    """Knob families left out of the search, and why."""
    dtype: str = DEFAULT_DTYPE
    """The run precision planned for."""
    framework: Any = None
    """The software stack priced (frameworks.Framework; None: meshtron's runtime)."""
    offload_best: Estimate | None = None
    """When plans fit without host offload and offload was left to the search: the fastest
    offloaded plan that could beat them (None: none could, by its bound or its full cost)."""
    offload_compared: bool = False
    """Offloaded plans were priced against the plans without offload (search_plans)."""
    pinned: bool = False
    """The knobs leave one layout (`layouts`) and nothing of it fits: the one plan is the near
    miss priced as a candidate, with fits False (planner/pinned.py `answer_pinned`)."""
    split_fallback: Any = None
    """A pinned layout the stack's layer-to-stage rule cannot split, priced on the nearest rule
    its engine could be configured to (search_space.SplitFallback); None: the stack's own."""
    refused: str | None = None
    """When no point of the valid layouts could be evaluated: the commonest reasons the
    validity function refused them, with counts (SearchSpace.refusal_summary); None
    otherwise."""
    fit_change: Any = None
    """With `pinned`: the fastest plan of the same layout that fits when one of the knobs the
    user fixed is freed (or all of them), and what changed (pinned.FitChange); None: none."""

    @property
    def best(self) -> Estimate | None:
        return self.plans[0] if self.plans else None

    @property
    def fits(self) -> bool:
        """The best plan fits in memory (a pinned layout is answered even when it does not)."""
        return bool(self.plans) and self.plans[0].fits


__all__ = ["Alternative", "SearchResult"]
