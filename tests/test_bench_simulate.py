"""The decoding simulator against hand-computed timelines (exact float equality: all times are dyadic),
driven through the runtime's plan, serving, scheduler and residency ledger."""

import re

import numpy as np
import pytest
from crisp_bench import cli as bench_cli
from crisp_bench.profiles import HardwareProfile, ProfileError, get_profile
from crisp_bench.shapes import MIXTRAL_8X7B, ModelShape
from crisp_bench.simulate import (
    EVICTIONS,
    PIN_SHARE,
    BudgetTooSmall,
    Job,
    SimPolicy,
    flow_shop_bound,
    schedule,
    simulate_decode,
    simulate_policies,
)
from crisp_bench.traces import Trace, TraceError, plan_from_trace, synthetic_trace, token_widths

from crisp_runtime.planning.plan import CrispPlan, LayerPlan, PolicyKind, Tier, TierWidths
from crisp_runtime.planning.serving import SERVING_POLICIES
from crisp_runtime.residency.eviction import POLICIES as ONLINE
from crisp_runtime.residency.ledger import ResidencyLedger


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


def test_schedule_start_offset_busy_copy_engine_and_unknown_order():
    end, slots = schedule([A], "router", start=1.25)
    assert end == 6.25 and ends(slots) == [(0, 1.25, 5.25, 5.25, 6.25)]
    end, slots = schedule([A], "widest_first", start=1.25, copy_free=2.0)
    assert end == 7.0 and ends(slots) == [(0, 2.0, 6.0, 6.0, 7.0)]
    with pytest.raises(ValueError, match="unknown order"):
        schedule([A], "random")


# A model whose neuron is 105 bytes (H=64, g=64, asymmetric: 3 x (32 + 2 + 1)), I = 4 neurons:
# a neuron copies in 1 s and computes in 0.25 s; other + router = 0.75 s per layer.
SHAPE = ModelShape("toy", num_layers=1, num_experts=8, top_k=2, hidden_size=64, intermediate_size=4)
PROFILE = HardwareProfile("toy", h2d_bytes_per_s=105.0, copy_latency_s=0.0, compute_bytes_per_s=420.0,
                          compute_latency_s=0.0, router_s=0.25, other_s=0.5)
META = {"num_experts": 8, "top_k": 2, "intermediate_size": 4, "hidden_size": 64}


def toy_trace(rows, layers=1):
    """rows: per token, per layer, the router's two experts (the first one heavier)."""
    index = np.array(rows, dtype=np.int64).transpose(1, 0, 2)  # (L, T, k)
    weights = np.broadcast_to(np.array([0.625, 0.375], dtype=np.float32), index.shape).copy()
    return Trace(index, weights, list(range(layers)), dict(META))


def crisp(layers=1, hot=(), warm=((1, 2), (1, 3)), cold=()):
    """Auxiliary widths: hot 4, warm 2, cold 0 (skipped); the heavier expert of each token full."""
    tiers = {**{p: Tier.HOT for p in hot}, **{p: Tier.WARM for p in warm}, **{p: Tier.COLD for p in cold}}
    return CrispPlan(PolicyKind.CRISP, 8, 2, 4, tuple(range(layers)), tier_widths=TierWidths(hot=4, warm=2, cold=0),
                     layers={i: LayerPlan(dict(tiers), {}) for i in range(layers)})


def test_decode_three_tokens_with_prefix_cache():
    trace = toy_trace([[[1, 2]], [[2, 1]], [[3, 1]]])
    res = simulate_decode(trace, SimPolicy("crisp", crisp()), PROFILE, SHAPE, budget_bytes=840)
    # token 0: both miss (4 s + 1 s, 2 s + 0.5 s); token 1: expert 2 (now dominant) widened 2->4
    # (2 s), expert 1 a hit at 2; token 2: expert 1 a hit, issued first; expert 3 misses and
    # evicts expert 2, the least recently used entry the step does not need.
    assert res.per_order["widest_first"].time_s == 7.25 + 3.75 + 5.75
    assert res.per_order["router"].time_s == 7.25 + 4.25 + 6.25
    assert res.per_order["serial"].time_s == 8.25 + 4.25 + 6.25
    c = res.counters
    assert (c.hits, c.widenings, c.misses, c.evictions) == (2, 1, 3, 1)
    assert res.bytes_copied == 420 + 210 + 210 + 420
    assert res.tokens == 3
    rec = res.summary("widest_first")
    assert rec["tokens_per_s"] == 3 / 16.75 and rec["bytes_per_token"] == 420.0


