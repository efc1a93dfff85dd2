"""``crisp-profile``: the plan to write, chosen on held-out calibration windows.

With ``--search-target-bytes F``: tier cut-offs, the Warm width, the dominance rule and (top-k > 2)
the number of dominant experts and the combination key (leading pair or leading expert,
``--combination-key auto``) that minimise the loss on held-out *calibration* windows (the last
``--holdout-fraction`` of the calibration text, never the evaluation text) with expert bytes per
token <= F x full width. Without it, ``--dominance auto`` keeps the rule with the lower held-out
loss at the command line's cut-offs.

The simple baselines are points of the same space: skip-auxiliary by routing weight (one per searched
dominant count) and one uniform width, each the closest to F x full width at or below it
(``crisp_runtime.planning.baselines.equal_bytes_plans(..., at_most=True)``, on the held-out windows'
full-width routing, as every candidate's bytes). The lowest held-out loss wins whichever kind it is, so
the plan written is never worse there than either baseline within the target; when a baseline wins,
the pack's plan *is* that baseline (policy ``skip_aux`` or ``uniform``) and pack.json ``search``
says so (``chosen_kind``; ``best_loss_by_kind`` and ``baselines`` hold the losses beside it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from crisp_runtime.planning.baselines import baseline_description, equal_bytes_plans, full_plan, neurons_per_token
from crisp_runtime.planning.pairs import CombinationKey
from crisp_runtime.planning.plan import CrispPlan, PolicyKind, TierCutoffs, TierWidths

from ..calibration import CliError, MaskedExperts, TokenScores, score_windows
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
# The baselines a search also scores (pack.json search.chosen_kind is one of these or "crisp").
BASELINE_KINDS = ("skip_aux", "uniform")


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
    keys = cfg.candidate_keys(inputs.top_k)
    rules = cfg.candidate_rules(keys[0])
    plan, plan_info = initial_plan(inputs, stats, rules[0], log, keys[0])
    plan_info["dominance_rule"] = rules[0]
    if cfg.search_target_bytes is not None:
        plan, search = search_plan(inputs, stats, plan, packed, keys, log)
        plan_info["dominance_rule"] = search["chosen"].get("dominance")  # None: a uniform width has no dominants
        return plan, plan_info, search
    if len(rules) > 1:
        plan, plan_info["dominance_rule"], plan_info["dominance_choice"] = choose_rule(
            inputs, stats, packed, rules, log, keys[0])
    return plan, plan_info, None


def choose_rule(inputs: ProfileInputs, stats: Stats, packed, rules: list[str], log: Callable[[str], None],
                key: CombinationKey = CombinationKey.LEADING_PAIR) -> tuple[CrispPlan, str, dict]:
    """--dominance auto without a search: the rule whose plan has the lower held-out calibration loss."""
    weights = inputs.experts.packed_weights(packed)
    losses, plans = {}, {}
    for rule in rules:
        plans[rule] = initial_plan(inputs, stats, rule, log, key)[0]
        losses[rule] = held_out_scores(inputs, weights, plans[rule]).loss
    best = min(rules, key=lambda r: losses[r])
    log("dominance: " + ", ".join(f"{r} loss {v:.4f}" for r, v in losses.items()) + f"; chose {best}")
    return plans[best], best, {"held_out_calibration_loss": losses}


def dominant_counts(inputs: ProfileInputs) -> list[int]:
    """The searched numbers of full-width experts per token: ``--num-dominant``, else every count whose dominant
    experts alone fit the bytes target (see the module's constants)."""
    cfg, top_k = inputs.cfg, inputs.top_k
    if cfg.num_dominant is not None:
        return [cfg.num_dominant]
    return [d for d in range(1, top_k) if d / top_k <= cfg.search_target_bytes + 1e-9]


def held_out_scores(inputs: ProfileInputs, weights, plan: CrispPlan) -> TokenScores:
    """``plan``'s scores on the held-out calibration windows: every candidate of the search, baselines included."""
    with MaskedExperts(inputs.model, inputs.layers, weights=weights, widths_fn=plan.token_widths):
        return score_windows(inputs.model, inputs.search_windows, inputs.cfg.batch_size)


def baseline_plans(inputs: ProfileInputs, plan: CrispPlan, routing) -> list[tuple[dict, CrispPlan]]:
    """(record, plan) of each baseline the search scores: uniform once, skip-aux per dominant count, each the
    closest to the target at or below it on ``routing``; one that still exceeds the target (the narrowest uniform
    width, or dominants alone over it) is left out."""
    target = inputs.cfg.search_target_bytes
    wanted = target * neurons_per_token(full_plan(plan), routing)
    out, seen = [], set()
    for dominants in dominant_counts(inputs):
        matched = equal_bytes_plans(dataclasses.replace(plan, num_dominant=dominants), routing, wanted, at_most=True)
        for kind in BASELINE_KINDS:
            base = matched[kind]
            if base.widths_digest() in seen:  # uniform does not depend on the dominant count
                continue
            seen.add(base.widths_digest())
            rec = {"kind": kind, "bytes_fraction": bytes_fraction(base, routing)}
            if kind == "uniform":
                rec["uniform_width"] = base.uniform_width
            else:
                rec.update(skip_threshold=base.skip_threshold, num_dominant=base.num_dominant,
                           dominance="routing-weight")
            if rec["bytes_fraction"] <= target + 1e-9:
                out.append((rec, base))
    return out


def _candidates(inputs: ProfileInputs, stats: Stats, plan: CrispPlan, keys: list[CombinationKey], routing
                ) -> list[tuple]:
    """(hot, cold, warm, cold width, cutoffs, rule, plan with its dominant count and key) of every setting within
    the target: the widest Warm width that fits, for each cut-off pair, Cold width, dominant count, key and rule."""
    cfg, inter, top_k = inputs.cfg, inputs.inter, inputs.top_k
    target = cfg.search_target_bytes
    # neurons of a Cold auxiliary (0 = the paper's rule); at least one neuron for a width asked above 0
    cold_widths = sorted({0 if f == 0 else max(1, round(f * inter)) for f in cfg.search_cold_widths})
    candidates = []
    for key, dominants in ((key, d) for key in keys for d in dominant_counts(inputs)):
        with_d = CrispPlan.crisp(inputs.num_experts, top_k, inter, {}, plan.tier_widths,
                                 unseen_tier=plan.unseen_tier, num_dominant=dominants, combination_key=key)
        # two or more dominants: both leading-pair members full width, a per-pair label changes nothing
        rules_d = cfg.candidate_rules(key) if dominants == 1 else ["routing-weight"]
        for hot in SEARCH_HOT:
            for cold in SEARCH_COLD:
                if hot + cold > 1.0:
                    continue
                if hot == cold == 0.0 and key is not keys[0]:
                    continue  # every combination Warm (unseen ones too): the same widths under every key
                cut = TierCutoffs(hot, cold)
                tiers = layer_plans(inputs, stats, cut, rules_d[0], key)
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


def search_plan(inputs: ProfileInputs, stats: Stats, plan: CrispPlan, packed, keys: list[CombinationKey],
                log: Callable[[str], None]) -> tuple[CrispPlan, dict]:
    """The candidate with the lowest held-out calibration loss within the bytes target (a CRISP tier setting or a
    baseline), and the search record; every candidate is scored by :func:`held_out_scores`."""
    cfg, model, inter = inputs.cfg, inputs.model, inputs.inter
    target = cfg.search_target_bytes
    weights = inputs.experts.packed_weights(packed)
    with MaskedExperts(model, inputs.layers, weights=weights, record=True) as inst:
        full_scores = score_windows(model, inputs.search_windows, cfg.batch_size)
        routing = {lid: (torch.cat(inst.trace.index[lid]), torch.cat(inst.trace.weights[lid]))
                   for lid in inputs.layer_ids}
    candidates = _candidates(inputs, stats, plan, keys, routing)
    baselines = baseline_plans(inputs, plan, routing)
    log(f"search: {len(candidates)} candidates and {len(baselines)} baselines within {target:.0%} of full-width "
        f"bytes")
    results = []
    best = None
    best_by_key: dict[str, float] = {}
    for hot, cold, warm, cold_width, cut, rule, with_d in candidates:
        key = with_d.combination_key
        cand = with_d.with_tiers(TierWidths(inter, warm, cold_width), layer_plans(inputs, stats, cut, rule, key))
        sc = held_out_scores(inputs, weights, cand)
        rec = {"hot_mass": hot, "cold_mass": cold, "warm_width": warm, "dominance": rule,
               "bytes_fraction": bytes_fraction(cand, routing), "loss": sc.loss, "accuracy": sc.accuracy}
        if cfg.search_cold_widths != (0.0,):
            rec["cold_width"] = cold_width
        if inputs.top_k > 2:
            rec["num_dominant"] = cand.num_dominant
        if len(keys) > 1 or key is not CombinationKey.LEADING_PAIR:
            rec["combination_key"] = key.value
        results.append(rec)
        best_by_key[key.value] = min(best_by_key.get(key.value, rec["loss"]), rec["loss"])
        if best is None or rec["loss"] < best[0]["loss"]:
            best = (rec, cand, cut, warm, rule)
    if best is None:
        raise CliError(f"--search-target-bytes {target}: no tier setting reaches it (dominant experts alone "
                       f"need more); raise the target")
    rec, cand, cut, warm, rule = best
    cold_width = cand.tier_widths.cold
    log(f"search: best CRISP hot_mass={rec['hot_mass']} cold_mass={rec['cold_mass']} warm_width={warm} "
        + (f"cold_width={cold_width} " if cold_width else "") +
        f"dominance={rule} num_dominant={cand.num_dominant} key={cand.combination_key.value} "
        f"(bytes {rec['bytes_fraction']:.1%}, loss {rec['loss']:.4f} vs full {full_scores.loss:.4f})")
    chosen = CrispPlan.crisp(
        inputs.num_experts, inputs.top_k, inter, cand.layers, cand.tier_widths, unseen_tier=cand.unseen_tier,
        num_dominant=cand.num_dominant, combination_key=cand.combination_key,
        description=description(inputs, cut, warm, rule, cand.num_dominant, cold=cold_width,
                                key=cand.combination_key)
        + f" Tier cut-offs and Warm width chosen by a search for "
        f"<= {target:.0%} of full-width bytes per token on held-out calibration windows (lowest loss).",
    )
    best_by_kind = {"crisp": rec["loss"]}
    baseline_records = []
    for base_rec, base in baselines:
        sc = held_out_scores(inputs, weights, base)
        base_rec.update(loss=sc.loss, accuracy=sc.accuracy)
        baseline_records.append(base_rec)
        kind = base_rec["kind"]
        best_by_kind[kind] = min(best_by_kind.get(kind, sc.loss), sc.loss)
        if sc.loss < rec["loss"]:  # strictly: on a tie the CRISP plan stays
            rec, chosen = base_rec, _baseline_described(base, base_rec, target, best_by_kind["crisp"])
    kind = rec.get("kind", "crisp")
    losses = ", ".join(f"{k} {best_by_kind[k]:.4f}" if k in best_by_kind else f"{k} over the target"
                       for k in ("crisp", *BASELINE_KINDS))
    log(f"search: chose {kind} (held-out calibration loss {losses}; full width {full_scores.loss:.4f}; "
        f"bytes {rec['bytes_fraction']:.1%})")
    info = {"target_bytes_fraction": target, "chosen_kind": kind, "chosen": rec,
            "full_width": {"loss": full_scores.loss, "accuracy": full_scores.accuracy},
            "best_loss_by_kind": best_by_kind, "baselines": baseline_records, "candidates": results}
    if len(keys) > 1:
        info["best_crisp_loss_by_key"] = best_by_key
    return chosen, info


def rekeyed_plans(inputs: ProfileInputs, stats: Stats, plan: CrispPlan, search: dict | None) -> list[CrispPlan]:
    """A CRISP ``plan``'s tiers over each other key this run may use (``ProfileConfig.candidate_keys``), at its
    cut-offs (the search's choice, else the command line's), with its widths and knobs and the routing-weight rule:
    the throughput search's extra candidates. None for another policy or a single key."""
    keys = inputs.cfg.candidate_keys(inputs.top_k)
    if plan.policy is not PolicyKind.CRISP or len(keys) < 2:
        return []
    chosen = (search or {}).get("chosen", {})
    cut = TierCutoffs(chosen["hot_mass"], chosen["cold_mass"]) if "hot_mass" in chosen else inputs.cutoffs
    out = []
    for key in keys:
        if key is plan.combination_key:
            continue
        tiers = plan.with_tiers(layers=layer_plans(inputs, stats, cut, "routing-weight", key), combination_key=key)
        out.append(dataclasses.replace(tiers, description=description(
            inputs, cut, plan.tier_widths.warm, "routing-weight", plan.num_dominant, cold=plan.tier_widths.cold,
            key=key)))
    return out


def _baseline_described(base: CrispPlan, rec: dict, target: float, crisp_loss: float) -> CrispPlan:
    """The baseline the search chose, its description saying what it is and why it was chosen."""
    return dataclasses.replace(base, description=(
        f"{baseline_description(base)} Chosen by crisp-profile's search for <= {target:.0%} of full-width bytes "
        f"per token on held-out calibration windows (lowest loss): held-out loss {rec['loss']:.4f} against "
        f"{crisp_loss:.4f} for the best CRISP tier setting."))
