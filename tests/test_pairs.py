"""Combination keys, leading-pair codes, counts and skew (crisp_runtime.planning.pairs) against plain-Python
definitions."""

from __future__ import annotations

import itertools

import pytest
import torch

from crisp_runtime.planning.pairs import (
    CombinationKey,
    combination_code,
    combination_codes,
    combination_counts,
    combination_of,
    counts_by_combination,
    counts_by_pair,
    leading_pairs,
    pair_codes,
    pair_counts,
    pair_skew,
)
from crisp_runtime.planning.plan import CrispPlan, LayerPlan, Tier, TierWidths, pair_key


def _routing(tokens, num_experts, top_k, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).softmax(dim=1)
    if ties:
        weights = (weights * 4).round() / 4
    return index, weights


@pytest.mark.parametrize("top_k,ties", [(2, False), (2, True), (6, False), (6, True)])
def test_pairs_match_plain_python(top_k, ties):
    E = 12
    index, weights = _routing(200, E, top_k, seed=top_k, ties=ties)
    first, second = leading_pairs(index, weights)
    expect_counts = {}
    for t in range(index.shape[0]):
        # heaviest two by weight, ties in router order
        order = sorted(range(top_k), key=lambda j: -float(weights[t, j]))
        a, b = int(index[t, order[0]]), int(index[t, order[1]])
        assert (int(first[t]), int(second[t])) == (a, b)
        assert int(pair_codes(index[t : t + 1], weights[t : t + 1], E)) == min(a, b) * E + max(a, b)
        expect_counts[pair_key(a, b)] = expect_counts.get(pair_key(a, b), 0) + 1
    counts = pair_counts(index, weights, E)
    assert counts_by_pair(counts) == expect_counts
    assert int(counts.tril().sum()) == 0 and int(counts.sum()) == index.shape[0]


@pytest.mark.parametrize("top_k", [2, 6])
def test_leading_pair_is_what_the_plan_keys_on(top_k):
    """A plan with one Hot pair per layer: exactly the tokens whose leading pair it is run the auxiliary full."""
    E, inter = 12, 8
    index, weights = _routing(100, E, top_k, seed=5)
    codes = pair_codes(index, weights, E)
    hot = int(codes.mode().values)
    a, b = divmod(hot, E)
    tiers = {pair_key(x, y): Tier.COLD for x, y in itertools.combinations(range(E), 2)}
    tiers[(a, b)] = Tier.HOT
    plan = CrispPlan.crisp(E, top_k, inter, {0: LayerPlan(tiers, {})}, TierWidths(inter, 4, 0))
    widths = plan.token_widths(0, index, weights)
    hot_tokens = (widths == inter).sum(dim=1) == top_k
    assert torch.equal(hot_tokens, codes == hot)


@pytest.mark.parametrize("key", list(CombinationKey))
@pytest.mark.parametrize("top_k,ties", [(2, False), (6, False), (6, True)])
def test_combination_keys_match_plain_python(key, top_k, ties):
    """Each key names a token's combination from its two heaviest experts (ties: router order): the leading pair
    unordered, or the heaviest expert alone; codes, counts and the count dict agree with that."""
    E = 12
    index, weights = _routing(300, E, top_k, seed=11 + top_k, ties=ties)
    codes = combination_codes(key, index, weights, E)
    expect = {}
    for t in range(index.shape[0]):
        order = sorted(range(top_k), key=lambda j: -float(weights[t, j]))
        a, b = int(index[t, order[0]]), int(index[t, order[1]])
        combo = (min(a, b), max(a, b)) if key is CombinationKey.LEADING_PAIR else (a,)
        assert combination_of(key, a, b) == combo
        assert int(codes[t]) == combination_code(key, combo, E) < key.code_count(E)
        expect[combo] = expect.get(combo, 0) + 1
    counts = combination_counts(key, index, weights, E)
    assert counts.shape == (key.code_count(E),) and counts_by_combination(key, counts, E) == expect