def test_decode_warmup_excluded():
    trace = toy_trace([[[1, 2]], [[2, 1]], [[3, 1]]])
    res = simulate_decode(trace, SimPolicy("crisp", crisp()), PROFILE, SHAPE, budget_bytes=840, warmup=1)
    assert res.tokens == 2 and res.per_order["widest_first"].time_s == 3.75 + 5.75
    c = res.counters
    assert (c.hits, c.widenings, c.misses) == (2, 1, 1)


def test_skipped_expert_tight_budget_streams_and_budget_too_small():
    trace = toy_trace([[[1, 2]]])
    res = simulate_decode(trace, SimPolicy("crisp", crisp(warm=(), cold=((1, 2),))), PROFILE, SHAPE,
                          budget_bytes=840, orders=["router"])
    assert res.per_order["router"].time_s == 0.75 + 5.0 and res.experts_run == 1
    # One full expert of room for two full experts: the step streams (the first is evicted once run);
    # token 1 runs the resident expert 2 first (a hit), then expert 1 evicts it.
    trace = toy_trace([[[1, 2]], [[1, 2]]])
    res = simulate_decode(trace, SimPolicy("full", CrispPlan.full(8, 2, 4, (0,))), PROFILE, SHAPE, budget_bytes=420)
    assert (res.counters.hits, res.counters.misses, res.counters.evictions, res.bytes_copied) == (1, 3, 2, 3 * 420)
    with pytest.raises(BudgetTooSmall, match="less than one full-width expert"):
        simulate_decode(trace, SimPolicy("full", CrispPlan.full(8, 2, 4, (0,))), PROFILE, SHAPE, budget_bytes=419)


def test_residency_aware_serving_uses_the_runtime_policy():
    # token 0: expert 2 runs at 2 (aux); token 1: expert 2 is dominant (never below full: widened),
    # expert 1 aux wanted 2, resident 4: served at 4 for free with "resident"; token 2: expert 3
    # dominant misses and loads full, expert 2 aux at resident width 4.
    trace = toy_trace([[[1, 2]], [[2, 1]], [[3, 2]]])
    plan = crisp(warm=((1, 2), (2, 3)))
    res = simulate_decode(trace, SimPolicy("crisp", plan, SERVING_POLICIES["resident"]), PROFILE, SHAPE,
                          budget_bytes=3 * 420)
    assert (res.wider, res.fallbacks, res.skips) == (2, 0, 0)
    assert res.bytes_copied == (4 + 2) * 105 + 2 * 105 + 4 * 105
    assert res.bytes_computed == (4 + 2 + 4 + 4 + 4 + 4) * 105


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
    trace = toy_trace([[[1, 2], [1, 2]]] * 3, layers=2)
    full = SimPolicy("full", CrispPlan.full(8, 2, 4, (0, 1)))
    for scope in ("global", "layer"):
        res = simulate_decode(trace, full, PROFILE, shape, budget_bytes=4 * 420, warmup=1, cache_scope=scope)
        assert res.bytes_copied == 0 and res.counters.hits == 8
    with pytest.raises(BudgetTooSmall, match="per layer"):
        simulate_decode(trace, full, PROFILE, shape, budget_bytes=2 * 420 - 1, cache_scope="layer")


@pytest.mark.parametrize("budget", [0.15, 0.3])
def test_belady_bounds_the_online_policies_on_a_synthetic_trace(budget):
    trace = synthetic_trace(num_layers=4, num_tokens=96, intermediate_size=16, seed=1)
    shape = ModelShape("syn", num_layers=8, num_experts=8, top_k=2, hidden_size=64, intermediate_size=16)
    full = CrispPlan.full(8, 2, 16, trace.layer_ids)
    recs = simulate_policies(trace, [SimPolicy("full", full, eviction=e) for e in ("lru", "next_use", "belady")],
                             PROFILE, shape, budget, orders=["router"], warmup=16)
    hits = {r["eviction"]: r["hit_rate"] for r in recs}
    assert hits["belady"] >= hits["lru"] and hits["belady"] >= hits["next_use"]  # equal sizes: MIN is optimal
    assert {r["label"] for r in recs} == {"full/plan/lru", "full/plan/next_use", "full/plan/belady"}


