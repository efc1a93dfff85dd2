"""``crisp-profile``: the plan to write, chosen on held-out calibration windows.

With ``--search-target-bytes F``: tier cut-offs, the Warm width, the dominance rule and (top-k > 2)
the number of dominant experts that minimise the loss on held-out *calibration* windows (the last
``--holdout-fraction`` of the calibration text, never the evaluation text) with expert bytes per
token <= F x full width. Without it, ``--dominance auto`` keeps the rule with the lower held-out
loss at the command line's cut-offs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from crisp_runtime.planning.plan import CrispPlan, TierCutoffs, TierWidths

from ..calibration import CliError, MaskedExperts, score_windows
from .planning import description, initial_plan, layer_plans
from .statistics import Stats

if TYPE_CHECKING:
    from .inputs import ProfileInputs

SEARCH_HOT = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
SEARCH_COLD = (0.0, 0.1, 0.2, 0.3, 0.5)
# Routing wider than top-2: how many experts of a token run full width (the plan's num_dominant).
# At top-k the dominants alone cost num_dominant / k of the full-width bytes (1/6 = 17% at top-6,
# 2/6 = 33%, 3/6 = 50%), so a target F admits every count with num_dominant / k <= F; the search
# tries each of them (at top-2 only 1: two dominants are full width). With two or more dominants
# both leading-pair members are full width, so a per-pair label cannot change any width and only
# the routing-weight rule is searched there.


def bytes_fraction(plan: CrispPlan, routing: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean expert bytes per token under ``plan`` over recorded routing, as a fraction of full width."""
    used = total = 0
    for layer_id, (index, weights) in routing.items():
        widths = plan.token_widths(layer_id, index, weights)
        used += int(widths.sum())
        total += index.numel() * plan.intermediate_size
    return used / total if total else 0.0


def choose_plan(inputs: ProfileInputs, stats: Stats, packed, log: Callable[[str], None]
                ) -> tuple[CrispPlan, dict, dict | None]:
    """(plan, pack.json's plan record, pack.json's search record or None): see the module docstring."""
    cfg = inputs.cfg
    rules = cfg.candidate_rules()
    plan, plan_info = initial_plan(inputs, stats, rules[0], log)
    plan_info["dominance_rule"] = rules[0]
    if cfg.search_target_bytes is not None:
        plan, search = search_plan(inputs, stats, plan, packed, rules, log)
        plan_info["dominance_rule"] = search["chosen"]["dominance"]
        return plan, plan_info, search
    if len(rules) > 1:
        plan, plan_info["dominance_rule"], plan_info["dominance_choice"] = choose_rule(
            inputs, stats, packed, rules, log)
    return plan, plan_info, None


def choose_rule(inputs: ProfileInputs, stats: Stats, packed, rules: list[str], log: Callable[[str], None]
                ) -> tuple[CrispPlan, str, dict]:
    """--dominance auto without a search: the rule whose plan has the lower held-out calibration loss."""
    weights = inputs.experts.packed_weights(packed)
    losses, plans = {}, {}
    for rule in rules:
        plans[rule] = initial_plan(inputs, stats, rule, log)[0]
        with MaskedExperts(inputs.model, inputs.layers, weights=weights, widths_fn=plans[rule].token_widths):
            losses[rule] = score_windows(inputs.model, inputs.search_windows, inputs.cfg.batch_size).loss
    best = min(rules, key=lambda r: losses[r])
    log("dominance: " + ", ".join(f"{r} loss {v:.4f}" for r, v in losses.items()) + f"; chose {best}")
    return plans[best], best, {"held_out_calibration_loss": losses}


