"""The runtime end to end on the CPU path: outputs against a direct float64 reference of the same widths,
statistics against a brute-force replay, for random routings, plans, budgets and eviction sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_helpers import ReplayCache, random_layers

from crisp_kernels import dequantize_expert
from crisp_runtime import CrispPlan, RuntimeConfig, Tier, TierWidths
from crisp_runtime.execution.runtime import CrispRuntime, min_budget_bytes
from crisp_runtime.planning.plan import LayerPlan

E, INTER, TOP_K = 6, 16, 2
LAYER_IDS = (1, 2)
LAYERS = random_layers(layer_ids=LAYER_IDS, num_experts=E, inter=INTER)
NB = LAYERS[1].fmt.neuron_nbytes(LAYERS[1].hidden_size)
# Full-width float64 weights per expert; the width-w prefix is rows [:w] of gate/up, columns [:w] of down.
DEQ = {i: [dequantize_expert(layer.expert(e), dtype=torch.float64) for e in range(E)] for i, layer in LAYERS.items()}


def reference(layer_id, x, index, weights, widths):
    """out[t] = Σ_s weights[t, s] * expert_{index[t, s]}(x[t]) over its first widths[t, s] neurons, float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(index.shape[1]):
            e, w = int(index[t, s]), int(widths[t, s])
            if w == 0 or not 0 <= e < E:
                continue
            gate, up, down = DEQ[layer_id][e]
            xt = x[t].double()
            h = torch.nn.functional.silu(gate[:w] @ xt) * (up[:w] @ xt)
            out[t] += float(weights[t, s]) * (down[:, :w] @ h)
    return out


def test_reference_prefix_is_dequantized_prefix():
    gate, up, down = dequantize_expert(LAYERS[1].expert(3), 5, dtype=torch.float64)
    assert torch.equal(gate, DEQ[1][3][0][:5]) and torch.equal(down, DEQ[1][3][2][:, :5])


@st.composite
def plans(draw):
    kind = draw(st.sampled_from(["full", "uniform", "skip", "skip_threshold", "crisp"]))
    if kind == "full":
        return CrispPlan.full(E, TOP_K, INTER, LAYER_IDS)
    if kind == "uniform":
        return CrispPlan.uniform(E, TOP_K, INTER, LAYER_IDS, draw(st.integers(0, INTER)))
    if kind == "skip":
        return CrispPlan.skip_aux(E, TOP_K, INTER, LAYER_IDS)
    if kind == "skip_threshold":
        return CrispPlan.skip_aux(E, TOP_K, INTER, LAYER_IDS, threshold=draw(st.floats(0.0, 1.0)))
    layers = {}
    for layer_id in LAYER_IDS:
        pairs = draw(st.lists(st.tuples(st.integers(0, E - 1), st.integers(0, E - 1)).filter(lambda p: p[0] < p[1]),
                              max_size=8, unique=True))
        tiers = {p: draw(st.sampled_from(list(Tier))) for p in pairs}
        dominant = {p: draw(st.sampled_from(p)) for p in pairs}
        layers[layer_id] = LayerPlan(tiers, dominant)
    widths = TierWidths(INTER, draw(st.integers(0, INTER)), draw(st.integers(0, INTER)))
    return CrispPlan.crisp(E, TOP_K, INTER, layers, widths, unseen_tier=draw(st.sampled_from(list(Tier))))


@st.composite
def step_inputs(draw):
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        layer_id = draw(st.sampled_from(LAYER_IDS))
        tokens = draw(st.integers(1, 24))
        seed = draw(st.integers(0, 2**31 - 1))
        steps.append((layer_id, tokens, seed))
    return steps


def make_step(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), dim=-1)
    return x, index, weights


@settings(max_examples=40, deadline=None)
@given(plans(), step_inputs(), st.one_of(st.none(), st.integers(0, 6 * INTER)),
       st.sampled_from(["lru", "frequency", "tier"]))
