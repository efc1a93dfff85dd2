"""Belady's furthest-next-use against brute force: with prefixes of one size it needs the fewest
misses (hence bytes) of any eviction sequence, replayed through the runtime's residency ledger."""

from __future__ import annotations

import functools
import random

import pytest

from crisp_runtime.residency.eviction import BeladyPolicy, LRUPolicy, NextUsePolicy
from crisp_runtime.residency.ledger import ResidencyLedger

WIDTH = 4  # every prefix full width: equal sizes, where MIN is optimal
NB = 3


def replay(steps, capacity, policy):
    """Misses and bytes of a layer-step sequence through the ledger (the runtime's protection rule)."""
    layers = sorted({layer for layer, _ in steps})
    ledger = ResidencyLedger(capacity * WIDTH * NB, {i: NB for i in layers}, {i: WIDTH for i in layers}, policy)
    for layer, experts in steps:
        pending = {(layer, e) for e in experts}
        for e in experts:
            ledger.request(layer, e, WIDTH, protected=pending)
            pending.discard((layer, e))
            assert ledger.used <= ledger.budget
    c = ledger.counters
    return c.misses, c.bytes_copied


def brute_force_misses(steps, capacity):
    """Fewest misses over every choice of victim (victims never among the step's pending experts)."""
    flat = [(layer, e, tuple((layer, x) for x in experts[i + 1:]))
            for layer, experts in steps for i, e in enumerate(experts)]

    @functools.cache
    def best(i, resident):
        if i == len(flat):
            return 0
        layer, e, pending = flat[i]
        key = (layer, e)
        if key in resident:
            return best(i + 1, resident)
        if len(resident) < capacity:
            return 1 + best(i + 1, resident | {key})
        options = [v for v in resident if v not in pending]
        return 1 + min(best(i + 1, (resident - {v}) | {key}) for v in options)

    return best(0, frozenset())


def random_steps(seed, num_layers, num_experts, tokens, k):
    rng = random.Random(seed)
    skew = [rng.random() ** 2 for _ in range(num_experts)]  # some experts much more likely: realistic reuse
    steps = []
    for _ in range(tokens):
        for layer in range(num_layers):
            steps.append((layer, _distinct(rng, num_experts, k, skew)))
    return steps


def _distinct(rng, n, k, weights):
    out: list[int] = []
    while len(out) < k:
        e = rng.choices(range(n), weights=weights)[0]
        if e not in out:
            out.append(e)
    return out


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("num_layers", "num_experts", "k", "capacity"), [(1, 5, 1, 2), (2, 3, 1, 3), (2, 4, 2, 3),
                                                                          (3, 3, 2, 4)])
def test_belady_needs_the_fewest_misses(seed, num_layers, num_experts, k, capacity):
    steps = random_steps(seed, num_layers, num_experts, tokens=6, k=k)
    misses, nbytes = replay(steps, capacity, BeladyPolicy(steps))
    optimum = brute_force_misses(steps, capacity)
    assert misses == optimum
    assert nbytes == optimum * WIDTH * NB
    for online in (LRUPolicy(), NextUsePolicy()):  # the bound is a bound
        assert replay(steps, capacity, online)[0] >= optimum


def test_belady_evicts_what_is_never_used_again_first():
    steps = [(0, [0]), (0, [1]), (0, [2]), (0, [0])]
    ledger = ResidencyLedger(2 * WIDTH * NB, {0: NB}, {0: WIDTH}, BeladyPolicy(steps))
    evicted = []
    for layer, experts in steps:
        for e in experts:
            evicted += [k for k, _ in ledger.request(layer, e, WIDTH, protected={(layer, e)}).evicted]
    assert evicted == [(0, 1)]  # LRU would have evicted (0, 0), needed again at the last step
    assert ledger.counters.hits == 1


def test_belady_skips_steps_without_uses_and_rejects_uses_past_its_future():
    steps = [(0, [0]), (1, [5]), (0, [1]), (1, [2])]
    policy = BeladyPolicy(steps)
    policy.on_insert((0, 0))
    policy.on_use((0, 0))
    assert policy.cursor == 0
    policy.on_insert((0, 1))
    policy.on_use((0, 1))  # layer 1's step 1 had no use (e.g. skipped): moves to step 2
    assert policy.cursor == 2
    assert policy.next_use((1, 2)) == 3 and policy.next_use((0, 0)) == float("inf")
    policy.on_insert((1, 2))
    policy.on_use((1, 2))
    with pytest.raises(ValueError, match="after the last step routing it"):
        policy.on_use((0, 0))