def _candidates(inputs: ProfileInputs, stats: Stats, plan: CrispPlan, rules: list[str], routing) -> list[tuple]:
    """(hot, cold, warm, cold width, cutoffs, rule, plan with its dominant count) of every setting within the
    target: the widest Warm width that fits, for each cut-off pair, Cold width, dominant count and rule."""
    cfg, inter, top_k = inputs.cfg, inputs.inter, inputs.top_k
    target = cfg.search_target_bytes
    # neurons of a Cold auxiliary (0 = the paper's rule); at least one neuron for a width asked above 0
    cold_widths = sorted({0 if f == 0 else max(1, round(f * inter)) for f in cfg.search_cold_widths})
    candidates = []
    dominant_counts = ([cfg.num_dominant] if cfg.num_dominant is not None
                       else [d for d in range(1, top_k) if d / top_k <= target + 1e-9])
    for dominants in dominant_counts:
        with_d = CrispPlan.crisp(inputs.num_experts, top_k, inter, plan.layers, plan.tier_widths,
                                 unseen_tier=plan.unseen_tier, num_dominant=dominants)
        # two or more dominants: both leading-pair members full width, a per-pair label changes nothing
        rules_d = rules if dominants == 1 else ["routing-weight"]
        for hot in SEARCH_HOT:
            for cold in SEARCH_COLD:
                if hot + cold > 1.0:
                    continue
                cut = TierCutoffs(hot, cold)
                tiers = layer_plans(inputs, stats, cut, rules_d[0])
                for cold_width in cold_widths:
                    if cold_width and cold == 0.0:
                        continue  # no Cold tier: every Cold width is the same plan as 0
                    base_plan = with_d.with_tiers(TierWidths(inter, 0, cold_width), tiers)
                    lo = bytes_fraction(base_plan, routing)
                    if lo > target + 1e-9:
                        continue
                    one = bytes_fraction(base_plan.with_tiers(TierWidths(inter, inter, cold_width)), routing)
                    slope = (one - lo) / inter  # bytes fraction per Warm neuron (linear in the width)
                    warm = inter if slope <= 0 else min(inter, int((target - lo) / slope + 1e-9))
                    if cold_width and warm < cold_width:
                        continue  # a Cold auxiliary wider than a Warm one inverts the tiers
                    # bytes depend on the tiers only (dominant experts run full whichever they are)
                    candidates.extend((hot, cold, warm, cold_width, cut, rule, with_d) for rule in rules_d)
    return candidates


def search_plan(inputs: ProfileInputs, stats: Stats, plan: CrispPlan, packed, rules: list[str],
                log: Callable[[str], None]) -> tuple[CrispPlan, dict]:
    """The candidate with the lowest held-out calibration loss within the bytes target, and the search record."""
    cfg, model, inter = inputs.cfg, inputs.model, inputs.inter
    target = cfg.search_target_bytes
    weights = inputs.experts.packed_weights(packed)
    with MaskedExperts(model, inputs.layers, weights=weights, record=True) as inst:
        full_scores = score_windows(model, inputs.search_windows, cfg.batch_size)
        routing = {lid: (torch.cat(inst.trace.index[lid]), torch.cat(inst.trace.weights[lid]))
                   for lid in inputs.layer_ids}
    candidates = _candidates(inputs, stats, plan, rules, routing)
    log(f"search: {len(candidates)} candidates within {target:.0%} of full-width bytes")
    results = []
    best = None
    for hot, cold, warm, cold_width, cut, rule, with_d in candidates:
        cand = with_d.with_tiers(TierWidths(inter, warm, cold_width), layer_plans(inputs, stats, cut, rule))
        with MaskedExperts(model, inputs.layers, weights=weights, widths_fn=cand.token_widths):
            sc = score_windows(model, inputs.search_windows, cfg.batch_size)
        rec = {"hot_mass": hot, "cold_mass": cold, "warm_width": warm, "dominance": rule,
               "bytes_fraction": bytes_fraction(cand, routing), "loss": sc.loss, "accuracy": sc.accuracy}
        if cfg.search_cold_widths != (0.0,):
            rec["cold_width"] = cold_width
        if inputs.top_k > 2:
            rec["num_dominant"] = cand.num_dominant
        results.append(rec)
        if best is None or rec["loss"] < best[0]["loss"]:
            best = (rec, cand, cut, warm, rule)
    if best is None:
        raise CliError(f"--search-target-bytes {target}: no tier setting reaches it (dominant experts alone "
                       f"need more); raise the target")
    rec, cand, cut, warm, rule = best
    cold_width = cand.tier_widths.cold
    log(f"search: chose hot_mass={rec['hot_mass']} cold_mass={rec['cold_mass']} warm_width={warm} "
        + (f"cold_width={cold_width} " if cold_width else "") +
        f"dominance={rule} num_dominant={cand.num_dominant} "
        f"(bytes {rec['bytes_fraction']:.1%}, loss {rec['loss']:.4f} vs full {full_scores.loss:.4f})")
    chosen = CrispPlan.crisp(
        inputs.num_experts, inputs.top_k, inter, cand.layers, cand.tier_widths, unseen_tier=cand.unseen_tier,
        num_dominant=cand.num_dominant,
        description=description(inputs, cut, warm, rule, cand.num_dominant, cold=cold_width)
        + f" Tier cut-offs and Warm width chosen by a search for "
        f"<= {target:.0%} of full-width bytes per token on held-out calibration windows (lowest loss).",
    )
    info = {"target_bytes_fraction": target, "chosen": rec, "full_width": {"loss": full_scores.loss,
            "accuracy": full_scores.accuracy}, "candidates": results}
    return chosen, info