def test_runtime_matches_reference_and_replay(plan, steps, extra_neurons, eviction):
    budget = None if extra_neurons is None else min_budget_bytes(LAYERS, TOP_K) + extra_neurons * NB
    runtime = CrispRuntime(LAYERS, plan, device="cpu", gpu_budget=budget, config=RuntimeConfig(eviction=eviction))
    replay = ReplayCache(budget, {i: NB for i in LAYER_IDS}) if eviction == "lru" and budget else None
    total_read = 0
    for layer_id, tokens, seed in steps:
        x, index, weights = make_step(tokens, seed)
        widths = plan.token_widths(layer_id, index, weights)
        out = runtime.forward(layer_id, x, index, weights)
        ref = reference(layer_id, x, index, weights, widths)
        err = (out.double() - ref).norm() / ref.norm().clamp_min(1e-30)
        assert err < 1e-5 or ref.norm() == 0 and out.abs().max() == 0
        # bytes a cache-less offload reads: per expert, its widest token (brute force)
        need = {}
        for t in range(tokens):
            for s in range(TOP_K):
                if widths[t, s] > 0:
                    e = int(index[t, s])
                    need[e] = max(need.get(e, 0), int(widths[t, s]))
        total_read += sum(need.values()) * NB
        if budget is not None:
            assert runtime.cache.used <= budget
        if replay is not None:
            tasks = runtime.last_step[layer_id].tasks
            assert {t.expert: t.width for t in tasks} == need
            pending = {(layer_id, t.expert) for t in tasks}
            for t in tasks:
                pending.discard((layer_id, t.expert))
                replay.request((layer_id, t.expert), t.width, pending)
    stats = runtime.stats.as_dict()
    assert stats["bytes_read"] == total_read
    assert stats["tokens"] == max(sum(n for i, n, _ in steps if i == layer_id) for layer_id in LAYER_IDS)
    if budget is None:
        assert stats["bytes_h2d"] == 0 and stats["misses"] == 0
    if replay is not None:
        assert stats["bytes_h2d"] == replay.copied
        assert stats["evictions"] == replay.evictions
        assert stats["hits"] == replay.kinds.count("hit")
        assert stats["misses"] == replay.kinds.count("miss")
        assert stats["widenings"] == replay.kinds.count("widen")
        assert runtime.cache.resident() == replay.resident


def test_one_launch_serves_mixed_widths():
    # Two tokens route to expert 0: one needs it full, one at 4 neurons; the cache holds it once, at full width.
    plan = CrispPlan.crisp(E, TOP_K, INTER, {1: LayerPlan({(0, 1): Tier.WARM, (0, 2): Tier.HOT},
                                                        {(0, 1): 1, (0, 2): 0})}, TierWidths(INTER, 4, 0))
    runtime = CrispRuntime(LAYERS, plan, device="cpu", gpu_budget=min_budget_bytes(LAYERS, TOP_K))
    x = torch.randn(2, 64)
    index = torch.tensor([[0, 1], [0, 2]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3]])
    widths = plan.token_widths(1, index, weights)
    assert widths.tolist() == [[4, INTER], [INTER, INTER]]  # token 0: dominant 1 full, 0 narrowed
    out = runtime.forward(1, x, index, weights)
    torch.testing.assert_close(out.double(), reference(1, x, index, weights, widths), rtol=1e-5, atol=1e-6)
    tasks = runtime.last_step[1].tasks
    assert {t.expert: t.width for t in tasks} == {0: INTER, 1: INTER, 2: INTER}
    st_ = runtime.stats.as_dict()
    assert st_["misses"] == 3 and st_["bytes_h2d"] == 3 * INTER * NB


def test_narrow_then_wide_widens():
    plan = CrispPlan.uniform(E, TOP_K, INTER, LAYER_IDS, 5)
    runtime = CrispRuntime(LAYERS, plan, device="cpu", gpu_budget=min_budget_bytes(LAYERS, TOP_K))
    x, index, weights = make_step(1, 0)
    runtime.forward(1, x, index, weights)
    runtime.set_plan(CrispPlan.full(E, TOP_K, INTER, LAYER_IDS))
    runtime.forward(1, x, index, weights)
    s = runtime.stats.as_dict()
    assert (s["misses"], s["widenings"], s["hits"]) == (2, 2, 0)
    assert s["bytes_h2d"] == 2 * INTER * NB  # 5 rows each, then the missing 11
    runtime.forward(1, x, index, weights)
    assert runtime.stats.as_dict()["hits"] == 2


def test_dtypes_and_padding_sentinels():
    plan = CrispPlan.full(E, TOP_K, INTER, LAYER_IDS)
    runtime = CrispRuntime(LAYERS, plan, device="cpu", gpu_budget=None)
    x, index, weights = make_step(3, 1)
    index[1, 1] = E  # an expert-parallel style sentinel: skipped
    for dtype in (torch.float32, torch.bfloat16):
        out = runtime.forward(2, x.to(dtype), index, weights)
        assert out.dtype == dtype
        widths = plan.token_widths(2, index, weights)
        ref = reference(2, x.to(dtype).float(), index, weights, widths)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert ((out.double() - ref).norm() / ref.norm()) < tol
    assert runtime.stats.as_dict()["skipped"] == 2


