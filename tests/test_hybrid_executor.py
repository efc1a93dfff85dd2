"""Hybrid execution (issue 11) on this CPU: the CPU's experts on the worker thread, joined into the output.

Outputs equal the float64 reference at the widths served, whatever the placement; a CPU-served
expert is neither copied nor admitted; the worker thread is created on first use and stopped by
close(); the kernel adapter for H1's signature (x gathered, out per expert) gives the same output.
"""

from __future__ import annotations

import threading

import pytest
import torch
from runtime_helpers import random_layers

from crisp_kernels import Backend, dequantize_expert
from crisp_kernels.expert_mlp import expert_mlp_accumulate_unchecked_
from crisp_runtime import CrispPlan, CrispRuntime, RuntimeConfig, min_budget_bytes
from crisp_runtime.cpu_experts import cpu_kernel
from crisp_runtime.scheduler import CostModel, Placement
from crisp_runtime.serving import SERVING_POLICIES, ServingPolicy

E, INTER, TOP_K, HIDDEN = 6, 16, 2, 64
LAYER_IDS = (1, 2)
LAYERS = random_layers(layer_ids=LAYER_IDS, num_experts=E, inter=INTER, hidden=HIDDEN, seed=5)
NB = LAYERS[1].fmt.neuron_nbytes(HIDDEN)
DEQ = {i: [dequantize_expert(layer.expert(e), dtype=torch.float64) for e in range(E)] for i, layer in LAYERS.items()}
# Bandwidths in bytes/s chosen so that both sides get work: a full expert (16 x NB bytes) copies in
# ~2x the CPU's time, the CPU is 20x slower than the GPU's kernels, the copy slows 40% while the CPU streams.
COST = CostModel(h2d_bytes_per_s=1e6, device_bytes_per_s=4e7, cpu_bytes_per_s=2e6, h2d_bytes_per_s_cpu_busy=6e5,
                 join_s=1e-5)
PLANS = {
    "full": CrispPlan.full(E, TOP_K, INTER, LAYER_IDS),
    "uniform": CrispPlan.uniform(E, TOP_K, INTER, LAYER_IDS, width=5),
    "skip_aux": CrispPlan.skip_aux(E, TOP_K, INTER, LAYER_IDS, threshold=0.35),
}


def reference(layer_id, x, index, weights, widths):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(index.shape[1]):
            e, w = int(index[t, s]), int(widths[t, s])
            if w == 0:
                continue
            gate, up, down = DEQ[layer_id][e]
            xt = x[t].double()
            out[t] += float(weights[t, s]) * (down[:, :w] @ (torch.nn.functional.silu(gate[:w] @ xt) * (up[:w] @ xt)))
    return out


def make_step(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g) * 2, dim=-1)
    return x, index, weights


def rel_err(out, ref):
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def policy(name, placement):
    return ServingPolicy(f"{name}-{placement.value}", **{k: v for k, v in SERVING_POLICIES[name].to_dict().items()
                                                         if k != "name"}, placement=placement)


@pytest.mark.parametrize("kernel", ["reference", "cpu_expert"])
@pytest.mark.parametrize("placement", [Placement.HYBRID, Placement.STATIC, Placement.CPU])
@pytest.mark.parametrize("serving", ["plan", "resident-floor75"])
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_outputs_equal_reference_at_served_widths(placement, serving, plan_name, kernel):
    if kernel == "cpu_expert" and cpu_kernel() is None:
        pytest.skip("crisp_kernels.cpu_expert (H1's CPU kernel) is not there")
    plan = PLANS[plan_name]
    budget = min_budget_bytes(LAYERS, TOP_K) + 3 * INTER * NB
    runtime = CrispRuntime(LAYERS, plan, device="cpu", gpu_budget=budget,
                           config=RuntimeConfig(serving=policy(serving, placement), cost=COST))
    # the torch reference, or H1's kernel (fp32 activations: its fp32 dequant path, same 1e-5 tolerance)
    runtime._cpu_kernel = None if kernel == "reference" else cpu_kernel()
    if placement is Placement.STATIC:  # the pinned experts: two per layer at full width
        for layer_id in LAYER_IDS:
            runtime.prefetch(layer_id, [(0, INTER), (1, INTER)])
    cpu_tasks = copied = 0
    for i, tokens in enumerate([1, 1, 3, 1, 9, 40, 1]):
        layer_id = LAYER_IDS[i % 2]
        x, index, weights = make_step(tokens, 100 * i + len(plan_name))
        before = runtime.cache.resident()
        out = runtime.forward(layer_id, x, index, weights)
        step, served = runtime.last_step[layer_id], runtime.last_served[layer_id]
        # 1e-5: the float32 kernels against float64 (the runtime tests' tolerance)
        assert rel_err(out, reference(layer_id, x, index, weights, served.widths)) < 1e-5
        after = runtime.cache.resident()
        for t in step.tasks:
            key = (layer_id, t.expert)
            if t.on_cpu:  # not copied, not admitted: resident exactly as before (or evicted by a GPU task)
                assert t.copy_bytes == 0 and after.get(key, 0) <= before.get(key, 0)
            else:
                assert after[key] >= t.width
        cpu_tasks += sum(t.on_cpu for t in step.tasks)
        copied += sum(t.copy_bytes for t in step.tasks)
        assert runtime.cache.used <= budget
        if placement is Placement.CPU:
            assert all(t.on_cpu for t in step.tasks)
    stats = runtime.stats.as_dict()
    assert stats["cpu_runs"] == cpu_tasks and stats["bytes_h2d"] == copied
    assert cpu_tasks > 0
    if placement is not Placement.HYBRID:
        assert copied == 0  # static and cpu_only never copy on demand
    runtime.close()


