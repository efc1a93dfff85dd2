"""One routing trace replayed through the real CrispRuntime (CPU tensors, a random packed model) and
through the simulator: the identical sequence of hits, misses, widenings, evictions and bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from crisp_bench.profiles import HardwareProfile
from crisp_bench.shapes import ModelShape
from crisp_bench.simulate import PIN_SHARE, SimPolicy, pinned_set, prefetch_requests, simulate_decode, target_window
from crisp_bench.traces import Trace, plan_from_trace, synthetic_trace, token_widths
from runtime_helpers import TracePredictor, decode_trace, random_layers

from crisp_runtime import RuntimeConfig
from crisp_runtime.execution.runtime import CrispRuntime
from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.planning.serving import SERVING_POLICIES
from crisp_runtime.residency.eviction import NextUsePolicy, PinnedPolicy, TierAwarePolicy
from crisp_runtime.residency.ledger import ResidencyLedger
from crisp_runtime.scheduling.prefetch import Prefetcher, PrefetchPolicy, PrefetchWidth
from crisp_runtime.scheduling.scheduler import CostModel

LAYERS, EXPERTS, INTER, HIDDEN = 3, 8, 16, 64
PROFILE = HardwareProfile("toy", h2d_bytes_per_s=2e9, copy_latency_s=0.0, compute_bytes_per_s=8e9,
                          compute_latency_s=0.0, router_s=1e-5, other_s=2e-5)
# The runtime orders a step's experts with its cost model: the simulator's, from the profile.
COST = CostModel(h2d_bytes_per_s=PROFILE.h2d_bytes_per_s, device_bytes_per_s=PROFILE.compute_bytes_per_s)


@pytest.fixture
def decisions(monkeypatch):
    """Every ResidencyLedger.request, in order, as plain tuples."""
    log: list[tuple] = []
    request = ResidencyLedger.request

    def logged(self, layer_id, expert, width, **kw):
        d = request(self, layer_id, expert, width, **kw)
        log.append((d.key, d.kind, d.old_width, d.new_width, d.copy_bytes, d.evicted))
        return d

    monkeypatch.setattr(ResidencyLedger, "request", logged)
    return log


@pytest.fixture
def decisions_and_prefetches(decisions, monkeypatch):
    """``decisions`` with every ResidencyLedger.prefetch logged in the same list, in order."""
    prefetch = ResidencyLedger.prefetch

    def logged(self, layer_id, expert, width, **kw):
        d = prefetch(self, layer_id, expert, width, **kw)
        decisions.append(("prefetch", layer_id, expert, width,
                          None if d is None else (d.kind, d.copy_bytes, d.evicted)))
        return d

    monkeypatch.setattr(ResidencyLedger, "prefetch", logged)
    return decisions


@pytest.mark.parametrize("serving", ["plan", "resident", "resident-floor75", "resident-floor75-widen",
                                     "resident-narrow-aux", "resident-narrow-aux-revive"])
@pytest.mark.parametrize(("eviction", "budget_experts"), [("lru", 4), ("next_use", 6), ("tier", 5)])
def test_runtime_and_simulator_make_the_same_decisions(decisions, serving, eviction, budget_experts):
    trace = synthetic_trace(num_layers=LAYERS, num_tokens=24, num_experts=EXPERTS, intermediate_size=INTER, seed=3)
    plan = plan_from_trace(trace)  # hot / warm (50%) / cold tiers: widenings and skips happen
    if serving == "resident-narrow-aux":  # heavy auxiliaries wanted whole, which NARROW_ONLY widens
        plan = plan.promoted(0.3)
    if serving == "resident-narrow-aux-revive":  # and light ones skipped by the plan, run where resident
        plan = plan.promoted(0.35).skipping(0.25)
    layers = random_layers(layer_ids=tuple(range(LAYERS)), num_experts=EXPERTS, inter=INTER, hidden=HIDDEN)
    nb = layers[0].fmt.neuron_nbytes(HIDDEN)
    shape = ModelShape("toy", LAYERS, EXPERTS, 2, HIDDEN, INTER)
    assert shape.neuron_nbytes == nb
    budget = budget_experts * INTER * nb

    runtime = CrispRuntime(layers, plan, device="cpu", gpu_budget=budget,
                           config=RuntimeConfig(eviction=eviction, serving=serving, cost=COST))
    decode_trace(runtime, trace, HIDDEN)
    by_runtime = list(decisions)
    decisions.clear()

    res = simulate_decode(trace, SimPolicy(plan.policy.value, plan, SERVING_POLICIES[serving], eviction), PROFILE,
                          shape, budget, orders=["widest_first"])
    assert decisions == by_runtime
    kinds = {d[1] for d in by_runtime}
    assert "miss" in kinds and "hit" in kinds
    if serving == "resident-floor75-widen":  # floor-loaded dominants widened on a later use, in both
        assert "widen" in kinds and res.widened > 0 and runtime.stats.as_dict()["served_widened"] == res.widened
    stats = runtime.stats.as_dict()
    c = res.counters
    assert (c.hits, c.misses, c.widenings, c.evictions, c.bytes_copied) == (
        stats["hits"], stats["misses"], stats["widenings"], stats["evictions"], stats["bytes_h2d"])


TRACED_IDS = (2, 5, 7)  # the traced model's layer ids: not the target's 0..5, so a mix-up cannot pass
MAPPED_BUDGET = 12  # full experts of the 48 (6 layers x 8): evictions happen, and PIN_SHARE of it pins 3


def _mapped_case():
    """A 3-layer trace (layer ids ``TRACED_IDS``) and its plan, replayed on a 6-layer target; and what the runtime
    runs for the same decode: the trace tiled twice (target layer l = traced layer l mod 3) with the plan's
    tiers of traced layer ``TRACED_IDS[l mod 3]`` on layer l."""
    syn = synthetic_trace(num_layers=3, num_tokens=24, num_experts=EXPERTS, intermediate_size=INTER, seed=7)
    traced = Trace(syn.index, syn.weights, list(TRACED_IDS), dict(syn.meta))
    plan = plan_from_trace(traced)
    target_layers = 2 * traced.num_layers
    tiled = Trace(np.concatenate([syn.index, syn.index]), np.concatenate([syn.weights, syn.weights]),
                  list(range(target_layers)), dict(syn.meta))
    tiled_plan = CrispPlan.crisp(EXPERTS, 2, INTER, {layer: plan.layers[TRACED_IDS[layer % 3]]
                                                     for layer in range(target_layers)}, plan.tier_widths)
    layers = random_layers(layer_ids=tuple(range(target_layers)), num_experts=EXPERTS, inter=INTER, hidden=HIDDEN)
    nb = layers[0].fmt.neuron_nbytes(HIDDEN)
    shape = ModelShape("toy6", target_layers, EXPERTS, 2, HIDDEN, INTER)
    return traced, plan, tiled, tiled_plan, layers, shape, MAPPED_BUDGET * INTER * nb


@pytest.mark.parametrize("eviction", ["tier", "tier+pinned", "next_use+pinned"])
def test_tier_and_pinned_eviction_map_the_traced_layers_onto_the_target(decisions, eviction):
    """The simulator replays a 3-layer trace on 6 target layers: its TierAwarePolicy gives target layer l the
    tiers of the traced layer it replays, and its pinned set (bench.simulate.pinned_set) is a runtime
    PinnedPolicy's; the runtime decoding the tiled trace with the tiled plan makes the same decisions."""
    traced, plan, tiled, tiled_plan, layers, shape, budget = _mapped_case()
    inner = eviction.removesuffix("+pinned")
    policy = TierAwarePolicy(tiled_plan) if inner == "tier" else NextUsePolicy()
    if eviction.endswith("+pinned"):
        widths = token_widths(traced, plan)
        routed = [torch.from_numpy(traced.index[li]) for li in range(traced.num_layers)]
        wanted = [torch.from_numpy(widths[li]) for li in range(traced.num_layers)]
        pinned = pinned_set(routed, wanted, budget, shape.num_layers, "global", shape.neuron_nbytes, INTER)
        assert len(pinned) == int(PIN_SHARE * MAPPED_BUDGET) and {layer for layer, _ in pinned} <= set(range(6))
        policy = PinnedPolicy(policy, pinned)
    runtime = CrispRuntime(layers, tiled_plan, device="cpu", gpu_budget=budget,
                           config=RuntimeConfig(eviction=policy, cost=COST))
    decode_trace(runtime, tiled, HIDDEN)
    by_runtime = list(decisions)
    decisions.clear()
    res = simulate_decode(traced, SimPolicy("crisp", plan, eviction=eviction), PROFILE, shape, budget,
                          orders=["widest_first"])
    assert decisions == by_runtime
    stats = runtime.stats.as_dict()
    c = res.counters
    assert (c.hits, c.misses, c.widenings, c.evictions, c.bytes_copied) == (
        stats["hits"], stats["misses"], stats["widenings"], stats["evictions"], stats["bytes_h2d"])
    # not vacuous: the tiers (or the pinned set) change the decisions against the plain LRU / next-use policy
    decisions.clear()
    simulate_decode(traced, SimPolicy("crisp", plan, eviction="lru" if eviction == "tier" else inner), PROFILE,
                    shape, budget, orders=["widest_first"])
    assert decisions != by_runtime



