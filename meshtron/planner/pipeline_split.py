"""The layer-to-stage split a software stack itself makes (memory_options.PIPELINE_SPLITS).

The planner prices what the stack runs, so the split is the stack's, not the best one:

* 'any' (meshtron's runtime; torchtitan, whose `pipeline_parallel_split_points` /
  `module_fqns_per_model_part` cut the model at any block): pipeline.py's time-balanced split.
* 'megatron-even' (Megatron-LM 2021 to Megatron-Core 0.8): every stage num_layers // pp layers,
  every chunk num_layers // (pp*v) (megatron/model/transformer.py, megatron/arguments.py);
  other layer counts are refused (plan_rules.split_problem).
* 'megatron-ends' (Megatron-Core 0.9-0.12): equal middle stages, and the first and last stage
  counts set by --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers
  (transformer_config.py "Uneven PP"), each a multiple of v (0.11+; 0.9 and 0.10 assert
  uneven stages without interleaving: the rule is the preset's newest, 0.11-0.12); or
  account_for_embedding/loss_in_pipeline_split (0.11+): the embedding and the loss count as
  a layer each, every chunk equal, the first and last chunk one layer short. Of the splits it
  can express, the one with the fastest slowest stage (ties: fewer layers on the first stage,
  which holds the most micro-batches), as a user tuning those flags would pick.
* 'deepspeed-transformer' / 'deepspeed-parameters': DeepSpeed's PipelineModule
  `_partition_layers` with partition_method 'type:transformer' (Megatron-DeepSpeed's
  GPTModelPipe: every block weighs 1, the embedding and head 0) or 'parameters' (the default:
  every layer spec weighs its parameter count), through deepspeed/runtime/utils.py
  `partition_balanced`. Up to v0.12.4 (Megatron-DeepSpeed's 2021-2022 runs, deepspeed@2021)
  it binary-searches the smallest bottleneck and `_lprobe` fills the stages from the first,
  each up to that bottleneck, so the surplus ends on the last stages (`deepspeed_split`);
  from v0.12.5 (PR #4312, December 2023; deepspeed@2024 is 0.14-0.16) a dynamic programme
  over the items keeps, for every prefix and stage count, the split with the smallest
  difference between its heaviest and lightest stage, ties to the latest cut
  (`deepspeed_dp_split`). The split is not a choice: the memory caps cannot move it.
"""

from __future__ import annotations

import functools

from meshtron.planner import pipeline
from meshtron.planner.plan_rules_pipeline import megatron_account_for, split_problem

NEAREST = {"megatron-even": ("megatron-ends", "any"), "megatron-ends": ("any",),
           "deepspeed-transformer": ("any",), "deepspeed-parameters": ("any",)}
"""For a pinned layout a stack's rule cannot split (search_space.SplitFallback), the rules
priced instead, nearest first: what the same engine runs when configured further (Megatron-LM
2021's equal stages -> Megatron-Core 0.9+'s uneven end stages -> Megatron-Core 0.13+'s
pipeline_model_parallel_layout, any split: ADLR/megatron-lm!2795, June 2025); DeepSpeed has no option placing layers by count
(PipelineModule's partition_method is 'parameters', 'uniform' or 'type:REGEX', all computed),
so its nearest is the time-balanced split. Our reading of a stack's rule can be wrong (versions,
forks, NeMo recipes): a published layout is a fact, so it is priced, with a warning."""