SYN_SHAPE = ModelShape("syn", num_layers=8, num_experts=8, top_k=2, hidden_size=64, intermediate_size=16)


@pytest.mark.parametrize("budget", [0.15, 0.3])
def test_belady_misses_bound_every_online_eviction_at_equal_widths(budget):
    """Every slot at the full width (a CRISP plan whose tiers all run whole, so that tier eviction has real
    tiers): Belady's MIN is optimal, no online policy (tier and the pinned ones included) misses less."""
    trace = synthetic_trace(num_layers=4, num_tokens=96, intermediate_size=16, seed=1)
    plan = plan_from_trace(trace).with_tiers(TierWidths(16, 16, 16))
    assert (token_widths(trace, plan) == 16).all()
    budget_bytes = int(budget * SYN_SHAPE.total_expert_nbytes)
    misses = {}
    for e in EVICTIONS:
        c = simulate_decode(trace, SimPolicy("crisp", plan, eviction=e), PROFILE, SYN_SHAPE, budget_bytes,
                            orders=["router"]).counters
        assert c.widenings == 0
        misses[e] = c.misses
    assert set(misses) >= {"tier", "lru+pinned", "tier+pinned", "next_use+pinned"}
    online = {e: m for e, m in misses.items() if e != "belady"}
    assert all(misses["belady"] <= m for m in online.values()), misses
    assert misses["belady"] < min(online.values())  # a bound, not a tie: the cache is under pressure
    assert misses["tier"] != misses["lru"] and misses["lru+pinned"] != misses["lru"]  # tiers and pins act


@pytest.fixture
def pinned_evictions(monkeypatch):
    """Spies on every ResidencyLedger eviction: counts the evictions of keys outside ``pinned_keys`` (the ledger
    policy's pinned set, once there is one) and lists, per evicted pinned key, the resident keys that were
    neither pinned nor protected by the request under way (those the policy should have evicted first)."""
    log = {"pinned": [], "unpinned": 0, "pinned_keys": frozenset()}
    protected_now: set = set()
    request, evict = ResidencyLedger.request, ResidencyLedger.evict

    def spy_request(self, layer_id, expert, width, protected=(), **kw):
        protected_now.clear()
        protected_now.update(protected)
        protected_now.add((layer_id, expert))
        return request(self, layer_id, expert, width, protected=protected, **kw)

    def spy_evict(self, key):
        pinned = log["pinned_keys"] = getattr(self.policy, "pinned", log["pinned_keys"])
        if key in pinned:
            log["pinned"].append((key, [k for k in self.resident() if k not in pinned and k not in protected_now]))
        else:
            log["unpinned"] += 1
        return evict(self, key)

    monkeypatch.setattr(ResidencyLedger, "request", spy_request)
    monkeypatch.setattr(ResidencyLedger, "evict", spy_evict)
    return log


@pytest.mark.parametrize("inner", list(ONLINE))
def test_pinned_keys_outlive_every_unpinned_evictable_key(pinned_evictions, inner):
    """``<inner>+pinned``: the trace's most used experts up to PIN_SHARE of the budget are never evicted while
    an unpinned key outside the step could go; the same keys are evicted under plain ``inner``."""
    trace = synthetic_trace(num_layers=4, num_tokens=96, intermediate_size=16, seed=2)
    plan = plan_from_trace(trace)
    budget = int(0.3 * SYN_SHAPE.total_expert_nbytes)
    simulate_decode(trace, SimPolicy("crisp", plan, eviction=f"{inner}+pinned"), PROFILE, SYN_SHAPE, budget,
                    orders=["router"])
    pinned = pinned_evictions["pinned_keys"]
    assert len(pinned) == int(PIN_SHARE * budget) // SYN_SHAPE.expert_nbytes  # full-width experts in the share
    widths = token_widths(trace, plan)
    counts = {(layer, e): int(((trace.index[layer % 4] == e) & (widths[layer % 4] > 0)).sum())
              for layer in range(SYN_SHAPE.num_layers) for e in range(8)}
    assert min(counts[k] for k in pinned) >= max(c for k, c in counts.items() if k not in pinned)  # the most used
    assert pinned_evictions["unpinned"] > 0 and pinned_evictions["pinned"] == []
    pinned_evictions["unpinned"] = 0
    pinned_evictions["pinned_keys"] = pinned  # plain ``inner`` has no pinned set: count the same keys
    simulate_decode(trace, SimPolicy("crisp", plan, eviction=inner), PROFILE, SYN_SHAPE, budget, orders=["router"])
    assert pinned_evictions["pinned"]


