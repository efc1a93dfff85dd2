"""The equal-bytes baselines every CRISP comparison needs, matched to a plan's bytes per token.

One implementation, used by ``crisp-eval`` (tools/evaluate.py) and the benchmarks (bench/traces.py):

- ``full``: every routed expert at full width;
- ``uniform``: every routed expert at the one width whose bytes per token are closest to a target;
- ``skip_aux``: the ``num_dominant`` heaviest experts of a token (by routing weight) at full width,
  every other routed expert at full width when its routing weight is at least a threshold and
  skipped otherwise; the threshold is the one whose bytes per token are closest to a target.

Bytes are counted in *neurons* (prefix widths summed over a token's routed experts and over the
MoE layers): every expert of a pack has the same bytes per neuron, so matching neurons matches bytes.

The skip-aux matching is exact on the given routing and correct for any ``num_dominant`` (the
top-6 DeepSeek / top-8 Qwen case, where a plan may keep 2 or 3 experts per token at full width):
with ``D`` dominant slots per token, each at full width ``I``, the auxiliary slots kept must carry
``target - D x I`` neurons per token; a threshold ``v`` keeps exactly the auxiliary weights >= v, so
the candidate thresholds are the distinct auxiliary weights themselves, and we pick the one whose
kept count is closest to the wanted count (None = skip every auxiliary). A quantile would drift by
ties and by D.

``at_most=True``: the closest at or below the target instead of the closest either side (a search within
a bytes budget, ``crisp-profile --search-target-bytes``, admits no point above it): uniform rounds the width
down, skip-aux keeps the most auxiliary slots that fit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from crisp_runtime.planning.plan import CrispPlan, PlanError, PolicyKind

#: {layer_id: (top_k_index (T, k) int, top_k_weights (T, k) float)}: every MoE layer over the same T tokens.
Routing = Mapping[int, tuple[torch.Tensor, torch.Tensor]]


def _check_routing(routing: Routing) -> int:
    """Number of tokens of ``routing`` (equal over layers); raise ValueError on bad shapes."""
    if not routing:
        raise ValueError("routing: expected at least one MoE layer, got none")
    tokens = None
    for layer_id, (index, weights) in routing.items():
        if index.dim() != 2 or index.shape != weights.shape:
            raise ValueError(f"routing[{layer_id}]: expected equal (T, k) index and weights, "
                             f"got {tuple(index.shape)} and {tuple(weights.shape)}")
        if tokens is None:
            tokens = index.shape[0]
        elif index.shape[0] != tokens:
            raise ValueError(f"routing[{layer_id}]: {index.shape[0]} tokens, other layers have {tokens}")
    if tokens == 0:
        raise ValueError("routing: no tokens")
    return tokens


def _valid(index: torch.Tensor, num_experts: int) -> torch.Tensor:
    # Index values outside [0, E) are padding sentinels that run no expert (CrispPlan.token_widths: width 0).
    return (index >= 0) & (index < num_experts)


def neurons_per_token(plan: CrispPlan, routing: Routing) -> float:
    """Mean over tokens of the neurons ``plan`` runs for a token, summed over its routed experts and the layers."""
    tokens = _check_routing(routing)
    total = 0
    for layer_id, (index, weights) in routing.items():
        total += int(plan.token_widths(layer_id, index, weights).sum())
    return total / tokens


def full_plan(like: CrispPlan) -> CrispPlan:
    """Every routed expert at full width, over ``like``'s model dimensions."""
    return CrispPlan.full(like.num_experts, like.top_k, like.intermediate_size, like.layer_ids)


def matched_uniform_width(routing: Routing, target: float, *, num_experts: int, intermediate_size: int,
                          at_most: bool = False) -> int:
    """The uniform width whose neurons per token on ``routing`` are closest to ``target``.

    A width w costs ``w x`` (routed slots per token) neurons, so the best width is the target over the
    mean routed slots per token, rounded (ties up; down with ``at_most``) and clamped to [1, I]: width 0
    would be a model without experts, not a baseline (so with ``at_most`` a target below one neuron per
    slot still gets width 1, above the target).
    """
    tokens = _check_routing(routing)
    slots = sum(int(_valid(index, num_experts).sum()) for index, _ in routing.values()) / tokens
    if slots == 0:
        raise ValueError("routing: no routed expert slot is valid")
    # 1e-9: a target computed as a fraction of the full width may land a hair below an exact width
    width = math.floor(target / slots + 1e-9) if at_most else int(target / slots + 0.5)
    return max(1, min(intermediate_size, width))


