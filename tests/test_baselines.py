"""Equal-bytes baselines (crisp_runtime.planning.baselines) against brute force over every width / threshold."""

from __future__ import annotations

import itertools

import pytest
import torch

from crisp_runtime.planning.baselines import (
    baseline_description,
    dominant_and_aux_weights,
    equal_bytes_plans,
    matched_skip_threshold,
    matched_uniform_width,
    neurons_per_token,
)
from crisp_runtime.planning.plan import CrispPlan, LayerPlan, Tier, TierWidths, pair_key

E, INTER = 16, 24
LAYERS = (1, 3)


def _routing(top_k: int, tokens: int, seed: int, ties: bool = False, padding: bool = False):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer_id in LAYERS:
        index = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, generator=g).softmax(dim=1)
        if ties:  # coarse weights: many equal values across and within tokens
            weights = (weights * 10).round() / 10
        if padding:  # some slots carry a sentinel index (no expert)
            index[::5, -1] = E
        out[layer_id] = (index, weights.float())
    return out


def _crisp_plan(top_k: int, num_dominant: int, seed: int) -> CrispPlan:
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for layer_id in LAYERS:
        tiers = {}
        for a, b in itertools.combinations(range(E), 2):
            tiers[pair_key(a, b)] = (Tier.HOT, Tier.WARM, Tier.COLD)[int(torch.randint(3, (1,), generator=g))]
        layers[layer_id] = LayerPlan(tiers, {})
    return CrispPlan.crisp(E, top_k, INTER, layers, TierWidths(INTER, 7, 0), num_dominant=num_dominant)


def _brute_uniform(routing, target, top_k):
    best = None
    for w in range(1, INTER + 1):
        got = neurons_per_token(CrispPlan.uniform(E, top_k, INTER, LAYERS, w), routing)
        if best is None or abs(got - target) < best[0] - 1e-12:
            best = (abs(got - target), w)
    return best[0]


def _brute_skip(routing, target, top_k, num_dominant):
    candidates = [None, 0.0] + sorted({float(x) for _, w in routing.values() for x in w.reshape(-1)})
    best = None
    for thr in candidates:
        plan = CrispPlan.skip_aux(E, top_k, INTER, LAYERS, threshold=thr, num_dominant=num_dominant)
        got = neurons_per_token(plan, routing)
        if best is None or abs(got - target) < best:
            best = abs(got - target)
    return best


CASES = [  # (top_k, num_dominant, ties, padding): top-2 Mixtral, top-6 DeepSeek with 1-3 dominants per token
    (2, 1, False, False), (2, 1, True, False), (2, 2, False, False), (6, 1, False, False), (6, 2, False, False),
    (6, 3, True, False), (6, 2, False, True), (4, 2, True, True),
]


@pytest.mark.parametrize("top_k,num_dominant,ties,padding", CASES)
@pytest.mark.parametrize("target_fraction", [0.15, 0.4, 0.55, 0.8, 1.0])
def test_matched_baselines_equal_brute_force(top_k, num_dominant, ties, padding, target_fraction):
    routing = _routing(top_k, 40, seed=top_k * 10 + num_dominant, ties=ties, padding=padding)
    target = target_fraction * top_k * INTER * len(LAYERS)
    width = matched_uniform_width(routing, target, num_experts=E, intermediate_size=INTER)
    got = neurons_per_token(CrispPlan.uniform(E, top_k, INTER, LAYERS, width), routing)
    assert abs(got - target) == pytest.approx(_brute_uniform(routing, target, top_k), abs=1e-9)

    thr = matched_skip_threshold(routing, target, num_experts=E, intermediate_size=INTER, num_dominant=num_dominant)
    plan = CrispPlan.skip_aux(E, top_k, INTER, LAYERS, threshold=thr, num_dominant=num_dominant)
    got = neurons_per_token(plan, routing)
    assert abs(got - target) == pytest.approx(_brute_skip(routing, target, top_k, num_dominant), abs=1e-9)


