"""The decoding simulator against hand-computed timelines (exact float equality: all times are dyadic)."""

import pytest
from crisp_bench.profiles import MIXTRAL_8X7B, HardwareProfile, ModelShape, ProfileError, get_profile
from crisp_bench.simulate import BudgetTooSmall, Job, PrefixCache, flow_shop_bound, schedule, simulate_decode


def ends(slots):
    return [(s.expert, s.copy_start, s.copy_end, s.compute_start, s.compute_end) for s in slots]


A = Job(expert=0, width=4, load_s=4.0, compute_s=1.0)  # uncached, full width
B = Job(expert=1, width=2, load_s=2.0, compute_s=0.5)  # uncached, half width


def test_two_uncached_experts_router_order_wide_first():
    end, slots = schedule([A, B], "serial")
    assert end == 7.5 and ends(slots) == [(0, 0, 4, 4, 5), (1, 5, 7, 7, 7.5)]
    end, slots = schedule([A, B], "router")
    assert end == 6.5 and ends(slots) == [(0, 0, 4, 4, 5), (1, 4, 6, 6, 6.5)]
    end, slots = schedule([A, B], "widest_first")
    assert end == 6.5 and ends(slots) == [(0, 0, 4, 4, 5), (1, 4, 6, 6, 6.5)]


def test_two_uncached_experts_narrow_first_in_router_order():
    # Router order puts the narrow expert first: its compute is hidden, the wide one's is not.
    end, slots = schedule([B, A], "router")
    assert end == 7.0 and ends(slots) == [(1, 0, 2, 2, 2.5), (0, 2, 6, 6, 7)]
    end, slots = schedule([B, A], "widest_first")
    assert end == 6.5 and ends(slots) == [(0, 0, 4, 4, 5), (1, 4, 6, 6, 6.5)]
    end, _ = schedule([B, A], "serial")
    assert end == 7.5


def test_cached_expert_goes_first():
    hit = Job(expert=0, width=4, load_s=0.0, compute_s=1.0)
    end, slots = schedule([B, hit], "router")
    assert end == 3.5 and ends(slots) == [(1, 0, 2, 2, 2.5), (0, 0, 0, 2.5, 3.5)]
    end, slots = schedule([B, hit], "widest_first")
    assert end == 2.5 and ends(slots) == [(0, 0, 0, 0, 1), (1, 0, 2, 2, 2.5)]
    end, _ = schedule([B, hit], "serial")
    assert end == 3.5
    assert flow_shop_bound([B, hit]) == 2.5


def test_schedule_start_offset_and_unknown_order():
    end, slots = schedule([A], "router", start=1.25)
    assert end == 6.25 and ends(slots) == [(0, 1.25, 5.25, 5.25, 6.25)]
    with pytest.raises(ValueError, match="unknown order"):
        schedule([A], "random")


# A model whose neuron is 105 bytes (H=64, g=64, asymmetric: 3 x (32 + 2 + 1)), I = 4 neurons.
SHAPE = ModelShape("toy", num_layers=1, num_experts=8, top_k=2, hidden_size=64, intermediate_size=4)
PROFILE = HardwareProfile("toy", h2d_bytes_per_s=105.0, copy_latency_s=0.0, compute_bytes_per_s=420.0,
                          compute_latency_s=0.0, router_s=0.25, other_s=0.5)


def test_toy_shape_bytes():
    assert SHAPE.neuron_nbytes == 105 and SHAPE.expert_nbytes == 420


def test_decode_three_tokens_with_prefix_cache():
    index = [[[1, 2]], [[2, 1]], [[3, 1]]]
    widths = [[[4, 2]], [[4, 4]], [[4, 2]]]
    res = simulate_decode(index, widths, PROFILE, SHAPE, budget_bytes=840)
    # token 0: both miss (4 s + 1 s, 2 s + 0.5 s); token 1: expert 2 widened 2->4 (2 s), 1 hit;
    # token 2: 3 misses (evicts 2, the LRU entry not needed), 1 hit at half width.
    assert res.per_order["widest_first"].time_s == 7.25 + 3.75 + 5.75
    assert res.per_order["router"].time_s == 7.25 + 4.75 + 6.25
    assert res.per_order["serial"].time_s == 8.25 + 4.75 + 6.25
    assert (res.stats.hits, res.stats.widened, res.stats.misses, res.stats.evictions) == (2, 1, 3, 1)
    assert res.bytes_copied == 420 + 210 + 210 + 420
    assert res.tokens == 3
    rec = res.summary("widest_first")
    assert rec["tokens_per_s"] == 3 / 16.75 and rec["bytes_per_token"] == 420.0


def test_decode_warmup_excluded():
    index = [[[1, 2]], [[2, 1]], [[3, 1]]]
    widths = [[[4, 2]], [[4, 4]], [[4, 2]]]
    res = simulate_decode(index, widths, PROFILE, SHAPE, budget_bytes=840, warmup=1)
    assert res.tokens == 2 and res.per_order["widest_first"].time_s == 3.75 + 5.75
    assert (res.stats.hits, res.stats.widened, res.stats.misses) == (2, 1, 1)