@pytest.mark.parametrize("width", list(PrefetchWidth))
@pytest.mark.parametrize("serving", ["plan", "resident-floor75", "resident-floor75-ahead"])
def test_prefetch_makes_the_same_decisions(decisions_and_prefetches, serving, width):
    """The runtime's Prefetcher (its requests for the next layer's predicted experts at ``width``) and
    CrispRuntime.prefetch, against the simulator's prefetch of the same trace through the same ledger:
    identical requests and decisions."""
    log = decisions_and_prefetches
    trace = synthetic_trace(num_layers=LAYERS, num_tokens=16, num_experts=EXPERTS, intermediate_size=INTER, seed=5)
    predicted = np.full((LAYERS, trace.num_tokens, 2), -1, dtype=np.int64)
    predicted[:-1] = trace.index[1:]  # a perfect prediction of the next layer
    plan = plan_from_trace(trace)
    layers = random_layers(layer_ids=tuple(range(LAYERS)), num_experts=EXPERTS, inter=INTER, hidden=HIDDEN)
    nb = layers[0].fmt.neuron_nbytes(HIDDEN)
    shape = ModelShape("toy", LAYERS, EXPERTS, 2, HIDDEN, INTER)
    budget = 5 * INTER * nb
    # copies far faster than computes: every prefetch fits in the copy engine's idle time, none is cut
    profile = HardwareProfile("fast-copy", h2d_bytes_per_s=1e15, copy_latency_s=0.0, compute_bytes_per_s=1e6,
                              compute_latency_s=0.0, router_s=1e-5, other_s=2e-5)
    cost = CostModel(h2d_bytes_per_s=profile.h2d_bytes_per_s, device_bytes_per_s=profile.compute_bytes_per_s)
    policy = PrefetchPolicy(width=width)
    runtime = CrispRuntime(layers, plan, device="cpu", gpu_budget=budget,
                           config=RuntimeConfig(serving=serving, eviction="next_use", cost=cost))
    token = [0]
    prefetcher = Prefetcher(TracePredictor(predicted, token, LAYERS), runtime, policy)
    asked = []

    def ask_and_prefetch(layer, hidden):
        phases = prefetcher.phases(layer, hidden)
        asked.append(([], []) if phases is None else phases[1:])
        prefetcher(layer, hidden)

    decode_trace(runtime, trace, HIDDEN, ask_and_prefetch, token)
    by_runtime = list(log)
    log.clear()
    sim_policy = SimPolicy("crisp", plan, SERVING_POLICIES[serving], "next_use", prefetch=True, prefetch_width=width)
    res = simulate_decode(trace, sim_policy, profile, shape, budget, orders=["widest_first"], predicted=predicted)
    requests = prefetch_requests(plan, trace, predicted, policy, SERVING_POLICIES[serving])
    topups = prefetch_requests(plan, trace, predicted, policy, SERVING_POLICIES[serving], phase=2)
    assert asked == [(requests[layer][t], topups[layer][t]) for t in range(trace.num_tokens) for layer in range(LAYERS)]
    # the second phase (dominants widened ahead of demand) exactly for AHEAD with serving-width prefetch
    ahead = serving == "resident-floor75-ahead" and width is PrefetchWidth.SERVING
    assert any(x for layer in topups for x in layer) == ahead
    if ahead:
        assert any(d[0] == "prefetch" and d[4] is not None and d[4][0] == "widen" for d in by_runtime)
    assert log == by_runtime
    assert res.counters.prefetches > 0 and res.counters.prefetch_hits > 0 and res.peak_bytes <= budget
    # the option changes the requests where it should: floor-width dominants, no auxiliaries
    plan_asked = prefetch_requests(plan, trace, predicted, PrefetchPolicy(), SERVING_POLICIES[serving])
    changes = width is PrefetchWidth.AUX_NONE or (width is PrefetchWidth.SERVING and serving != "plan")
    if serving == "resident-floor75-ahead" and width is PrefetchWidth.SERVING:  # first phase at the floor too
        assert requests != plan_asked
    assert (requests != plan_asked) == changes