@pytest.mark.parametrize("top_k,num_dominant,ties,padding", CASES)
@pytest.mark.parametrize("target_fraction", [0.15, 0.4, 0.55, 0.8, 1.0])
def test_matched_at_most_is_the_closest_not_above(top_k, num_dominant, ties, padding, target_fraction):
    """at_most (a search within a bytes budget): the most neurons per token that do not exceed the target, over every
    width / threshold; width 1 and skip-every-auxiliary when nothing fits."""
    routing = _routing(top_k, 40, seed=top_k * 10 + num_dominant, ties=ties, padding=padding)
    target = target_fraction * top_k * INTER * len(LAYERS)
    width = matched_uniform_width(routing, target, num_experts=E, intermediate_size=INTER, at_most=True)
    widths = [w for w in range(1, INTER + 1)
              if neurons_per_token(CrispPlan.uniform(E, top_k, INTER, LAYERS, w), routing) <= target + 1e-9]
    assert width == (max(widths) if widths else 1)

    thr = matched_skip_threshold(routing, target, num_experts=E, intermediate_size=INTER, num_dominant=num_dominant,
                                 at_most=True)

    def cost(t):
        return neurons_per_token(CrispPlan.skip_aux(E, top_k, INTER, LAYERS, threshold=t, num_dominant=num_dominant),
                                 routing)

    fitting = [cost(t) for t in [None, 0.0] + sorted({float(x) for _, w in routing.values() for x in w.reshape(-1)})
               if cost(t) <= target + 1e-9]
    assert cost(thr) == pytest.approx(max(fitting) if fitting else cost(None), abs=1e-9)
    assert not fitting or cost(thr) <= target + 1e-9
    plans = equal_bytes_plans(_crisp_plan(top_k, num_dominant, seed=3), routing, target, at_most=True)
    assert plans["uniform"].uniform_width == width and plans["skip_aux"].skip_threshold == thr


@pytest.mark.parametrize("top_k,num_dominant", [(2, 1), (6, 2), (6, 3)])
def test_equal_bytes_plans_match_the_crisp_plan(top_k, num_dominant):
    routing = _routing(top_k, 64, seed=7)
    crisp = _crisp_plan(top_k, num_dominant, seed=3)
    plans = equal_bytes_plans(crisp, routing)
    assert list(plans) == ["full", "uniform", "skip_aux", "crisp"]
    target = neurons_per_token(crisp, routing)
    assert neurons_per_token(plans["full"], routing) == top_k * INTER * len(LAYERS)
    assert plans["skip_aux"].num_dominant == num_dominant
    # uniform: within half a width step of the target (a step costs top_k x layers neurons per token)
    step = top_k * len(LAYERS)
    assert abs(neurons_per_token(plans["uniform"], routing) - target) <= step / 2 + 1e-9
    # skip-aux: within half an auxiliary expert (INTER neurons) over the 64 tokens (no ties here)
    assert abs(neurons_per_token(plans["skip_aux"], routing) - target) <= INTER / 64 / 2 + 1e-9
    # the dominant experts of skip_aux run full width: never below num_dominant x INTER per layer
    for layer_id, (index, weights) in routing.items():
        widths = plans["skip_aux"].token_widths(layer_id, index, weights)
        assert ((widths == INTER).sum(dim=1) >= num_dominant).all()


def test_aux_weights_are_all_but_the_num_dominant_heaviest():
    index = torch.tensor([[0, 1, 2, 3], [4, 5, E, 6]])
    weights = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.5, 0.2, 0.9, 0.3]])
    dominant, aux = dominant_and_aux_weights({0: (index, weights)}, E, num_dominant=2)
    assert dominant == 4
    assert sorted(aux.tolist()) == pytest.approx([0.1, 0.2, 0.2])  # token 1: slot 2 is padding


def test_skip_threshold_extremes():
    routing = _routing(2, 20, seed=1)
    kw = dict(num_experts=E, intermediate_size=INTER, num_dominant=1)
    assert matched_skip_threshold(routing, 1 * INTER * len(LAYERS), **kw) is None  # dominant only
    thr = matched_skip_threshold(routing, 2 * INTER * len(LAYERS), **kw)  # everything kept
    assert thr == pytest.approx(min(float(w.min()) for _, w in routing.values()))


@pytest.mark.parametrize("bad", [{}, {0: (torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 3))},
                                 {0: (torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2)),
                                  1: (torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2))}])
def test_bad_routing_is_refused(bad):
    with pytest.raises(ValueError, match="routing"):
        matched_uniform_width(bad, 10.0, num_experts=E, intermediate_size=INTER)


@pytest.mark.parametrize("plan, text", [
    (CrispPlan.uniform(E, 2, INTER, LAYERS, 9), "every routed expert runs its first 9 of 24 neurons"),
    (CrispPlan.skip_aux(E, 6, INTER, LAYERS, threshold=0.25, num_dominant=3),
     "the 3 heaviest routed expert(s) of a token by routing weight run full width, every other routed expert runs "
     "full width when its routing weight is >= 0.25 and is skipped otherwise"),
    (CrispPlan.skip_aux(E, 2, INTER, LAYERS), "every other routed expert is skipped"),
])
def test_baseline_description_says_what_the_plan_does(plan, text):
    assert text in baseline_description(plan)


def test_baseline_description_refuses_other_plans():
    with pytest.raises(ValueError, match="skip_aux or uniform"):
        baseline_description(_crisp_plan(2, 1, seed=0))
