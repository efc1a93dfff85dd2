"""Online eviction policies through the residency ledger: next-use prediction in the layer cycle,
frequency-aware admission of one-off auxiliaries, a pinned hot set."""

from __future__ import annotations

import random

import pytest

from crisp_runtime.residency.eviction import LRUPolicy, NextUsePolicy, PinnedPolicy, make_policy
from crisp_runtime.residency.ledger import ResidencyLedger

WIDTH, NB = 4, 5


def ledger(capacity, layers, policy):
    return ResidencyLedger(capacity * WIDTH * NB, {i: NB for i in layers}, {i: WIDTH for i in layers}, policy)


def run(led, steps):
    evicted = []
    for layer, experts in steps:
        pending = {(layer, e) for e in experts}
        for e in experts:
            evicted += [k for k, _ in led.request(layer, e, WIDTH, protected=pending).evicted]
            pending.discard((layer, e))
    return evicted


def cyclic_steps(num_layers, tokens, seed, one_off_rate):
    """Each layer routes its hot expert 0 every token and, now and then, a one-off auxiliary."""
    rng = random.Random(seed)
    steps, fresh = [], 1
    for _ in range(tokens):
        for layer in range(num_layers):
            experts = [0]
            if rng.random() < one_off_rate:
                experts.append(fresh)
                fresh += 1
            steps.append((layer, experts))
    return steps


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_layers", [3, 6])
def test_next_use_keeps_the_hot_experts_where_lru_cycles_them_out(seed, num_layers):
    # Room for every layer's hot expert plus one: LRU evicts the oldest, i.e. the hot expert the
    # next layer needs first; next-use evicts the one-off auxiliary of the previous step.
    steps = cyclic_steps(num_layers, tokens=20, seed=seed, one_off_rate=0.5)
    warm, rest = steps[:4 * num_layers], steps[4 * num_layers:]  # four tokens to learn the reuse rates
    lru, nxt = (ledger(num_layers + 1, range(num_layers), p) for p in (LRUPolicy(), NextUsePolicy()))
    run(lru, warm)
    run(nxt, warm)
    lru_before, nxt_before = lru.counters.misses, nxt.counters.misses
    run(lru, rest)
    evicted = run(nxt, rest)
    assert all(e != 0 for _, e in evicted)  # the hot experts stay
    one_offs = sum(len(e) - 1 for _, e in rest)
    # the one-offs miss, plus at most one reload of each hot expert evicted while the rates were learned
    assert one_offs <= nxt.counters.misses - nxt_before <= one_offs + num_layers
    assert lru.counters.misses - lru_before > nxt.counters.misses - nxt_before


def test_one_off_auxiliary_is_the_next_victim_not_a_hot_dominant():
    led = ledger(3, [0, 1], NextUsePolicy())
    run(led, [(0, [0]), (1, [0])] * 5)  # both hot: used at every visit
    run(led, [(0, [0, 7])])  # a cold auxiliary fills the last slot
    evicted = run(led, [(1, [0, 5])])  # a second one-off needs room: the first one-off goes
    assert evicted == [(0, 7)]
    assert set(led.resident()) == {(0, 0), (1, 0), (1, 5)}


def test_current_layer_experts_not_needed_wait_a_whole_cycle():
    # At the start of a step of layer 1 (before its first use), an unneeded expert of layer 1 is
    # a full cycle away, an expert of layer 2 only one step: the layer-1 one goes.
    policy = NextUsePolicy()
    led = ledger(3, [0, 1, 2], policy)
    run(led, [(0, [0]), (1, [3]), (2, [0])] * 3)
    run(led, [(0, [0])])
    assert led.request(1, 4, WIDTH, protected={(1, 4)}).evicted == (((1, 3), WIDTH),)
    # (2, 0) used at each of layer 2's 3 visits: p = 0.25 -> 0.625 -> 0.8125 -> 0.90625 (decay 0.5)
    assert policy.probability((2, 0)) == pytest.approx(0.90625)
    assert policy.expected_steps((2, 0), current=1) == pytest.approx(1 + 3 * (1 / 0.90625 - 1))


@pytest.mark.parametrize("inner", ["lru", "next_use"])
def test_pinned_keys_go_only_when_nothing_else_can(inner):
    led = ledger(2, [0], PinnedPolicy(make_policy(inner), [(0, 0)]))
    run(led, [(0, [0]), (0, [1]), (0, [2]), (0, [3])])
    assert (0, 0) in led.resident() and led.counters.evictions == 2
    assert set(led.resident()) == {(0, 0), (0, 3)}
    # the only other key protected: the pinned one must go
    assert led.request(0, 4, WIDTH, protected={(0, 3)}).evicted == (((0, 0), WIDTH),)


def test_bad_policy_arguments():
    with pytest.raises(ValueError, match="decay and prior_rate"):
        NextUsePolicy(prior_rate=0.0)
    with pytest.raises(TypeError, match="inner must be an EvictionPolicy"):
        PinnedPolicy("lru", [])
    assert isinstance(make_policy("next_use"), NextUsePolicy)