def configured_as(stack: str, priced: str, stage_layers: list[int], v: int) -> str:
    """How the stack's engine could run the split priced instead of its own (`stage_layers`:
    per device; `v` chunks each), for the warning (report.split_warning)."""
    if priced == "megatron-ends":
        # Megatron-Core 0.9-0.10 assert uneven stages without interleaving
        # (transformer_block.get_num_layers_to_build); 0.11 builds uneven virtual stages
        if v > 1 and (stage_layers[0] % v or stage_layers[-1] % v):
            how = "account_for_embedding/loss_in_pipeline_split (Megatron-Core >= 0.11)"
        elif v > 1:
            how = ("--decoder-first/last-pipeline-num-layers and "
                   "--num-virtual-stages-per-pipeline-rank (Megatron-Core >= 0.11)")
        else:
            how = "--decoder-first/last-pipeline-num-layers (Megatron-Core >= 0.9)"
        return f"the uneven end stages a Megatron-Core run sets with {how}"
    if stack.startswith("megatron"):
        return ("the time-balanced split, which Megatron-Core >= 0.13's "
                "--pipeline-model-parallel-layout can place")
    if stack.startswith("deepspeed"):
        return ("the time-balanced split (meshtron's and torchtitan's), which DeepSpeed's "
                "partition_balanced does not build")
    return "the time-balanced split"


