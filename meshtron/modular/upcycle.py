"""Dense state dicts -> one mixture-of-experts state dict (sparse upcycling and Branch-Train-MiX).

Expert e of every MoE layer is branch e // copies's MLP (w1, w3, w2 stacked into meshtron's
[experts, out, in] weights); every other parameter (attention, norms, embeddings, head, the
dense first layers and the shared experts) is the mean of the branches (BTX, Sukhbaatar et al.
2024, section 2.3; with one branch it is that branch's tensor). The experts have the dense
MLP's width, so `moe_ffn_hidden = ffn_hidden`.

Upcycling is exact: with one branch the MoE's logits equal the dense model's before any step
(fp32 rounding). How each router kind guarantees it (`router_init`):
- the routed experts are identical, so the routed part is S(x) * MLP(x) with S(x) the sum of the
  token's k routing weights (times `moe_route_scale`);
- softmax or sigmoid top-k with `moe_norm_topk` and k > 1: the k weights are renormalised to
  sum to 1, so S = moe_route_scale for any router. The gate is drawn fresh from meshtron's
  deterministic init (N(0, 0.02), meshtron/model/init.py, seeded by `seed`), as Komatsuzaki et
  al. initialise the router randomly;
- otherwise (k = 1, or Qwen3's `norm_topk_prob` false) the weights depend on the router, so the
  gate starts at zero: every affinity is the same constant c (softmax 1/E, sigmoid 0.5) and
  S = k * c * moe_route_scale. The first steps then route every token to the same k experts
  until the gate (and, for sigmoid, the balancing bias) moves. (Merging several branches, whose
  experts differ anyway, draws the gate fresh here too: zero would send every token to the
  same experts at the start);
- each expert's w2 is multiplied by (1 - a) / S, and the shared experts (s copies of the MLP
  side by side, one SwiGLU of width s * ffn_hidden) have w2 times a / s, with a = 1/2 when the
  model has shared experts (else 0): the two paths sum to a + (1 - a) = 1 times the MLP.
The balancing bias of the sigmoid router starts at 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from meshtron.errors import UserError
from meshtron.model.spec import ModelSpec

DEFAULT_AUX_LOSS = 0.01
"""Load-balancing loss coefficient of a merged model unless set (Switch Transformer's and BTX's
0.01)."""

_SETTABLE = ("moe_router", "moe_norm_topk", "moe_route_scale", "moe_groups", "moe_topk_groups",
             "moe_aux_loss", "moe_bias_update", "moe_shared_experts", "moe_dense_layers")
"""ModelSpec fields a merge may set; the others come from the branches and the flags."""


def moe_spec(dense: ModelSpec, experts: int, top_k: int,
             fields: dict[str, Any] | None = None) -> ModelSpec:
    """The MoE of `dense`'s shapes with `experts` experts of the dense MLP's width, `top_k`
    active, and the MoE `fields` given (`_SETTABLE`)."""
    fields = dict(fields or {})
    for key in fields:
        if key not in _SETTABLE:
            raise UserError(f"merge --set model.{key}: allowed keys are "
                            f"{', '.join('model.' + k for k in _SETTABLE)} (the shapes come "
                            "from the branches, the experts from --experts/--copies/--top-k)")
    if dense.bias:
        raise UserError("merge --experts: model.bias=true: MoE experts have no biases; only "
                        "bias-free SwiGLU models merge")
    if top_k > experts:
        raise UserError(f"merge --top-k={top_k}: must be at most the {experts} experts")
    fields.setdefault("moe_aux_loss", DEFAULT_AUX_LOSS)
    return dense.replace(name=f"{dense.name}-moe{experts}", moe_experts=experts,
                         moe_top_k=top_k, moe_ffn_hidden=dense.ffn_hidden, **fields)


@dataclass(frozen=True)
class RouterInit:
    """How the merged router starts and what the experts' output projections are scaled by."""

    gate: str
    """'random' (N(0, 0.02) from meshtron's seeded init) or 'zero'."""
    routed_sum: float
    """S: the sum of a token's routing weights at the start (times moe_route_scale)."""
    shared_share: float
    """a: the share of the MLP's output the shared experts carry (0 without shared experts)."""
    routed_w2: float
    """Factor on every routed expert's w2: (1 - a) / S."""
    shared_w2: float
    """Factor on each shared copy's w2: a / s."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def router_init(spec: ModelSpec, identical: bool = True) -> RouterInit:
    """The router start that makes identical experts reproduce the dense MLP (module doc).
    `identical` False (Branch-Train-MiX: the experts differ, so no start reproduces one
    model): the gate is always drawn fresh, and the experts' w2 get the same factors, so a
    token starts near the output of the branch it routes to."""
    k, e = spec.moe_top_k, spec.moe_experts
    if spec.moe_norm_topk and k > 1:
        gate, total = "random", spec.moe_route_scale
    else:
        # The same fp32 constant the router computes from a zero gate.
        zero = torch.zeros(1, e, device="cpu")
        c = float((zero.softmax(-1) if spec.moe_router == "softmax" else zero.sigmoid())[0, 0])
        gate, total = ("zero" if identical else "random"), k * c * spec.moe_route_scale
    if total <= 0:
        raise UserError(f"merge: model.moe_route_scale={spec.moe_route_scale}: must be > 0 so "
                        "the experts' output can reproduce the dense model")
    share = 0.5 if spec.moe_shared_experts else 0.0
    shared = share / spec.moe_shared_experts if spec.moe_shared_experts else 0.0
    return RouterInit(gate, total, share, (1.0 - share) / total, shared)


def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) == 1:
        return tensors[0].clone()
    total = torch.zeros_like(tensors[0], dtype=torch.float64)
    for t in tensors:
        total += t.double()
    return (total / len(tensors)).to(tensors[0].dtype)


@torch.no_grad()
def merge_states(states: list[dict[str, torch.Tensor]], spec: ModelSpec, copies: int = 1,
                 seed: int = 0) -> tuple[dict[str, torch.Tensor], RouterInit]:
    """The MoE `spec`'s full state dict (meshtron names) from the dense branches' `states`:
    expert e = branch e // copies's MLP; every other tensor the branches' mean."""
    from meshtron.hf.load import model_shapes
    from meshtron.model.init import init_box

    if spec.moe_experts != len(states) * copies:
        raise UserError(f"merge: model.moe_experts={spec.moe_experts} must equal branches x "
                        f"copies = {len(states)} x {copies}")
    init = router_init(spec, identical=len(states) == 1)
    shapes = model_shapes(spec)
    out: dict[str, torch.Tensor] = {}
    mlp = (".feed_forward.w1.weight", ".feed_forward.w2.weight", ".feed_forward.w3.weight")
    for name in states[0]:
        layer = int(name.split(".")[1]) if name.startswith("layers.") else -1
        if not (name.endswith(mlp) and spec.is_moe_layer(layer)):
            out[name] = _mean([s[name] for s in states])
    for i in range(spec.layers):
        if not spec.is_moe_layer(i):
            continue
        p = f"layers.{i}.feed_forward."
        for w in ("w1", "w3", "w2"):
            stacked = torch.stack([s[f"{p}{w}.weight"] for s in states for _ in range(copies)])
            out[f"{p}experts.{w}.weight"] = stacked * init.routed_w2 if w == "w2" else stacked
        gate = f"{p}router.gate.weight"
        out[gate] = (init_box(gate, shapes[gate], (0, 0), shapes[gate], seed, spec.layers,
                              device="cpu")
                     if init.gate == "random" else torch.zeros(shapes[gate], device="cpu"))
        if spec.moe_router == "sigmoid":
            out[f"{p}router.expert_bias"] = torch.zeros(spec.moe_experts, device="cpu")
        if spec.moe_shared_experts:
            s = spec.moe_shared_experts
            w1, w3, w2 = (_mean([st[f"{p}{w}.weight"] for st in states])
                          for w in ("w1", "w3", "w2"))
            out[f"{p}shared.w1.weight"] = torch.cat([w1] * s, 0)
            out[f"{p}shared.w3.weight"] = torch.cat([w3] * s, 0)
            out[f"{p}shared.w2.weight"] = torch.cat([w2] * s, 1) * init.shared_w2
    _check_shapes(out, shapes)
    return out, init


def _check_shapes(state: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    """The merged state is exactly the MoE model's parameters (a bug otherwise, not bad input)."""
    extra, missing = sorted(set(state) - set(shapes)), sorted(set(shapes) - set(state))
    assert not extra and not missing, (extra[:3], missing[:3])
    for name, shape in shapes.items():
        assert tuple(state[name].shape) == shape, (name, tuple(state[name].shape), shape)


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a full state dict (meshtron names, tied weights once) into a plain model."""
    from meshtron.model.init import named_unique_parameters

    with torch.no_grad():
        for name, p in named_unique_parameters([model]):
            p.copy_(state[name])