def _window_profile(nb: int) -> HardwareProfile:
    """Copies 2.5x slower than computes (a full expert loads in 0.25 ms, computes in 0.1 ms; lead 0.1 ms): the
    copy engine's idle time holds about half an expert, so many prefetches are cut and some fit whole."""
    full = INTER * nb
    return HardwareProfile("slow-copy", h2d_bytes_per_s=full / 2.5e-4, copy_latency_s=1e-5,
                           compute_bytes_per_s=full / 1e-4, compute_latency_s=0.0, router_s=2e-5, other_s=8e-5)


def _replay_runtime(layers, plan, predicted, trace, serving, policy, cost, budget):
    """The trace through CrispRuntime + Prefetcher (each layer: forward, then the next layer's prefetch);
    returns the runtime's stats."""
    runtime = CrispRuntime(layers, plan, device="cpu", gpu_budget=budget,
                           config=RuntimeConfig(serving=serving, eviction="next_use", cost=cost, prefetch=policy))
    token = [0]
    prefetcher = Prefetcher(TracePredictor(predicted, token, LAYERS), runtime, policy)
    decode_trace(runtime, trace, HIDDEN, prefetcher, token)
    return runtime.stats.as_dict()


@pytest.mark.parametrize(("serving", "width"), [("resident-floor75-ahead", PrefetchWidth.SERVING),
                                                ("resident-floor75", PrefetchWidth.PLAN),
                                                ("plan", PrefetchWidth.PLAN)])