def test_unknown_and_pinned_belady_evictions_are_refused(capsys):
    plan = CrispPlan.full(8, 2, 4, (0,))
    with pytest.raises(ValueError, match="Belady is offline and cannot be pinned"):
        SimPolicy("full", plan, eviction="belady+pinned")
    for bad in ("random", "fifo+pinned", "lru+pinned+pinned", "LRU"):
        with pytest.raises(ValueError, match=re.escape(f"eviction '{bad}': choose one of lru, frequency, tier, "
                                                       "next_use, lru+pinned")):
            SimPolicy("full", plan, eviction=bad)
    for arg, words in (("lru,belady+pinned", ("offline", "next_use+pinned")), ("fifo", ("'fifo'", "tier+pinned"))):
        with pytest.raises(SystemExit) as exc:
            bench_cli.main(["simulate", "--eviction", arg])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "--eviction" in err and all(w in err for w in words), err
    assert all(f"{name}+pinned" in EVICTIONS for name in ONLINE) and "belady+pinned" not in EVICTIONS


def test_prefetch_never_delays_a_demanded_copy_and_respects_the_budget():
    # Two layers; at layer 0 the trace predicts layer 1's experts. With a perfect prediction the
    # copy engine fetches them while layer 0 computes, as far as they arrive before layer 1's router ends.
    shape = ModelShape("toy2", num_layers=2, num_experts=8, top_k=2, hidden_size=64, intermediate_size=4)
    rows = [[[1, 2], [3, 4]], [[5, 6], [7, 1]], [[2, 3], [4, 5]], [[6, 7], [1, 2]]]
    trace = toy_trace(rows, layers=2)
    predicted = np.full((2, len(rows), 2), -1, dtype=np.int64)
    predicted[0] = np.array(rows)[:, 1]  # layer 0 predicts layer 1 exactly
    plan = CrispPlan.full(8, 2, 4, (0, 1))
    # copies 1 s per expert, computes 4 s: the copy engine idles while layer 0 computes
    profile = HardwareProfile("slow-compute", h2d_bytes_per_s=420.0, copy_latency_s=0.0, compute_bytes_per_s=105.0,
                              compute_latency_s=0.0, router_s=0.25, other_s=0.5)
    timeline = []
    for budget in (3 * 420, 4 * 420):
        res = simulate_decode(trace, SimPolicy("full", plan, prefetch=True), profile, shape, budget,
                              orders=["widest_first"], predicted=predicted, timeline=timeline)
        assert res.counters.prefetches > 0 and res.peak_bytes <= budget
    base = simulate_decode(trace, SimPolicy("full", plan), profile, shape, budget, orders=["widest_first"])
    assert res.counters.prefetches > 0 and res.counters.prefetch_hits > 0
    assert res.per_order["widest_first"].time_s < base.per_order["widest_first"].time_s
    prev_deadline = None
    for step in timeline:
        copies = sorted((s.copy_start, s.copy_end) for s in step["slots"] if s.copy_end > s.copy_start)
        t = step["router_end"]
        for a, b in copies:  # demanded copies back to back from the router's end: nothing in their way
            assert a == t
            t = b
        demand_done = max([step["router_end"]] + [b for _, b in copies])
        deadline = step["end"] + profile.other_s + profile.router_s
        for _, _, a, b in step["prefetch"]:
            assert demand_done <= a < b <= deadline
        if prev_deadline is not None and step["start"] > 0:
            assert step["router_end"] == prev_deadline
        prev_deadline = deadline
    assert base.counters.prefetches == 0