@pytest.mark.parametrize("key", list(CombinationKey))
@pytest.mark.parametrize("top_k,tokens", [(6, 100), (6, 8), (2, 100)])
def test_combination_is_what_the_plan_keys_on(key, top_k, tokens):
    """A plan with one Hot combination per layer and every other one Cold: exactly the tokens of that combination
    run all their routed experts full width (vectorized and small-step lookups alike)."""
    E, inter = 12, 8
    index, weights = _routing(tokens, E, top_k, seed=9)
    codes = combination_codes(key, index, weights, E)
    hot = int(codes.mode().values)
    every = ([pair_key(x, y) for x, y in itertools.combinations(range(E), 2)] if key is CombinationKey.LEADING_PAIR
             else [(e,) for e in range(E)])
    tiers = {c: Tier.COLD for c in every}
    (hot_combo,) = [c for c in every if combination_code(key, c, E) == hot]
    tiers[hot_combo] = Tier.HOT
    plan = CrispPlan.crisp(E, top_k, inter, {0: LayerPlan(tiers, {})}, TierWidths(inter, 4, 0), combination_key=key)
    widths = plan.token_widths(0, index, weights)
    hot_tokens = (widths == inter).sum(dim=1) == top_k
    assert torch.equal(hot_tokens, codes == hot) and bool(hot_tokens.any())


def test_skew_definition():
    E = 5  # C(5, 2) = 10 pairs: top 25% = round(2.5) = 2 pairs, bottom 29% = round(2.9) = 3 pairs
    counts = torch.zeros(E, E, dtype=torch.int64)
    values = [40, 20, 10, 10, 8, 6, 4, 2, 0, 0]
    for (a, b), v in zip(itertools.combinations(range(E), 2), values, strict=True):
        counts[a, b] = v
    s = pair_skew(counts)
    assert s.possible == 10 and s.seen == 8 and s.tokens == 100
    assert s.top_share == pytest.approx((40 + 20) / 100)
    assert s.bottom_share == pytest.approx((2 + 0 + 0) / 100)
    uniform = torch.triu(torch.ones(E, E, dtype=torch.int64), diagonal=1)
    u = pair_skew(uniform, 0.5, 0.5)
    assert u.top_share == pytest.approx(0.5) and u.bottom_share == pytest.approx(0.5)
    assert pair_skew(torch.zeros(E, E, dtype=torch.int64)).top_share == 0.0


@pytest.mark.parametrize("bad", [dict(counts=torch.zeros(3, 4)), dict(counts=torch.zeros(4, 4), top_fraction=0.0),
                                 dict(counts=torch.zeros(4, 4), bottom_fraction=1.5)])
def test_skew_refuses_bad_input(bad):
    with pytest.raises(ValueError):
        pair_skew(**bad)


def test_leading_pairs_refuses_top1():
    with pytest.raises(ValueError, match="k >= 2"):
        leading_pairs(torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))


def test_trainer_skew_is_the_routed_set_skew_for_top2():
    """tools/train_tiny_moe.pair_skew (now on crisp_runtime.planning.pairs) = counting each token's routed top-2 set."""
    transformers = pytest.importorskip("transformers")
    from crisp_tools.train_tiny_moe import pair_skew as trainer_skew

    from crisp_runtime.hf.moe_layers import record_routing

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=6,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(cfg).eval()
    seqs = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(2))
    report = trainer_skew(model, seqs, batch_size=2)
    with torch.no_grad(), record_routing(model) as routing:
        model(input_ids=seqs, use_cache=False)
    for layer_report, layer_id in zip(report, (0, 1), strict=True):
        index, _ = routing.layer(layer_id)
        sets = {}
        for row in index.tolist():
            key = tuple(sorted(row))
            sets[key] = sets.get(key, 0) + 1
        counts = sorted([sets.get(p, 0) for p in itertools.combinations(range(6), 2)], reverse=True)
        n_top, n_bottom = round(0.25 * 15), round(0.29 * 15)  # C(6, 2) = 15 pairs: 4 and 4
        assert layer_report["tokens"] == 120 and layer_report["combinations"] == 15
        assert layer_report[f"top_{n_top}_share"] == pytest.approx(sum(counts[:n_top]) / 120)
        assert layer_report[f"bottom_{n_bottom}_share"] == pytest.approx(sum(counts[-n_bottom:]) / 120)
        assert layer_report["unused_combinations"] == sum(c == 0 for c in counts)