def dominant_and_aux_weights(routing: Routing, num_experts: int, num_dominant: int) -> tuple[int, torch.Tensor]:
    """(dominant slots in ``routing``, routing weights of every auxiliary slot as (N,) float64).

    A token's dominant slots are its ``num_dominant`` heaviest valid experts (ties: router order, as
    CrispPlan ranks them); the rest of its valid slots are auxiliary.
    """
    dominant = 0
    aux = []
    for index, weights in routing.values():
        valid = _valid(index, num_experts)
        key = torch.where(valid, weights.double(), torch.full_like(weights, -float("inf"), dtype=torch.float64))
        ordered = key.sort(dim=1, descending=True, stable=True).values
        rank_valid = torch.arange(index.shape[1]).unsqueeze(0) < valid.sum(dim=1, keepdim=True)
        is_dom = rank_valid & (torch.arange(index.shape[1]).unsqueeze(0) < num_dominant)
        dominant += int(is_dom.sum())
        aux.append(ordered[rank_valid & ~is_dom])
    return dominant, torch.cat(aux) if aux else torch.zeros(0, dtype=torch.float64)


def matched_skip_threshold(routing: Routing, target: float, *, num_experts: int, intermediate_size: int,
                           num_dominant: int, at_most: bool = False) -> float | None:
    """The skip-aux threshold whose neurons per token on ``routing`` are closest to ``target``.

    None = skip every auxiliary expert; 0.0 = keep every one. Exact over ``routing`` (no quantile
    interpolation): see the module docstring. ``at_most``: the closest at or below ``target`` (None when
    even one kept auxiliary slot would exceed it, or the dominant experts alone do).
    """
    tokens = _check_routing(routing)
    dominant, aux = dominant_and_aux_weights(routing, num_experts, num_dominant)
    want = (target * tokens - dominant * intermediate_size) / intermediate_size  # auxiliary slots to keep
    if aux.numel() == 0:
        return None
    values = aux.sort(descending=True).values
    distinct = torch.unique_consecutive(values)  # descending
    # kept count for threshold v = #(aux >= v): the last position of v in the descending order, plus 1.
    kept = torch.searchsorted(-values, -distinct, right=True)  # ascending as the threshold falls
    if at_most:
        fits = (kept.double() <= want + 1e-9).nonzero()
        return None if fits.numel() == 0 else float(distinct[int(fits[-1])])
    best = int(torch.argmin((kept.double() - want).abs()))  # first minimum: the higher threshold on a tie
    if abs(want) <= abs(float(kept[best]) - want):
        return None  # keeping none is at least as close
    # Not clamped: CrispPlan validates the threshold's range, so a router whose weights exceed 1 is refused
    # there rather than silently matched at a wrong threshold.
    return float(distinct[best])


def equal_bytes_plans(crisp: CrispPlan, routing: Routing, target: float | None = None, *,
                      at_most: bool = False) -> dict[str, CrispPlan]:
    """``full``, ``uniform``, ``skip_aux`` (and ``crisp``) over ``crisp``'s model, matched on ``routing``.

    target: neurons per token to match; None = ``crisp``'s own on ``routing``. skip_aux keeps
    ``crisp.num_dominant`` experts per token at full width, as the plan does. at_most: each baseline the
    closest at or below the target (see the module docstring).
    """
    for layer_id in routing:
        if layer_id not in crisp.layer_ids:
            raise PlanError(f"routing has layer {layer_id}, the plan covers {list(crisp.layer_ids)}")
    if target is None:
        target = neurons_per_token(crisp, routing)
    e, k, inter, ids = crisp.num_experts, crisp.top_k, crisp.intermediate_size, crisp.layer_ids
    width = matched_uniform_width(routing, target, num_experts=e, intermediate_size=inter, at_most=at_most)
    threshold = matched_skip_threshold(routing, target, num_experts=e, intermediate_size=inter,
                                       num_dominant=crisp.num_dominant, at_most=at_most)
    return {
        "full": full_plan(crisp),
        "uniform": CrispPlan.uniform(e, k, inter, ids, width),
        "skip_aux": CrispPlan.skip_aux(e, k, inter, ids, threshold=threshold, num_dominant=crisp.num_dominant),
        "crisp": crisp,
    }


def baseline_description(base: CrispPlan) -> str:
    """What a skip-aux or uniform plan does, in one sentence (a chosen baseline's description starts with it)."""
    if base.policy not in (PolicyKind.UNIFORM, PolicyKind.SKIP_AUX):
        raise ValueError(f"baseline_description: a skip_aux or uniform plan, not {base.policy.value!r}")
    if base.policy is PolicyKind.UNIFORM:
        return (f"Uniform-width baseline: every routed expert runs its first {base.uniform_width} of "
                f"{base.intermediate_size} neurons.")
    kept = ("every other routed expert is skipped" if base.skip_threshold is None else
            f"every other routed expert runs full width when its routing weight is >= {base.skip_threshold:.6g} "
            "and is skipped otherwise")
    return (f"Skip-auxiliary baseline: the {base.num_dominant} heaviest routed expert(s) of a token by routing weight "
            f"run full width, {kept}.")