def test_prefetch_is_simulated_in_the_runtime_order_only():
    trace = toy_trace([[[1, 2]]])
    with pytest.raises(ValueError, match="widest_first"):
        simulate_decode(trace, SimPolicy("full", CrispPlan.full(8, 2, 4, (0,)), prefetch=True), PROFILE, SHAPE,
                        840, orders=["router"])
    with pytest.raises(ValueError, match="eviction 'random'"):
        SimPolicy("full", CrispPlan.full(8, 2, 4, (0,)), eviction="random")


def test_fit_affine_relative():
    from crisp_bench.profiles import fit_affine

    pts = [(x, 5e-5 + x / 1e9) for x in (5e4, 1e5, 1e7, 1e8)]
    a, b = fit_affine(pts)
    assert a == pytest.approx(5e-5, rel=1e-6) and b == pytest.approx(1e-9, rel=1e-6)
    assert fit_affine([(2.0, 4.0)]) == (0.0, 2.0)


# ---------------------------------------------------------------------------- inputs simulate refuses


@pytest.mark.parametrize("field", ["router_s", "other_s", "copy_latency_s", "compute_latency_s", "h2d_bytes_per_s",
                                   "compute_bytes_per_s"])
def test_profile_json_booleans_are_not_numbers(field):
    data = get_profile("rtx4090-pcie4").to_dict()
    data[field] = True
    with pytest.raises(ProfileError, match=f"{field} must be a"):
        HardwareProfile.from_dict(data)