def test_prefetch_window_makes_the_same_cuts(decisions_and_prefetches, serving, width):
    """With ``PrefetchPolicy.window`` the runtime on the CPU cuts prefetches where the simulator's timeline
    does (same window, built from the profile and the target's bytes per row): every demand and prefetch
    decision (expert, width asked, kind, bytes, evictions) identical, the same counters; without the window
    the runtime copies every prefetch whole, and its decisions differ."""
    log = decisions_and_prefetches
    trace = synthetic_trace(num_layers=LAYERS, num_tokens=24, num_experts=EXPERTS, intermediate_size=INTER, seed=5)
    predicted = np.full((LAYERS, trace.num_tokens, 2), -1, dtype=np.int64)
    predicted[:-1] = trace.index[1:]
    predicted[0, ::3] = trace.index[0, ::3]  # a third of layer 0's predictions wrong: demanded misses, too
    plan = plan_from_trace(trace)
    layers = random_layers(layer_ids=tuple(range(LAYERS)), num_experts=EXPERTS, inter=INTER, hidden=HIDDEN)
    nb = layers[0].fmt.neuron_nbytes(HIDDEN)
    shape = ModelShape("toy", LAYERS, EXPERTS, 2, HIDDEN, INTER)
    budget = 5 * INTER * nb
    profile = _window_profile(nb)
    cost = CostModel(h2d_bytes_per_s=profile.h2d_bytes_per_s, device_bytes_per_s=profile.compute_bytes_per_s)
    window = target_window(profile, shape, INTER)
    assert window == profile.prefetch_window(nb, "slow-copy/toy")  # one runtime row is one target row here

    stats = _replay_runtime(layers, plan, predicted, trace, serving, PrefetchPolicy(width=width, window=window),
                            cost, budget)
    by_runtime = list(log)
    log.clear()
    sim_policy = SimPolicy("crisp", plan, SERVING_POLICIES[serving], "next_use", prefetch=True, prefetch_width=width)
    timeline = []
    res = simulate_decode(trace, sim_policy, profile, shape, budget, orders=["widest_first"], predicted=predicted,
                          timeline=timeline)
    assert log == by_runtime
    c = res.counters
    assert (c.hits, c.misses, c.widenings, c.evictions, c.bytes_copied, c.prefetches, c.prefetch_bytes,
            c.prefetch_rejected, c.prefetch_hits) == (
        stats["hits"], stats["misses"], stats["widenings"], stats["evictions"], stats["bytes_h2d"],
        stats["prefetches"], stats["prefetch_bytes"], stats["prefetch_rejected"], stats["prefetch_hits"])
    assert res.fallbacks == stats["fallbacks"] and res.peak_bytes <= budget
    assert sum(len(step["prefetch"]) for step in timeline) == stats["prefetches"]
    # The window cut prefetches here (the check is not vacuous): some asked below their request's width.
    requests = prefetch_requests(plan, trace, predicted, PrefetchPolicy(width=width), SERVING_POLICIES[serving])
    topups = prefetch_requests(plan, trace, predicted, PrefetchPolicy(width=width), SERVING_POLICIES[serving],
                               phase=2)
    asked = {(layer + 1, e, w) for layer in range(LAYERS) for t in range(trace.num_tokens)
             for e, w in requests[layer][t] + topups[layer][t]}
    prefetched = [(d[1], d[2], d[3]) for d in by_runtime if d[0] == "prefetch"]
    assert stats["prefetch_cut"] > 0 and stats["prefetch_cut_rows"] > 0
    assert any(p not in asked for p in prefetched)  # a cut one: asked at fewer rows than requested
    assert any(p in asked for p in prefetched)  # and whole ones
    # Without the window (the CPU's default) every prefetch is copied whole: other decisions, more bytes.
    log.clear()
    plain = _replay_runtime(layers, plan, predicted, trace, serving, PrefetchPolicy(width=width), cost, budget)
    assert log != by_runtime and plain["prefetch_bytes"] > stats["prefetch_bytes"]
    assert plain["prefetch_cut"] == 0