def test_skipped_expert_and_budget_too_small():
    res = simulate_decode([[[1, 2]]], [[[4, 0]]], PROFILE, SHAPE, budget_bytes=840, orders=["router"])
    assert res.per_order["router"].time_s == 0.75 + 5.0 and res.experts_run == 1
    with pytest.raises(BudgetTooSmall):
        simulate_decode([[[1, 2]]], [[[4, 4]]], PROFILE, SHAPE, budget_bytes=839)


def test_prefix_cache_lru():
    cache = PrefixCache(budget_bytes=3 * 105, neuron_nbytes=105)
    assert cache.step(0, {1: 2}) == {1: 210}
    assert cache.step(0, {2: 1}) == {2: 105}
    assert cache.step(0, {1: 1}) == {1: 0}  # hit: 1 becomes most recent
    assert cache.step(0, {3: 1}) == {3: 105}  # evicts 2 (LRU), not 1
    assert list(cache.entries) == [(0, 1), (0, 3)] and cache.used == 315


def test_rtx4090_profile_reads_the_paper():
    p = get_profile("rtx4090-pcie4")
    full = MIXTRAL_8X7B.expert_nbytes
    assert p.load_s(full) == pytest.approx(7.5e-3)
    assert p.load_s(full // 2) == pytest.approx(3.8e-3)
    assert p.compute_s(full) == pytest.approx(0.8e-3) and p.compute_s(full // 2) == pytest.approx(0.4e-3)
    assert p.router_s == pytest.approx(0.4e-3)
    with pytest.raises(ProfileError):
        get_profile("nope")


def test_per_layer_cache_scope():
    shape = ModelShape("toy2", num_layers=2, num_experts=8, top_k=2, hidden_size=64, intermediate_size=4)
    # Two layers, each needing the same two experts every token: a per-layer cache of 2 experts per layer
    # hits from the second token on; so does a global cache of 4 experts.
    index = [[[1, 2], [1, 2]]] * 3
    widths = [[[4, 4], [4, 4]]] * 3
    for scope in ("global", "layer"):
        res = simulate_decode(index, widths, PROFILE, shape, budget_bytes=4 * 420, warmup=1, cache_scope=scope)
        assert res.bytes_copied == 0 and res.stats.hits == 8
    with pytest.raises(BudgetTooSmall):
        simulate_decode(index, widths, PROFILE, shape, budget_bytes=3 * 420, cache_scope="layer")


def test_widest_first_matches_the_runtime_scheduler():
    """Same order and makespan as crisp_runtime's Johnson rule on random steps (loads 0 = cache hits)."""
    import random

    from crisp_bench.simulate import johnson_order

    scheduler = pytest.importorskip("crisp_runtime.scheduler")
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 6)
        jobs = [Job(e, 1, rng.choice([0.0, 0.25, 0.5, 1.0, 2.0, 4.0]), rng.choice([0.25, 0.5, 1.0])) for e in range(n)]
        load, comp = [j.load_s for j in jobs], [j.compute_s for j in jobs]
        order = scheduler.johnson_order(load, comp)
        assert [j.expert for j in johnson_order(jobs)] == order
        end, _ = schedule(jobs, "widest_first")
        assert end == scheduler.flow_shop_makespan(order, load, comp)
        assert end >= flow_shop_bound(jobs) and end <= schedule(jobs, "router")[0]


def test_fit_affine_relative():
    from crisp_bench.profiles import fit_affine

    pts = [(x, 5e-5 + x / 1e9) for x in (5e4, 1e5, 1e7, 1e8)]
    a, b = fit_affine(pts)
    assert a == pytest.approx(5e-5, rel=1e-6) and b == pytest.approx(1e-9, rel=1e-6)
    assert fit_affine([(2.0, 4.0)]) == (0.0, 2.0)


def test_prefix_cache_frequency_eviction():
    # budget: 3 neurons; expert 0 used three times, expert 1 once, then expert 2 needs room.
    cache = PrefixCache(budget_bytes=3 * 105, neuron_nbytes=105, eviction="frequency")
    for _ in range(3):
        cache.step(0, {0: 1})
    cache.step(0, {1: 1})  # most recently used, but used once
    cache.step(0, {3: 1})  # fills the budget: 0 (3 uses), 1 (1 use), 3 (1 use, newest)
    missing = cache.step(0, {2: 1})
    assert missing == {2: 105}
    # LRU would evict expert 0 (least recent); frequency evicts the least used, oldest first: expert 1
    assert set(cache.entries) == {(0, 0), (0, 3), (0, 2)}
    lru = PrefixCache(budget_bytes=3 * 105, neuron_nbytes=105)
    for need in ({0: 1}, {0: 1}, {0: 1}, {1: 1}, {3: 1}, {2: 1}):
        lru.step(0, need)
    assert set(lru.entries) == {(0, 1), (0, 3), (0, 2)}
    with pytest.raises(ValueError, match="unknown eviction"):
        PrefixCache(budget_bytes=105, neuron_nbytes=105, eviction="random")