def _sim(argv, capsys):
    rc = bench_cli.main(["simulate", *argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("which", ["accuracy", "profile"])
def test_json_never_overwrites_an_input_read_by_default(which, tmp_path, monkeypatch, capsys):
    """The files read when --accuracy or --profile-file is left out are inputs like the options' own."""
    from crisp_bench import simulate_cmd
    from crisp_bench.profiles import MEASURED_PROFILE_FILE

    monkeypatch.setattr(simulate_cmd, "REPO_ROOT", tmp_path)  # the default evaluations: copies, not the repo's
    (tmp_path / "bench" / "results").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # the default measured profile is read from the current folder
    synthetic_trace(num_layers=2, num_tokens=24).save(tmp_path / "t.npz")
    get_profile("rtx4090-pcie4").save(tmp_path / MEASURED_PROFILE_FILE)
    target = tmp_path / (simulate_cmd.DEFAULT_ACCURACY[0] if which == "accuracy" else MEASURED_PROFILE_FILE)
    if which == "accuracy":
        target.write_text('{"records": []}')
    before = target.read_bytes()
    argv = ["--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--target", "native", "--warmup", "4",
            "--json", str(target)] + (["--profile", "measured"] if which == "profile" else [])
    rc, err = _sim(argv, capsys)
    option = "--accuracy (default)" if which == "accuracy" else "--profile-file (default)"
    assert rc == 2 and f"is the input {option}" in err and err.count("\n") == 1, err
    assert target.read_bytes() == before


def test_record_trace_with_a_given_trace_is_refused(tmp_path, capsys):
    synthetic_trace(num_layers=2, num_tokens=24).save(tmp_path / "t.npz")
    rc, err = _sim(["--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--target", "native",
                    "--record-trace", str(tmp_path / "r.npz")], capsys)
    assert rc == 2 and "--record-trace" in err and "--trace" in err
    assert not (tmp_path / "r.npz").exists()


@pytest.mark.parametrize("extra, needle", [
    (["--tokens", "25"], "--tokens 25: the trace holds 24 tokens"),
    (["--prefetch-width", "serving"], "no configuration of this run prefetches; add --prefetch trace"),
])
def test_options_that_would_be_silently_ignored_are_refused(extra, needle, tmp_path, capsys):
    synthetic_trace(num_layers=2, num_tokens=24).save(tmp_path / "t.npz")
    rc, err = _sim(["--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--target", "native", "--warmup", "4",
                    *extra, "--json", str(tmp_path / "s.json")], capsys)
    assert rc == 2 and needle in err, err
    assert not (tmp_path / "s.json").exists()
    # at the bound: runs (the whole trace)
    if extra[0] == "--tokens":
        assert _sim(["--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--target", "native", "--warmup", "4",
                     "--tokens", "24", "--policies", "full"], capsys)[0] == 0


@pytest.mark.parametrize("extra, needle", [
    (["--matrix", "hybrid"], "--matrix hybrid simulates CPU placements"),
    (["--serving", "plan,static_hybrid"], "--serving static_hybrid runs experts on the host CPU"),
])
def test_cpu_placements_on_a_profile_without_a_cpu_are_refused_before_any_work(extra, needle, tmp_path, capsys):
    # the trace does not exist: the profile is refused before anything is read
    rc, err = _sim(["--trace", str(tmp_path / "none.npz"), "--plan", "auto", "--profile", "rtx4090-pcie4", *extra,
                    "--json", str(tmp_path / "s.json")], capsys)
    assert rc == 2 and needle in err and err.count("\n") == 1, err
    assert "--profile rtx4090-pcie4 has no CPU" in err and "rtx4090-pcie4-ddr5" in err
    assert not (tmp_path / "s.json").exists()


FROM_JSON_RUN = ["--plan", "auto", "--target", "native", "--warmup", "8", "--policies", "full,crisp",
                 "--orders", "widest_first", "--tokens", "40"]


@pytest.mark.parametrize("change, needle", [
    (["--profile", "rtx4090-pcie4-ddr5"], "profile rtx4090-pcie4; this run's --profile"),
    (["--budget", "0.5"], "budget_fraction 0.25; this run's --budget"),
    (["--warmup", "4"], "tokens 32; this run's --tokens / --warmup"),
    (["--tokens", "44"], "simulated another trace"),
    (["OTHER-TRACE"], "simulated another trace"),
    (["NO-DIGEST"], "names no trace digest"),
])
def test_from_json_refuses_records_of_another_run(change, needle, tmp_path, capsys):
    synthetic_trace(num_layers=2, num_tokens=48, intermediate_size=16).save(tmp_path / "t.npz")
    synthetic_trace(num_layers=2, num_tokens=48, intermediate_size=16, seed=1).save(tmp_path / "other.npz")
    (tmp_path / "none.json").write_text('{"records": []}')
    common = [*FROM_JSON_RUN, "--accuracy", str(tmp_path / "none.json")]
    assert _sim(["--trace", str(tmp_path / "t.npz"), *common, "--json", str(tmp_path / "a.json")], capsys)[0] == 0
    trace = str(tmp_path / ("other.npz" if change == ["OTHER-TRACE"] else "t.npz"))
    earlier = tmp_path / "a.json"
    if change == ["NO-DIGEST"]:  # a document that does not say which trace it simulated
        import json

        doc = json.loads(earlier.read_text())
        del doc["trace"]
        earlier = tmp_path / "old.json"
        earlier.write_text(json.dumps(doc))
    change = [] if change in (["OTHER-TRACE"], ["NO-DIGEST"]) else change
    rc, err = _sim(["--trace", trace, *common, *change, "--from-json", str(earlier),
                    "--json", str(tmp_path / "b.json")], capsys)
    assert rc == 2 and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "b.json").exists()
    # the same options re-report the records
    assert _sim(["--trace", str(tmp_path / "t.npz"), *common, "--from-json", str(tmp_path / "a.json"),
                 "--json", str(tmp_path / "c.json")], capsys)[0] == 0


def _toy_fields():
    t = synthetic_trace(num_layers=2, num_tokens=16, num_experts=8, top_k=2, intermediate_size=32)
    predicted = np.full((2, 16, 3), -1, dtype=np.int64)  # the last layer's rows: -1, no prediction
    predicted[0] = np.concatenate([t.index[1], t.index[1][:, :1]], axis=1)
    return dict(index=t.index.copy(), weights=t.weights.copy(), layer_ids=list(t.layer_ids), meta=dict(t.meta),
                predicted=predicted)


@pytest.mark.parametrize("change, match", [
    ("weights-negative", "weights must be positive routing weights"),
    ("weights-zero", "weights must be positive routing weights"),
    ("index-99", r"expert ids outside \[0, 8\)"),
    ("index-minus-1", r"expert ids outside \[0, 8\)"),
    ("index-twice", "the same expert twice"),
    ("predicted-1000", "predicted holds expert ids outside"),
    ("predicted-minus-2", "predicted holds expert ids outside"),
    ("hidden-negative", "'hidden_size' must be a positive integer"),
    ("hidden-zero", "'hidden_size' must be a positive integer"),
    ("hidden-text", "'hidden_size' must be a positive integer"),
    ("no-tokens", "holds no tokens"),
])
def test_traces_a_router_cannot_record_are_refused(change, match):
    fields = _toy_fields()
    what, _, value = change.partition("-")
    if what == "weights":
        fields["weights"][1, 3, 1] = {"negative": -5.0, "zero": 0.0}[value]
    elif what == "index":
        fields["index"][0, 2, 1] = 99 if value == "99" else -1
        if value == "twice":
            fields["index"][0, 2, 1] = fields["index"][0, 2, 0]
    elif what == "predicted":
        fields["predicted"][0, 5, 2] = 1000 if value == "1000" else -2
    elif what == "hidden":
        fields["meta"]["hidden_size"] = {"negative": -7, "zero": 0, "text": "abc"}[value]
    else:
        fields = dict(fields, index=fields["index"][:, :0], weights=fields["weights"][:, :0],
                      predicted=fields["predicted"][:, :0])
    with pytest.raises(TraceError, match=match):
        Trace(**fields)


def test_committed_traces_and_prediction_sentinels_load():
    from crisp_bench.common import REPO_ROOT

    Trace(**_toy_fields())  # the -1 rows of the last layer's predictions
    paths = sorted((REPO_ROOT / "bench" / "traces").glob("*.npz"))
    assert len(paths) >= 3
    for path in paths:
        assert Trace.load(path).num_tokens > 0


@pytest.mark.parametrize("hidden, needle", [(None, "hidden_size None"), (100, "hidden_size 100")])
def test_native_target_needs_the_traces_hidden_size(hidden, needle, tmp_path, capsys):
    t = synthetic_trace(num_layers=2, num_tokens=24)
    meta = {k: v for k, v in t.meta.items() if k != "hidden_size"}
    if hidden is not None:
        meta["hidden_size"] = hidden
    Trace(t.index, t.weights, list(t.layer_ids), meta).save(tmp_path / "t.npz")
    rc, err = _sim(["--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--target", "native"], capsys)
    assert rc == 2 and "--target native" in err and needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("records, needle", [
    ([{"policy": "crisp", "accuracy_loss": 7}], "accuracy loss 7.0; expected a relative loss in [-1, 1]"),
    ([{"policy": "crisp", "relative_accuracy_loss_vs_full": -1.5}], "accuracy loss -1.5"),
    ([{"policy": "full", "accuracy_loss": 0.5}], "(full width, the reference) has accuracy loss 0.5; expected 0"),
    ("SIMULATE", "a crisp-bench simulate document"),
])
def test_accuracy_files_with_impossible_losses_are_refused(records, needle, tmp_path, capsys):
    import json

    synthetic_trace(num_layers=2, num_tokens=24).save(tmp_path / "t.npz")
    doc = {"format": "crisp-bench", "command": "simulate", "records": []} if records == "SIMULATE" else \
        {"records": records}
    (tmp_path / "acc.json").write_text(json.dumps(doc))
    rc, err = _sim(["--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--target", "native", "--warmup", "4",
                    "--accuracy", str(tmp_path / "acc.json")], capsys)
    assert rc == 2 and needle in err and err.count("\n") == 1, err


def test_a_checkpoint_whose_config_contradicts_its_weights_is_a_clear_error(tmp_path, capsys):
    import json
    import shutil

    from crisp_bench.common import DEFAULT_MODEL

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, model)
    cfg = json.loads((model / "config.json").read_text())
    del cfg["intermediate_size"]
    (model / "config.json").write_text(json.dumps(cfg))
    rc, err = _sim(["--model", str(model), "--plan", "auto", "--sequences", "1", "--seq-len", "8"], capsys)
    # transformers prints its own load report first; the command's error is one line
    ours = [line for line in err.splitlines() if line.startswith("crisp-bench")]
    assert rc == 2 and len(ours) == 1 and "error:" in ours[0] and "cannot load the checkpoint" in ours[0], err