def split_for(rule: str, layers: int, p: int, v: int, layer_time: float, first_extra: float,
              last_extra: float, caps: list[int] | None = None,
              weights: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> list[int] | None:
    """Layers per device under the stack's `rule`, or None when the stack cannot split the
    model this way (or, for the choosing rules, not within the memory `caps`). `weights`:
    (embedding, block, head) parameters, for DeepSpeed's 'parameters' method."""
    if rule in ("megatron-even", "megatron-ends"):
        return megatron_split(rule, layers, p, v, layer_time, first_extra, last_extra, caps)
    if rule == "deepspeed-transformer":
        return deepspeed_split(layers, p, (0.0, 1.0, 0.0))
    if rule == "deepspeed-parameters":
        return deepspeed_dp_split(layers, p, weights)
    return pipeline.partition_layers(layers, p, layer_time, first_extra, last_extra, caps, v)


def megatron_split(rule: str, layers: int, p: int, v: int, layer_time: float,
                   first_extra: float, last_extra: float,
                   caps: list[int] | None = None) -> list[int] | None:
    """The fastest split Megatron can express (module docstring), or None."""
    if split_problem(rule, layers, p, v):
        return None
    caps = caps or [layers] * p
    if p == 1:
        return [layers] if caps[0] >= layers else None
    best, best_key = None, None
    ends = range(v, layers + 1, v) if rule == "megatron-ends" else [layers // p]
    for first in ends:
        for last in ends:
            rest = layers - first - last
            if p == 2:
                mid = 0
                if rest:
                    continue
            elif rest <= 0 or rest % (p - 2) or (rest // (p - 2)) % v:
                continue
            else:
                mid = rest // (p - 2)
            n = [first] + [mid] * (p - 2) + [last]
            if any(k > c for k, c in zip(n, caps)):
                continue
            slow = max(first * layer_time + first_extra, mid * layer_time,
                       last * layer_time + last_extra)
            key = (round(slow, 12), first, -last)
            if best_key is None or key < best_key:
                best, best_key = n, key
    if rule == "megatron-ends":
        for e in megatron_account_for(layers, p, v):
            # account_for_embedding (first chunk) then loss (last chunk): one layer less each
            c = (layers + e) // (p * v)
            n = [v * c] * p
            n[0] -= 1
            if e == 2:
                n[-1] -= 1
            if any(k > cap for k, cap in zip(n, caps)):
                continue
            slow = max(n[0] * layer_time + first_extra, max(n[1:-1], default=0) * layer_time,
                       n[-1] * layer_time + last_extra)
            key = (round(slow, 12), n[0], -n[-1])
            if best_key is None or key < best_key:
                best, best_key = n, key
    return best


def deepspeed_split(layers: int, p: int,
                    weights: tuple[float, float, float]) -> list[int] | None:
    """Blocks per stage of DeepSpeed's balanced partition of [embedding, blocks..., head]
    weighing `weights` (embedding, block, head); None when a stage would hold no block."""
    w_emb, w_blk, w_head = weights
    items = [w_emb] + [w_blk] * layers + [w_head]

    def fill(bound: float) -> list[tuple[int, int]]:
        # _lprobe: each stage takes items from the left while it stays within the bound; the
        # last stage takes what is left (the bound held if it weighs no more)
        parts, start = [], 0
        for s in range(p):
            end, total = start, 0.0
            while end < len(items) and (s == p - 1 or total + items[end] <= bound * (1 + 1e-9)):
                total += items[end]
                end += 1
            parts.append((start, end))
            start = end
        return parts

    lo, hi = 0.0, sum(items)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        last = fill(mid)[-1]
        if sum(items[last[0]:last[1]]) <= mid * (1 + 1e-9):
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * hi:
            break
    # blocks are items 1..layers
    counts = [max(0, min(b, layers + 1) - max(a, 1)) for a, b in fill(hi)]
    return counts if min(counts) > 0 and sum(counts) == layers else None


def deepspeed_dp_split(layers: int, p: int,
                       weights: tuple[float, float, float]) -> list[int] | None:
    """Blocks per stage of DeepSpeed >= 0.12.5's balanced partition (`_deepspeed_dp`), or
    None when a stage would hold no block."""
    counts = _deepspeed_dp(layers, p, tuple(weights))
    return list(counts) if counts is not None else None


@functools.lru_cache(maxsize=256)
def _deepspeed_dp(layers: int, p: int,
                  weights: tuple[float, float, float]) -> tuple[int, ...] | None:
    """Blocks per stage of DeepSpeed >= 0.12.5's `partition_balanced` over [embedding,
    blocks..., head] weighing `weights` (module docstring): cost[i][j] = heaviest minus
    lightest of the best split of the first i items into j stages, extended by every last
    stage k..i, ties to the largest k (its `>=`); the lightest of a one-stage prefix is that
    stage (its dp_min starts at infinity). Pure, O(p (L + 2)^2): memoised process-wide (the
    search prices every plan of one pipeline depth with the same split; the key is every
    input)."""
    w_emb, w_blk, w_head = weights
    items = [w_emb] + [w_blk] * layers + [w_head]
    n = len(items)
    if n <= p:
        return None
    prefix = [0.0]
    for w in items:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # state per (i, j): (cost, heaviest, lightest, cut)
    hi = [[inf] * (p + 1) for _ in range(n + 1)]
    lo = [[inf] * (p + 1) for _ in range(n + 1)]
    cost = [[inf] * (p + 1) for _ in range(n + 1)]
    cut = [[0] * (p + 1) for _ in range(n + 1)]
    hi[0][0] = cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, p) + 1):
            for k in range(i):
                seg = prefix[i] - prefix[k]
                top, low = max(hi[k][j - 1], seg), min(lo[k][j - 1], seg)
                if cost[i][j] >= top - low:
                    cost[i][j], hi[i][j], lo[i][j], cut[i][j] = top - low, top, low, k
    bounds = [n]
    for j in range(p, 0, -1):
        bounds.append(cut[bounds[-1]][j])
    bounds.reverse()
    counts = [max(0, min(b, layers + 1) - max(a, 1)) for a, b in zip(bounds, bounds[1:])]
    return tuple(counts) if min(counts) > 0 and sum(counts) == layers else None


def chunks(rule: str, stage_layers: list[int], v: int, schedule: str | None = None) -> list[int]:
    """Layers of the p*v virtual stages (pipeline order) from per-device counts: Megatron
    builds equal chunks, and with account_for_embedding/loss_in_pipeline_split the very first
    and very last virtual stage are a layer short (transformer_config.py); the other stacks
    as pipeline.split_virtual spreads them."""
    if v == 1:
        return list(stage_layers)
    out = pipeline.split_virtual(stage_layers, v, schedule)
    if rule in ("megatron-even", "megatron-ends"):
        p = len(stage_layers)
        for d in (0, p - 1):
            if stage_layers[d] % v:  # v*c - 1 layers: the short chunk at the pipeline's end
                c = -(-stage_layers[d] // v)
                for k in range(v):
                    out[k * p + d] = c
                out[0 if d == 0 else (v - 1) * p + d] = c - 1
    return out