def test_hybrid_uses_both_sides_and_beats_the_fixed_placements_in_the_model():
    runtime = CrispRuntime(LAYERS, PLANS["full"], device="cpu", gpu_budget=min_budget_bytes(LAYERS, TOP_K) * 3,
                           config=RuntimeConfig(serving="hybrid", cost=COST))
    sides = set()
    for i in range(12):
        x, index, weights = make_step(4, i)
        runtime.forward(LAYER_IDS[0], x, index, weights)
        sides |= {t.on_cpu for t in runtime.last_step[LAYER_IDS[0]].tasks}
    assert sides == {True, False}


def _h1_style_kernel(calls):
    """A kernel with H1's signature (x = the expert's tokens, out per expert), built on the reference."""
    def kernel(x, packed, token_widths, width, weights, out):
        calls.append(threading.current_thread().name)
        rows = torch.arange(x.shape[0])
        expert_mlp_accumulate_unchecked_(out, x, packed, width, rows, weights, token_widths, Backend.TORCH)
    return kernel


def test_worker_thread_lazy_and_closed_and_adapter():
    runtime = CrispRuntime(LAYERS, PLANS["uniform"], device="cpu", gpu_budget=min_budget_bytes(LAYERS, TOP_K),
                           config=RuntimeConfig(serving="cpu_only", cost=COST))
    assert not runtime._cpu.started
    calls = []
    runtime._cpu_kernel = _h1_style_kernel(calls)
    for round_ in range(2):  # after close(), a later step starts a new thread
        x, index, weights = make_step(5, round_)
        out = runtime.forward(1, x, index, weights)
        assert rel_err(out, reference(1, x, index, weights, runtime.last_served[1].widths)) < 1e-5
        assert runtime._cpu.started
        assert calls and all(name.startswith("crisp-cpu-experts") for name in calls)
        assert runtime.cache.used == 0  # cpu_only: nothing copied
        runtime.close()
        assert not runtime._cpu.started
        calls.clear()


def test_worker_exception_reaches_the_caller():
    runtime = CrispRuntime(LAYERS, PLANS["full"], device="cpu", gpu_budget=min_budget_bytes(LAYERS, TOP_K),
                           config=RuntimeConfig(serving="cpu_only", cost=COST))

    def broken(*_):
        raise RuntimeError("cpu kernel failed")

    runtime._cpu_kernel = broken
    x, index, weights = make_step(2, 0)
    with pytest.raises(RuntimeError, match="cpu kernel failed"):
        runtime.forward(1, x, index, weights)
    runtime.close()


@pytest.mark.parametrize("budget,cost,match", [
    (None, COST, "needs a gpu_budget"),
    ("min", CostModel(), "cpu_bytes_per_s"),
])
def test_hybrid_needs_host_memory_and_a_cpu_cost(budget, cost, match):
    gpu_budget = min_budget_bytes(LAYERS, TOP_K) if budget == "min" else budget
    with pytest.raises(ValueError, match=match):
        CrispRuntime(LAYERS, PLANS["full"], device="cpu", gpu_budget=gpu_budget,
                     config=RuntimeConfig(serving="hybrid", cost=cost))


def test_placement_round_trips_and_gpu_dicts_unchanged():
    assert "placement" not in SERVING_POLICIES["resident"].to_dict()
    for name in ("hybrid", "static_hybrid", "cpu_only"):
        p = SERVING_POLICIES[name]
        assert ServingPolicy.from_dict(p.to_dict()) == p and p.follows_plan
    with pytest.raises(ValueError, match="placement must be one of"):
        ServingPolicy("x", placement="gpu+cpu")
