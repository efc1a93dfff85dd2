"""The prefix cache against a brute-force replay: budget, bytes, contents; eviction policies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_helpers import ReplayCache, random_layers

from crisp_runtime import CacheBudgetError, FrequencyPolicy, LRUPolicy, Tier, TierAwarePolicy
from crisp_runtime.planning.plan import LayerPlan
from crisp_runtime.residency.device_cache import PrefixCache
from crisp_runtime.residency.eviction import make_policy
from crisp_runtime.residency.host_store import HostStore

LAYERS = random_layers(layer_ids=(0, 3), num_experts=5, inter=12, symmetric=False)
SYM_LAYERS = random_layers(layer_ids=(0, 3), num_experts=5, inter=12, symmetric=True, seed=1)


def check_prefix(store, layer_id, expert, width, got):
    host = store.expert(layer_id, expert).prefix(width)
    assert got.width == width
    assert torch.equal(got.qweight, host.qweight)
    assert torch.equal(got.scales, host.scales)
    if host.zeros is None:
        assert got.zeros is None
    else:
        assert torch.equal(got.zeros, host.zeros)


@st.composite
def request_sequences(draw):
    steps = draw(st.lists(
        st.lists(st.tuples(st.sampled_from([0, 3]), st.integers(0, 4), st.integers(1, 12)), min_size=1, max_size=4),
        min_size=1, max_size=12))
    # One request per key and step, as the scheduler issues them (the width is the max over the step's tokens).
    out = []
    for step in steps:
        merged = {}
        for layer_id, e, w in step:
            merged[(layer_id, e)] = max(w, merged.get((layer_id, e), 0))
        out.append(list(merged.items()))
    return out


@settings(max_examples=80, deadline=None)
@given(request_sequences(), st.integers(1, 60), st.booleans())
def test_cache_matches_brute_force_replay(steps, budget_neurons, symmetric):
    layers = SYM_LAYERS if symmetric else LAYERS
    store = HostStore(layers, pin=False)
    nb = {i: store.neuron_nbytes(i) for i in layers}
    budget = 12 * nb[0] + budget_neurons * nb[0]  # at least one full expert
    cache = PrefixCache(store, budget, "cpu", LRUPolicy())
    replay = ReplayCache(budget, nb)
    copied = evictions = 0
    kinds = []
    for step in steps:
        pending = {key for key, _ in step}
        for key, width in step:
            got = cache.acquire(key[0], key[1], width, protected=pending)
            pending.discard(key)
            replay.request(key, width, pending)
            copied += got.copied_bytes
            evictions += got.evictions
            kinds.append(got.kind)
            check_prefix(store, key[0], key[1], width, got.expert)
            assert cache.used <= budget
            assert cache.used == sum(w * nb[k[0]] for k, w in cache.resident().items())
    assert cache.resident() == replay.resident
    assert copied == replay.copied
    assert evictions == replay.evictions
    assert kinds == replay.kinds
    assert cache.peak <= budget


def test_widening_copies_only_missing_rows():
    store = HostStore(LAYERS, pin=False)
    nb = store.neuron_nbytes(0)
    cache = PrefixCache(store, 100 * nb, "cpu")
    a = cache.acquire(0, 2, 4)
    assert (a.kind, a.copied_bytes) == ("miss", 4 * nb)
    b = cache.acquire(0, 2, 10)
    assert (b.kind, b.copied_bytes) == ("widen", 6 * nb)
    c = cache.acquire(0, 2, 7)
    assert (c.kind, c.copied_bytes) == ("hit", 0)
    check_prefix(store, 0, 2, 10, b.expert)
    check_prefix(store, 0, 2, 7, c.expert)
    assert cache.used == 10 * nb


def test_budget_errors():
    store = HostStore(LAYERS, pin=False)
    nb = store.neuron_nbytes(0)
    for bad in (0, -5):
        with pytest.raises(ValueError, match="positive"):
            PrefixCache(store, bad, "cpu")
    cache = PrefixCache(store, 5 * nb, "cpu")
    with pytest.raises(CacheBudgetError, match="exceeds the whole budget"):
        cache.acquire(0, 0, 6)
    cache.acquire(0, 0, 5)
    assert cache.used == 5 * nb


def test_frequency_policy_keeps_often_used():
    p = FrequencyPolicy()
    for key, uses in (((0, 0), 3), ((0, 1), 1), ((0, 2), 2)):
        p.on_insert(key)
        for _ in range(uses):
            p.on_use(key)
    assert p.victim(set()) == (0, 1)
    assert p.victim({(0, 1)}) == (0, 2)
    p.on_remove((0, 1))
    assert p.victim(set()) == (0, 2)


def test_lru_policy_order():
    p = LRUPolicy()
    for key in ((0, 0), (0, 1), (0, 2)):
        p.on_insert(key)
    p.on_use((0, 0))
    assert p.victim(set()) == (0, 1)
    assert p.victim({(0, 1), (0, 2)}) == (0, 0)
    assert p.victim({(0, 0), (0, 1), (0, 2)}) is None


def test_tier_policy_keeps_hot_experts():
    from crisp_runtime import CrispPlan, TierWidths

    lp = LayerPlan({(0, 1): Tier.HOT, (2, 3): Tier.WARM}, {(0, 1): 0, (2, 3): 2})
    plan = CrispPlan.crisp(5, 2, 12, {0: lp}, TierWidths(12, 6, 0))
    p = TierAwarePolicy(plan)
    for e in (0, 2, 4, 1):
        p.on_insert((0, e))
    assert p.victim(set()) == (0, 4)  # in no combination
    assert p.victim({(0, 4)}) == (0, 2)  # warm before hot
    assert p.victim({(0, 4), (0, 2)}) == (0, 0)  # then LRU among hot


def test_a_policy_instance_is_told_the_plan_as_a_named_one_is():
    """RuntimeConfig(eviction=TierAwarePolicy()) goes through make_policy(spec, plan): the instance must get the
    plan's tiers, as make_policy("tier", plan) does (before, an instance was returned untold: no tiers, LRU)."""
    from crisp_runtime import CrispPlan, TierWidths

    lp = LayerPlan({(0, 1): Tier.HOT, (2, 3): Tier.WARM}, {(0, 1): 0, (2, 3): 2})
    plan = CrispPlan.crisp(5, 2, 12, {0: lp}, TierWidths(12, 6, 0))
    mine = TierAwarePolicy()
    assert make_policy(mine, plan) is mine
    assert mine.priority == make_policy("tier", plan).priority == {(0, 0): 2, (0, 1): 2, (0, 2): 1, (0, 3): 1}


def test_make_policy():
    assert isinstance(make_policy("frequency"), FrequencyPolicy)
    assert isinstance(make_policy(LRUPolicy), LRUPolicy)
    with pytest.raises(ValueError, match="eviction"):
        make_policy("random")


def test_cache_with_frequency_policy_stays_in_budget():
    store = HostStore(LAYERS, pin=False)
    nb = store.neuron_nbytes(0)
    cache = PrefixCache(store, 20 * nb, "cpu", FrequencyPolicy())
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        e = int(torch.randint(0, 5, (1,), generator=g))
        w = int(torch.randint(1, 13, (1,), generator=g))
        got = cache.acquire(3, e, w)
        check_prefix(store, 3, e, w, got.expert)
        assert cache.used <= 20 * nb