@pytest.mark.parametrize(("kwargs", "err", "match"), [
    ({"kernel_backend": "nope"}, ValueError,
     r"RuntimeConfig.kernel_backend: expected None \(automatic\) or one of \['triton', 'triton-interpret', 'torch'\]"),
    ({"keep_original": "no"}, TypeError, "RuntimeConfig.keep_original: expected True or False, got str 'no'"),
    ({"async_copies": "x"}, TypeError, "RuntimeConfig.async_copies: expected True or False"),
    ({"record_timings": "yes"}, TypeError, "RuntimeConfig.record_timings: expected True or False"),
    ({"record_timings": 1}, TypeError, "RuntimeConfig.record_timings: expected True or False"),
    ({"pin_memory": "x"}, TypeError, "RuntimeConfig.pin_memory: expected True, False or None"),
    ({"eviction": "nope"}, ValueError, "RuntimeConfig.eviction: expected one of"),
])
def test_runtime_config_refuses_bad_fields_naming_them(kwargs, err, match):
    with pytest.raises(err, match=match):
        RuntimeConfig(**kwargs)


def test_runtime_config_accepts_its_documented_values():
    from crisp_kernels import Backend
    from crisp_runtime.residency.eviction import NextUsePolicy

    for backend in (None, "torch", Backend.TORCH):
        assert RuntimeConfig(kernel_backend=backend).kernel_backend == backend
    for eviction in ("lru", "frequency", "tier", "next_use", NextUsePolicy, NextUsePolicy()):
        RuntimeConfig(eviction=eviction)
    for pin in (None, True, False):
        RuntimeConfig(pin_memory=pin, async_copies=False, keep_original=False, record_timings=True)


def test_set_plan_rejects_other_pack():
    runtime = CrispRuntime(LAYERS, CrispPlan.full(E, TOP_K, INTER, LAYER_IDS), device="cpu", gpu_budget=None)
    from crisp_runtime import PlanError

    with pytest.raises(PlanError, match="num_experts"):
        runtime.set_plan(CrispPlan.full(E + 1, TOP_K, INTER, LAYER_IDS))
    with pytest.raises(PlanError, match="layers"):
        runtime.set_plan(CrispPlan.full(E, TOP_K, INTER, (1, 5)))


@pytest.mark.gpu
@pytest.mark.parametrize("eviction", ["lru", "frequency"])
def test_cuda_async_copies_match_sync_and_reference(eviction):
    """GPU-only: the copy stream + events path gives the synchronous path's results and statistics,
    under a budget that forces misses, widenings and evictions of prefixes a queued kernel just read."""
    device = torch.device("cuda")
    budget = min_budget_bytes(LAYERS, TOP_K) + 3 * INTER * NB
    narrow = CrispPlan.uniform(E, TOP_K, INTER, LAYER_IDS, 5)
    full = CrispPlan.full(E, TOP_K, INTER, LAYER_IDS)
    runtimes = {mode: CrispRuntime(LAYERS, narrow, device=device, gpu_budget=budget,
                                   config=RuntimeConfig(eviction=eviction, async_copies=mode == "async"))
                for mode in ("async", "sync")}
    for i, (layer_id, tokens) in enumerate([(1, 1), (2, 3), (1, 24), (2, 1), (1, 17), (2, 5), (1, 1)]):
        plan = narrow if i // 2 % 2 == 0 else full  # each layer narrow, then full: widenings
        x, index, weights = make_step(tokens, 100 + i)
        ref = reference(layer_id, x, index, weights, plan.token_widths(layer_id, index, weights))
        for runtime in runtimes.values():
            runtime.set_plan(plan)
            out = runtime.forward(layer_id, x.to(device), index.to(device), weights.to(device))
            assert out.device.type == "cuda" and runtime.cache.used <= budget
            err = (out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)
            assert err < 1e-5 or ref.norm() == 0 and out.abs().max() == 0
    torch.cuda.synchronize()
    s_async, s_sync = (runtimes[m].stats.as_dict() for m in ("async", "sync"))
    assert s_async == s_sync and s_async["widenings"] > 0 and s_async["evictions"] > 0


def test_record_timings_on_the_synchronous_path():
    plan = CrispPlan.full(E, TOP_K, INTER, LAYER_IDS)
    runtime = CrispRuntime(LAYERS, plan, device="cpu", gpu_budget=min_budget_bytes(LAYERS, TOP_K),
                           config=RuntimeConfig(record_timings=True))
    x, index, weights = make_step(5, 0)
    runtime.forward(1, x, index, weights)
    timings = runtime.last_timings[1]
    assert len(timings) == len(runtime.last_step[1].tasks) > 0
    assert all(load >= 0 and compute > 0 for load, compute in timings)
    assert runtime.stats.layers[1].copy_ms == pytest.approx(1e3 * sum(lo for lo, _ in timings))
    untimed = CrispRuntime(LAYERS, plan, device="cpu", gpu_budget=min_budget_bytes(LAYERS, TOP_K))
    untimed.forward(1, x, index, weights)
    assert untimed.last_timings == {} and untimed.stats.layers[1].copy_ms == 0
