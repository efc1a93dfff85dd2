"""``crisp-profile``: tiers and a CRISP plan from the statistics.

Tiers per layer with ``assign_tiers`` over the combinations of the plan's key (leading pair or leading expert,
``crisp_runtime.planning.pairs.CombinationKey``; Hot = most frequent combinations carrying ``--hot-mass`` of
activations, Cold = least frequent carrying at most ``--cold-mass``), the dominant expert of each
pair by the rule in use (``dominance.py``; a leading expert is the dominant itself), the Warm width from
``--warm-width``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from crisp_runtime.planning.pairs import CombinationKey
from crisp_runtime.planning.plan import CrispPlan, LayerPlan, Tier, TierCutoffs, TierWidths, assign_tiers

from .dominance import dominance_report, dominant
from .statistics import Stats, key_counts

if TYPE_CHECKING:
    from .inputs import ProfileInputs


def layer_plans(inputs: ProfileInputs, stats: Stats, cutoffs: TierCutoffs, rule: str,
                key: CombinationKey = CombinationKey.LEADING_PAIR) -> dict[int, LayerPlan]:
    """{layer_id: LayerPlan}: tiers of the seen combinations of ``key`` and, with the "measured" rule (leading
    pairs only), their dominant labels."""
    if rule == "measured" and key is not CombinationKey.LEADING_PAIR:
        raise ValueError(f"the measured dominance rule labels leading pairs, not {key.value!r} combinations")
    layers = {}
    for i, layer_id in enumerate(inputs.layer_ids):
        tiers = assign_tiers(key_counts(stats, i, key, inputs.num_experts), cutoffs)
        labels = {p: dominant(stats, i, *p)[0] for p in tiers} if rule == "measured" else {}
        layers[layer_id] = LayerPlan(tiers, labels)
    return layers


def initial_plan(inputs: ProfileInputs, stats: Stats, rule: str, log: Callable[[str], None],
                 key: CombinationKey = CombinationKey.LEADING_PAIR) -> tuple[CrispPlan, dict]:
    """The plan at the command line's cut-offs and Warm width, and pack.json's dominance record."""
    cfg = inputs.cfg
    info = dominance_report(inputs, stats)
    warm = round(cfg.warm_width * inputs.inter)
    dominants = cfg.num_dominant or 1
    plan = CrispPlan.crisp(
        inputs.num_experts, inputs.top_k, inputs.inter, layer_plans(inputs, stats, inputs.cutoffs, rule, key),
        TierWidths(inputs.inter, warm, 0), unseen_tier=Tier.WARM, num_dominant=dominants,
        description=description(inputs, inputs.cutoffs, warm, rule, dominants, key=key), combination_key=key,
    )
    measured = info["dominance_measured_pairs"]
    log(f"plan: {measured} pairs with measured dominance; routing-weight proxy agrees on "
        f"{info['dominance_proxy_agreement'] if measured else float('nan'):.1%}")
    return plan, info


def description(inputs: ProfileInputs, cutoffs: TierCutoffs, warm: int, rule: str, num_dominant: int = 1, *,
                cold: int = 0, key: CombinationKey = CombinationKey.LEADING_PAIR) -> str:
    """The plan's description: how its combinations, tiers, widths and dominants were chosen."""
    if key is CombinationKey.LEADING_EXPERT:
        text = _description_expert(inputs, cutoffs, warm, cold)
    else:
        text = _description_pair(inputs, cutoffs, warm, rule, cold)
    if inputs.top_k > 2:
        first = ("the leading pair's dominant, then the other experts by routing weight"
                 if key is CombinationKey.LEADING_PAIR else "the heaviest by routing weight")
        text += (
            f" Top-{inputs.top_k} routing: the {num_dominant} dominant expert(s) of a token (ranks below "
            f"{num_dominant}: {first}) run full width, the other {inputs.top_k - num_dominant} routed experts take "
            f"the tier's width.")
    return text


def _description_expert(inputs: ProfileInputs, cutoffs: TierCutoffs, warm: int, cold: int) -> str:
    inter = inputs.inter
    return (
        f"CRISP plan from crisp-profile: combination = leading expert by routing weight (the heaviest routed "
        f"expert of a token); tiers by share of activations (hot_mass={cutoffs.hot_mass}, "
        f"cold_mass={cutoffs.cold_mass}); widths of the non-dominant experts hot={inter}, warm={warm}, cold={cold} "
        f"of {inter}; the heaviest expert of each token is dominant; unseen leading experts are Warm."
    )


def _description_pair(inputs: ProfileInputs, cutoffs: TierCutoffs, warm: int, rule: str, cold: int = 0) -> str:
    inter = inputs.inter
    common = (
        f"CRISP plan from crisp-profile: combination = leading pair by routing weight; tiers by share of "
        f"activations (hot_mass={cutoffs.hot_mass}, cold_mass={cutoffs.cold_mass}); widths of the "
        f"non-dominant expert hot={inter}, warm={warm}, cold={cold} of {inter}; "
    )
    if rule == "routing-weight":
        return common + ("dominance rule 'routing-weight': the heavier expert of each token is dominant (no "
                         "per-pair labels); unseen pairs are Warm.")
    return common + (
        f"dominance measured by masking each member (loss increase per masked token) for pairs seen on >= "
        f"{inputs.cfg.dominance_min_tokens} tokens of the dominance windows, rarer pairs fall back to the "
        f"routing-weight proxy (larger mean routing weight within the pair); unseen pairs are Warm with the "
        f"heavier expert dominant."
    )
