"""Hybrid execution on this CPU: the CPU's experts on the worker thread, joined into the output.

Outputs equal the float64 reference at the widths served, whatever the placement, within the
precision contract of ``RuntimeConfig.cpu_experts``: a GPU-served expert within 1e-5 (fp32 kernels),
a CPU-served one within 1e-5 on the exact fp32 path and within 2u of bf16 (7.8e-3) on the bf16
path (fp32 activations, rounded to bf16 by the path: measured 4.9e-3..5.9e-3 on H 128..1024 against
4.1e-3..5.0e-3 for bf16-valued ones), each relative to its own contribution's norm; so a step's
error is bounded by the sum of those per-expert bounds (triangle inequality), which the tests assert. A
CPU-served expert is neither copied nor admitted; the worker thread is created on first use and stopped by close(),
runs at its own torch thread count without changing the caller's; the int4pack copies are built
once, lazily (only the experts the CPU ran) or eagerly (all), and reported in ``cpu_stats()``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from runtime_helpers import random_layers

from crisp_kernels import Backend, dequantize_expert
from crisp_kernels.cpu_expert import CpuExpert, Precision
from crisp_kernels.expert_mlp import expert_mlp_accumulate_unchecked_
from crisp_runtime import CrispPlan, RuntimeConfig
from crisp_runtime.cpu.experts import EXACT, TOLERANCE, CpuExpertsConfig, CpuPrepare
from crisp_runtime.execution.runtime import CrispRuntime, min_budget_bytes
from crisp_runtime.planning.serving import SERVING_POLICIES, ServingPolicy
from crisp_runtime.scheduling.scheduler import CostModel, Placement

E, INTER, TOP_K, HIDDEN = 6, 16, 2, 64
LAYER_IDS = (1, 2)
LAYERS = random_layers(layer_ids=LAYER_IDS, num_experts=E, inter=INTER, hidden=HIDDEN, seed=5)
NB = LAYERS[1].fmt.neuron_nbytes(HIDDEN)
DEQ = {i: [dequantize_expert(layer.expert(e), dtype=torch.float64) for e in range(E)] for i, layer in LAYERS.items()}
# Wide enough for torch's int4pack op (64-neuron blocks): 2 blocks + 32 neurons on the exact path.
WIDE_INTER, WIDE_HIDDEN = 160, 128
WIDE = random_layers(layer_ids=LAYER_IDS, num_experts=E, inter=WIDE_INTER, hidden=WIDE_HIDDEN, seed=6)
WIDE_DEQ = {i: [dequantize_expert(layer.expert(e), dtype=torch.float64) for e in range(E)] for i, layer in WIDE.items()}
# "native": the default (the C kernel on the host rows, no copy); the torch paths asked for by kernel="torch".
CPU_CONFIGS = {"exact": EXACT, "native": CpuExpertsConfig(kernel="native"),
               "bf16-lazy": CpuExpertsConfig(kernel="torch"),
               "bf16-eager": CpuExpertsConfig(prepare="eager", kernel="torch"),
               "bf16-host-rows": CpuExpertsConfig(prepare="none", kernel="torch")}
# Bandwidths in bytes/s chosen so that both sides get work: a full expert (16 x NB bytes) copies in
# ~2x the CPU's time, the CPU is 20x slower than the GPU's kernels, the copy slows 40% while the CPU streams.
COST = CostModel(h2d_bytes_per_s=1e6, device_bytes_per_s=4e7, cpu_bytes_per_s=2e6, h2d_bytes_per_s_cpu_busy=6e5,
                 join_s=1e-5)
PLANS = {
    "full": CrispPlan.full(E, TOP_K, INTER, LAYER_IDS),
    "uniform": CrispPlan.uniform(E, TOP_K, INTER, LAYER_IDS, width=5),
    "skip_aux": CrispPlan.skip_aux(E, TOP_K, INTER, LAYER_IDS, threshold=0.35),
}


def reference_by_expert(layer_id, x, index, weights, widths, deq=DEQ):
    """{expert: its (T, H) float64 contribution at the served widths}."""
    out = {}
    for t in range(x.shape[0]):
        for s in range(index.shape[1]):
            e, w = int(index[t, s]), int(widths[t, s])
            if w == 0:
                continue
            gate, up, down = deq[layer_id][e]
            xt = x[t].double()
            part = out.setdefault(e, torch.zeros(x.shape, dtype=torch.float64))
            part[t] += float(weights[t, s]) * (down[:, :w] @ (torch.nn.functional.silu(gate[:w] @ xt) * (up[:w] @ xt)))
    return out


def reference(layer_id, x, index, weights, widths, deq=DEQ):
    parts = reference_by_expert(layer_id, x, index, weights, widths, deq)
    return sum(parts.values(), torch.zeros(x.shape, dtype=torch.float64))


def error_bound(parts, step, cpu_tol):
    """The step's error bound: each expert's tolerance times its contribution's norm (GPU side: 1e-5)."""
    on_cpu = {t.expert: t.on_cpu for t in step.tasks}
    return sum((cpu_tol if on_cpu[e] else 1e-5) * float(p.norm()) for e, p in parts.items())


def make_step(tokens, seed, hidden=HIDDEN):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g) * 2, dim=-1)
    return x, index, weights


def rel_err(out, ref):
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def policy(name, placement):
    return ServingPolicy(f"{name}-{placement.value}", **{k: v for k, v in SERVING_POLICIES[name].to_dict().items()
                                                         if k != "name"}, placement=placement)


def _plans(inter):
    return {"full": CrispPlan.full(E, TOP_K, inter, LAYER_IDS),
            "uniform": CrispPlan.uniform(E, TOP_K, inter, LAYER_IDS, width=5 if inter == INTER else 100),
            "skip_aux": CrispPlan.skip_aux(E, TOP_K, inter, LAYER_IDS, threshold=0.35)}


# The serving / plan matrix on the small layers; the wide layers (the int4pack path) at the plan's widths.
CASES = ([("small", serving, plan) for serving in ("plan", "resident-floor75") for plan in PLANS]
         + [("wide", "plan", "full"), ("wide", "plan", "uniform")])


@pytest.mark.parametrize("cpu", list(CPU_CONFIGS))
@pytest.mark.parametrize("placement", [Placement.HYBRID, Placement.STATIC, Placement.CPU])
@pytest.mark.parametrize("size,serving,plan_name", CASES)
def test_outputs_equal_reference_at_served_widths(placement, serving, plan_name, size, cpu):
    layers, inter, hidden, deq = ((LAYERS, INTER, HIDDEN, DEQ) if size == "small" else
                                  (WIDE, WIDE_INTER, WIDE_HIDDEN, WIDE_DEQ))
    nb = layers[1].fmt.neuron_nbytes(hidden)
    plan = _plans(inter)[plan_name]
    budget = min_budget_bytes(layers, TOP_K) + 3 * inter * nb
    cost = COST if size == "small" else CostModel(h2d_bytes_per_s=1e6 * 20, device_bytes_per_s=4e7 * 20,
                                                  cpu_bytes_per_s=2e6 * 20, h2d_bytes_per_s_cpu_busy=6e5 * 20,
                                                  join_s=1e-5)  # the same ratios for 10x the bytes per expert
    config = CPU_CONFIGS[cpu]
    cpu_tol = TOLERANCE[config.precision]
    runtime = CrispRuntime(layers, plan, device="cpu", gpu_budget=budget,
                           config=RuntimeConfig(serving=policy(serving, placement), cost=cost, cpu_experts=config))
    if placement is Placement.STATIC:  # the pinned experts: two per layer at full width
        for layer_id in LAYER_IDS:
            runtime.prefetch(layer_id, [(0, inter), (1, inter)])
    cpu_tasks = copied = 0
    cpu_ran = set()
    for i, tokens in enumerate([1, 1, 3, 1, 9, 40, 1]):
        layer_id = LAYER_IDS[i % 2]
        x, index, weights = make_step(tokens, 100 * i + len(plan_name), hidden)
        before = runtime.cache.resident()
        out = runtime.forward(layer_id, x, index, weights)
        step, served = runtime.last_step[layer_id], runtime.last_served[layer_id]
        parts = reference_by_expert(layer_id, x, index, weights, served.widths, deq)
        ref = sum(parts.values(), torch.zeros(x.shape, dtype=torch.float64))
        # each expert within its side's tolerance of its own contribution (GPU: fp32 kernels 1e-5; CPU: the
        # precision contract), so the step within the sum of those bounds
        assert float((out.double() - ref).norm()) <= error_bound(parts, step, cpu_tol)
        if config.precision is Precision.FP32:
            assert rel_err(out, ref) < 1e-5
        cpu_ran |= {(layer_id, t.expert) for t in step.tasks if t.on_cpu}
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
    info = runtime.cpu_stats()["experts"]
    prepared = {"exact": 0, "native": 0, "bf16-host-rows": 0, "bf16-lazy": len(cpu_ran),
                "bf16-eager": len(LAYER_IDS) * E}[cpu]
    assert info["prepared_experts"] == prepared  # lazily: exactly the experts the CPU ran, each once
    assert info["prepared_bytes"] == sum(x.nbytes for x in runtime._cpu._prepared.values())
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
    def kernel(x, packed, token_widths, width, weights, out, *, config, row_start=0, threads=None):
        assert row_start == 0  # cpu_only: whole experts
        calls.append((threading.current_thread().name, threads))
        packed = packed.packed if isinstance(packed, CpuExpert) else packed
        rows = torch.arange(x.shape[0])
        expert_mlp_accumulate_unchecked_(out, x.float(), packed, width, rows, weights, token_widths, Backend.TORCH)
    return kernel


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_steps_without_gpu_tasks_run_on_the_calling_thread(threads):
    """cpu_only: no GPU task in any step, so the CPU rows run on the calling thread (no hand-off to the worker,
    which never starts), the native kernel at ``threads`` (None: the caller's torch threads)."""
    runtime = CrispRuntime(LAYERS, PLANS["uniform"], device="cpu", gpu_budget=min_budget_bytes(LAYERS, TOP_K),
                           config=RuntimeConfig(serving="cpu_only", cost=COST,
                                                cpu_experts=CpuExpertsConfig(threads=threads)))
    calls = []
    runtime._cpu.kernel = _h1_style_kernel(calls)
    mine = torch.get_num_threads()
    for round_ in range(2):
        x, index, weights = make_step(5, round_)
        out = runtime.forward(1, x, index, weights)
        assert rel_err(out, reference(1, x, index, weights, runtime.last_served[1].widths)) < 1e-5
        here = threading.current_thread().name
        assert calls and all(c == (here, threads if threads is not None else mine) for c in calls)
        assert not runtime._cpu.started and torch.get_num_threads() == mine
        assert runtime.cache.used == 0  # cpu_only: nothing copied
        calls.clear()
    runtime.close()


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_worker_thread_lazy_and_closed(threads):
    """The worker (a step with GPU tasks hands its CPU rows to it): started on first use with its own torch
    threads, the caller's and torch's default for new threads unchanged; close() stops it, a later job starts
    a new one."""
    from crisp_runtime.cpu.experts import CpuWorker

    worker = CpuWorker(threads)
    assert not worker.started
    mine = torch.get_num_threads()
    want = threads if threads is not None else max(1, mine - 1)
    for _ in range(2):
        name, n = worker.submit(lambda: (threading.current_thread().name, torch.get_num_threads())).result()
        assert worker.started and name.startswith("crisp-cpu-experts") and n == want == worker.threads
        assert torch.get_num_threads() == mine
        fresh: list[int] = []
        t = threading.Thread(target=lambda out=fresh: out.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert fresh == [mine]
        worker.close()
        assert not worker.started


def test_worker_exception_reaches_the_caller():
    runtime = CrispRuntime(LAYERS, PLANS["full"], device="cpu", gpu_budget=min_budget_bytes(LAYERS, TOP_K),
                           config=RuntimeConfig(serving="cpu_only", cost=COST))

    def broken(*_, **__):
        raise RuntimeError("cpu kernel failed")

    runtime._cpu.kernel = broken
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


def test_cpu_experts_config_checks_and_stats():
    assert CpuExpertsConfig("bf16", "eager", 2) == CpuExpertsConfig(Precision.BF16, CpuPrepare.EAGER, 2)
    with pytest.raises(ValueError, match="precision 'fp32' runs the exact path"):
        CpuExpertsConfig(precision="fp32")
    with pytest.raises(ValueError, match="CpuExpertsConfig.prepare: expected one of"):
        CpuExpertsConfig(prepare="sometimes")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="CpuExpertsConfig.threads"):
            CpuExpertsConfig(threads=bad)
    with pytest.raises(TypeError, match="RuntimeConfig.cpu_experts"):
        RuntimeConfig(cpu_experts={"precision": "bf16"})
    # a GPU placement reports no CPU experts and builds no copy, even when told to build them eagerly
    gpu = CrispRuntime(LAYERS, PLANS["full"], device="cpu", gpu_budget=min_budget_bytes(LAYERS, TOP_K),
                       config=RuntimeConfig(cpu_experts=CpuExpertsConfig(prepare="eager")))
    assert gpu.cpu_stats() is None and not gpu._cpu._prepared
    eager = CrispRuntime(WIDE, _plans(WIDE_INTER)["full"], device="cpu", gpu_budget=min_budget_bytes(WIDE, TOP_K),
                         config=RuntimeConfig(serving="cpu_only", cost=COST,
                                              cpu_experts=CpuExpertsConfig(prepare="eager", threads=1,
                                                                           kernel="torch")))
    info = eager.cpu_stats()["experts"]
    host = sum(layer.nbytes() for layer in WIDE.values())
    assert info["prepared_experts"] == len(LAYER_IDS) * E and info["host_expert_bytes"] == host
    # the int4pack copy of the 128 blocked neurons (of 160) costs about as much as the format's rows of them
    assert 0.5 < info["prepared_bytes"] / (host * 128 / 160) < 1.5
    # the default precision (q8) on the torch kernel: int4pack's bf16 arithmetic, held to q8's looser contract
    assert info == {**info, "precision": "q8", "prepare": "eager", "impl": "int4pack-bf16", "worker_threads": 1,
                    "tolerance": 2.0**-5, "int4pack_unsupported": None, "kernel": "torch"}
    assert info["int4pack_block"] in (32, 64, 128) and info["native_vector_bits"] is None
    assert not eager._cpu.started  # built here, before any job: no thread yet
    # the default kernel: the native one on the host rows, no copy even when told to build them eagerly
    native = CrispRuntime(WIDE, _plans(WIDE_INTER)["full"], device="cpu", gpu_budget=min_budget_bytes(WIDE, TOP_K),
                          config=RuntimeConfig(serving="cpu_only", cost=COST,
                                               cpu_experts=CpuExpertsConfig(prepare="eager", threads=1)))
    info = native.cpu_stats()["experts"]
    assert info["impl"] == "native-q8" and info["kernel"] == "auto" and info["prepared_experts"] == 0
    assert info["native_vector_bits"] in (0, 256, 512)
    with pytest.raises(ValueError, match="CpuExpertsConfig.kernel: expected one of"):
        CpuExpertsConfig(kernel="fast")


def _rows_reference(x, expert_deq, rows, weights, token_widths):
    """(T, H) float64: weights[i] * expert(x[rows[i]]) at token_widths[i] neurons, in rows[i]."""
    gate, up, down = expert_deq
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for r, w, k in zip(rows.tolist(), weights.tolist(), token_widths.tolist(), strict=True):
        xt = x[r].double()
        ref[r] = w * (down[:, :k] @ (torch.nn.functional.silu(gate[:k] @ xt) * (up[:k] @ xt)))
    return ref


def test_an_unsliceable_int4pack_layout_falls_back_to_the_exact_path(monkeypatch):
    """Where the probe finds no layout the fast path can slice (another torch build or CPU), the CPU
    experts run on the exact fp32 path, with a warning and in stats, and still equal the reference."""
    import crisp_runtime.cpu.experts as cpu_experts
    from crisp_kernels.cpu_expert import Int4PackUnsupported

    def unsupported():
        raise Int4PackUnsupported("no row block")

    monkeypatch.setattr(cpu_experts, "int4pack_layout", unsupported)
    with pytest.warns(RuntimeWarning, match="exact fp32 path"):
        cpu = cpu_experts.CpuExperts(WIDE, CpuExpertsConfig(prepare="eager", kernel="torch"))
    info = cpu.info()
    assert info["impl"] == "dequant-fp32" and info["int4pack_unsupported"] == "no row block"
    assert info["int4pack_block"] is None and info["prepared_experts"] == 0
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, WIDE_HIDDEN, generator=g)
    rows, weights = torch.tensor([0, 2]), torch.tensor([0.7, 0.4])
    token_widths = torch.tensor([WIDE_INTER, 70])
    part = torch.zeros(x.shape)
    cpu.accumulate_(part, x, 1, 3, WIDE_INTER, rows, weights, token_widths)
    ref = _rows_reference(x, WIDE_DEQ[1][3], rows, weights, token_widths)
    assert rel_err(part, ref) < 1e-5  # the exact path, whatever precision was asked for


def test_without_the_native_kernel_auto_takes_torchs_and_native_is_refused(monkeypatch):
    """kernel='auto' where the C kernel cannot build (no compiler): torch's int4pack path, with a warning
    saying why; kernel='native' refuses to start. Outputs still equal the reference (bf16 contract)."""
    import crisp_runtime.cpu.experts as cpu_experts
    from crisp_kernels import cpu_native

    def unavailable():
        raise cpu_native.NativeUnavailable("no C compiler found")

    monkeypatch.setattr(cpu_native, "load", unavailable)
    monkeypatch.setattr(cpu_native, "available", lambda: False)
    with pytest.warns(RuntimeWarning, match="torch's kernels .int4pack-bf16.: no C compiler"):
        cpu = cpu_experts.CpuExperts(WIDE, CpuExpertsConfig())
    assert cpu.info()["impl"] == "int4pack-bf16" and cpu.info()["kernel"] == "auto"
    with pytest.raises(ValueError, match="kernel='native'.*no C compiler"):
        cpu_experts.CpuExperts(WIDE, CpuExpertsConfig(kernel="native"))
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, WIDE_HIDDEN, generator=g)
    rows, weights, token_widths = torch.tensor([0, 1]), torch.tensor([0.6, 0.3]), torch.tensor([WIDE_INTER, 90])
    part = torch.zeros(x.shape)
    cpu.accumulate_(part, x, 2, 4, WIDE_INTER, rows, weights, token_widths)
    ref = _rows_reference(x, WIDE_DEQ[2][4], rows, weights, token_widths)
    assert rel_err(part, ref) <= TOLERANCE[Precision.BF16]
    assert cpu.info()["prepared_experts"] == 1  # the int4pack copy, built for the expert it ran


# ---------------------------------------------------------------------- the neuron split (Placement.SPLIT)


def reference_rows(layer_id, x, index, weights, widths, deq, expert, lo, hi):
    """(T, H) float64 contribution of ``expert``'s neurons lo <= j < min(hi, slot width)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(index.shape[1]):
            e, w = int(index[t, s]), min(int(widths[t, s]), hi)
            if e != expert or w <= lo:
                continue
            gate, up, down = deq[layer_id][e]
            xt = x[t].double()
            out[t] += float(weights[t, s]) * (down[:, lo:w] @ (torch.nn.functional.silu(gate[lo:w] @ xt)
                                                                * (up[lo:w] @ xt)))
    return out


# A CPU about as fast as the copy: split_rows puts a missed expert's rows [s, width) on the CPU (s a multiple of 64)
SPLIT_COST = CostModel(h2d_bytes_per_s=2e6, device_bytes_per_s=4e8, cpu_bytes_per_s=5e6, h2d_bytes_per_s_cpu_busy=2e6,
                       join_s=1e-5)


@pytest.mark.parametrize("cpu", ["exact", "native", "bf16-lazy"])
@pytest.mark.parametrize("plan_name", ["full", "uniform"])
def test_split_outputs_equal_unsplit(plan_name, cpu):
    """hybrid_split: a split expert's GPU prefix (device cache, at split_at) + its CPU rows [split_at, width) (the
    worker) sum to the unsplit expert: equal to the GPU placement's output (fp32: within 1e-5) and to the float64
    reference within each part's tolerance (GPU 1e-5, CPU the precision contract) times that part's norm."""
    plan = _plans(WIDE_INTER)[plan_name]
    nb = WIDE[1].fmt.neuron_nbytes(WIDE_HIDDEN)
    budget = min_budget_bytes(WIDE, TOP_K) + 3 * WIDE_INTER * nb
    config = CPU_CONFIGS[cpu]
    cpu_tol = TOLERANCE[config.precision]
    split = CrispRuntime(WIDE, plan, device="cpu", gpu_budget=budget,
                         config=RuntimeConfig(serving="hybrid_split", cost=SPLIT_COST, cpu_experts=config))
    whole = CrispRuntime(WIDE, plan, device="cpu", gpu_budget=budget)
    from crisp_bench.e2e import StepCheck

    check = StepCheck(split)  # crisp-bench e2e's per-step check, on split steps (it bounds each side's rows)
    splits = 0
    for i, tokens in enumerate([1, 1, 2, 1, 3, 1, 9, 1]):
        layer_id = LAYER_IDS[i % 2]
        x, index, weights = make_step(tokens, 40 + i, WIDE_HIDDEN)
        before = split.cache.resident()
        out = split.forward(layer_id, x, index, weights)
        unsplit = whole.forward(layer_id, x, index, weights)
        step, served = split.last_step[layer_id], split.last_served[layer_id]
        after = split.cache.resident()
        bound, ref = 0.0, torch.zeros(x.shape, dtype=torch.float64)
        for t in step.tasks:
            key = (layer_id, t.expert)
            cut = t.gpu_width  # rows [0, cut) on the GPU side, [cut, width) on the CPU
            for lo, hi, tol in ((0, cut, 1e-5), (cut, t.width, cpu_tol)):
                if hi > lo:
                    part = reference_rows(layer_id, x, index, weights, served.widths, WIDE_DEQ, t.expert, lo, hi)
                    ref += part
                    bound += tol * float(part.norm())
            if t.split_at is not None:
                splits += 1
                assert 0 < t.split_at < t.width and t.split_at % 64 == 0
                assert after[key] >= t.split_at  # the prefix the GPU computed is resident (at least s wide)
                assert t.copy_bytes == max(0, t.split_at - before.get(key, 0)) * nb  # only rows below s copied
        assert float((out.double() - ref).norm()) <= bound
        if config.precision is Precision.FP32:
            assert rel_err(out, unsplit.double()) < 1e-5
        assert split.cache.used <= budget
    stats = split.stats.as_dict()
    assert splits > 0 and stats["cpu_splits"] == splits
    check.close()
    assert check.steps == 8 and check.record()["within_tolerance"], check.worst
    split.close()


@pytest.mark.parametrize("cut", [1, 36, 64, 71])
def test_split_parts_of_a_biased_expert_sum_to_it(cut):
    """gpt-oss (biases, clamped SwiGLU: the torch reference path): rows [0, cut) with the down bias + rows
    [cut, width) without it == the whole expert, per-token widths included (fp32 on both sides: 1e-5)."""
    from test_gptoss_kernels import gpt_oss_layer

    from crisp_runtime.cpu.experts import CpuExperts

    _, layer = gpt_oss_layer(seed=3)
    cpu = CpuExperts({0: layer}, CpuExpertsConfig())
    width = layer.intermediate_size
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, layer.hidden_size, generator=g) * 3
    rows = torch.tensor([0, 2, 3, 4])
    weights = torch.rand(4, generator=g) + 0.1
    token_widths = torch.tensor([width, cut, max(1, cut - 1), width - 3])
    whole, parts = torch.zeros(x.shape), torch.zeros(x.shape)
    cpu.accumulate_(whole, x, 0, 1, width, rows, weights, token_widths)
    cpu.accumulate_(parts, x, 0, 1, cut, rows, weights, token_widths)  # the prefix: what the GPU side computes
    cpu.accumulate_(parts, x, 0, 1, width, rows, weights, token_widths, cut)
    assert rel_err(parts, whole.double()) < 1e-5
    assert cpu.info()["prepared_experts"] == 0  # not covered by the int4pack kernel: no copy built


@pytest.mark.parametrize("cpu", sorted(CPU_CONFIGS))
@pytest.mark.parametrize("row, start", [(0, 0), (2, 0), (2, 37)])
def test_a_single_slot_adds_into_its_row_in_place(cpu, row, start):
    """One slot (batch-1 decode) takes the in-place path: the kernel adds into partial's row, the other rows
    stay bitwise as they were, and the row gains the reference's contribution (rows [start, width) of the
    expert) within the CPU's precision contract."""
    from crisp_runtime.cpu.experts import CpuExperts

    config = CPU_CONFIGS[cpu]
    experts = CpuExperts(WIDE, config)
    g = torch.Generator().manual_seed(11 + row + start)
    x = torch.randn(4, WIDE_HIDDEN, generator=g)
    before = torch.randn(x.shape, generator=g)
    partial = before.clone()
    rows, weights, token_widths = torch.tensor([row]), torch.tensor([0.6]), torch.tensor([WIDE_INTER - 9])
    experts.accumulate_(partial, x, 2, 4, WIDE_INTER, rows, weights, token_widths, start)
    others = [r for r in range(4) if r != row]
    assert torch.equal(partial[others], before[others])
    ref = _rows_reference(x, WIDE_DEQ[2][4], rows, weights, token_widths)
    if start:
        ref -= _rows_reference(x, WIDE_DEQ[2][4], rows, weights, torch.tensor([start]))
    got = (partial - before).double()
    assert rel_err(got, ref) < TOLERANCE[config.precision]
    experts.close()


@pytest.mark.parametrize("precision", ["q8", "bf16"])
def test_one_token_steps_bind_each_experts_rows_once_and_equal_the_tensor_path(precision):
    """A one-token cpu_only step on the native kernel calls each expert through its rows bound once
    (``CpuExperts.bound``) and adds into the step's accumulator; its output is bitwise the tensor path's
    (``_cpu_job``: the same kernel calls on a partial, then added to zeros)."""
    config = CpuExpertsConfig(precision=precision, kernel="native")
    runtime = CrispRuntime(WIDE, _plans(WIDE_INTER)["uniform"], device="cpu", gpu_budget=min_budget_bytes(WIDE, TOP_K),
                           config=RuntimeConfig(serving="cpu_only", cost=COST, cpu_experts=config))
    for i in range(4):
        layer_id = LAYER_IDS[i % 2]
        x, index, weights = make_step(1, 300 + i, WIDE_HIDDEN)
        out = runtime.forward(layer_id, x, index, weights)
        step = runtime.last_step[layer_id]
        tensor_path = runtime._cpu_job(layer_id, step, x, weights, list(step.tasks), runtime.stats.layers[layer_id])
        assert torch.equal(out, tensor_path(torch.get_num_threads()))  # the threads run_here gave
        assert all(runtime._cpu._bound[(layer_id, t.expert)][1] is not None for t in step.tasks)
    bound = runtime._cpu.bound(LAYER_IDS[0], 0)
    assert bound is runtime._cpu.bound(LAYER_IDS[0], 0)  # kept
    runtime.close()


def test_bound_rows_follow_a_replaced_layer_and_check_their_calls():
    """The bound rows are rebound for a layer replaced in the layers dict, a swapped-in kernel is called instead
    of them, and a call with a bad token tensor, slot or row range raises before the C code runs (out
    unchanged)."""
    from crisp_runtime.cpu.experts import CpuExperts

    experts = CpuExperts(dict(WIDE), CpuExpertsConfig(precision="bf16", kernel="native"))  # fp32 arithmetic
    g = torch.Generator().manual_seed(14)
    x, weights = torch.randn(1, WIDE_HIDDEN, generator=g), torch.tensor([0.3, 0.7])
    first = torch.zeros(x.shape)
    experts.accumulate_token_(first, x, 1, 0, 0, WIDE_INTER, weights, 1)
    rows, widths = torch.tensor([0]), torch.tensor([WIDE_INTER])
    assert rel_err(first, _rows_reference(x, WIDE_DEQ[1][0], rows, weights[1:], widths)) < 1e-5
    other = random_layers(layer_ids=(1,), num_experts=E, inter=WIDE_INTER, hidden=WIDE_HIDDEN, seed=15)[1]
    experts.layers[1] = other
    second = torch.zeros(x.shape)
    experts.accumulate_token_(second, x, 1, 0, 3, 50, weights, 0)  # rows [3, 50) of the new layer's expert
    ref = (_rows_reference(x, dequantize_expert(other.expert(0), dtype=torch.float64), rows, weights[:1],
                           torch.tensor([50]))
           - _rows_reference(x, dequantize_expert(other.expert(0), dtype=torch.float64), rows, weights[:1],
                             torch.tensor([3])))
    assert rel_err(second, ref) < 1e-5
    bound = experts.bound(1, 0)
    keep = second.clone()
    bad_calls = {"x": (torch.randn(1, WIDE_HIDDEN + 2), weights, 0, second, 0, 5),
                 "out": (x, weights, 0, torch.zeros(1, WIDE_HIDDEN, dtype=torch.float64), 0, 5),
                 "weights": (x, weights.double(), 0, second, 0, 5),
                 "element 2": (x, weights, 2, second, 0, 5),
                 "row_stop": (x, weights, 0, second, 6, 5),
                 f"<= {WIDE_INTER}": (x, weights, 0, second, 0, WIDE_INTER + 1)}
    for match, args in bad_calls.items():
        with pytest.raises(ValueError, match=match):
            bound.one_token_(*args, threads=1)
    assert torch.equal(second, keep)
    calls = []
    experts.kernel = lambda *a, **k: calls.append(k)  # a swapped kernel: no bound rows, the tensor path's call
    assert experts.bound(1, 1) is None
    experts.accumulate_token_(second, x, 1, 1, 0, 9, weights, 0)
    assert len(calls) == 1 and torch.equal(second, keep)
    experts.close()


def test_the_kept_expert_views_follow_a_replaced_layer():
    """CpuExperts keeps each expert's view of its host rows; a layer replaced in its layers dict (another
    tensor) is read afresh, not through the old view."""
    from crisp_runtime.cpu.experts import CpuExperts

    experts = CpuExperts(dict(WIDE), CpuExpertsConfig(precision="bf16", kernel="native"))  # fp32 arithmetic
    g = torch.Generator().manual_seed(12)
    x = torch.randn(1, WIDE_HIDDEN, generator=g)
    rows, weights, widths = torch.tensor([0]), torch.tensor([1.0]), torch.tensor([WIDE_INTER])
    first = torch.zeros(x.shape)
    experts.accumulate_(first, x, 1, 0, WIDE_INTER, rows, weights, widths)
    other = random_layers(layer_ids=(1,), num_experts=E, inter=WIDE_INTER, hidden=WIDE_HIDDEN, seed=13)[1]
    experts.layers[1] = other
    second = torch.zeros(x.shape)
    experts.accumulate_(second, x, 1, 0, WIDE_INTER, rows, weights, widths)
    ref = _rows_reference(x, dequantize_expert(other.expert(0), dtype=torch.float64), rows, weights, widths)
    assert rel_err(second, ref) < 1e-5 and not torch.allclose(first, second)
    experts.close()


def test_the_worker_handoff_is_measured_and_its_arguments_checked():
    """CpuWorker.handoff_s: an empty job's round trip, positive and far below a second; bad counts refused."""
    from crisp_runtime.cpu.experts import CpuWorker

    worker = CpuWorker(threads=1)
    try:
        assert 0 < worker.handoff_s(jobs=20, rounds=2) < 0.1
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="jobs"):
                worker.handoff_s(jobs=bad)
            with pytest.raises(ValueError, match="rounds"):
                worker.handoff_s(rounds=bad)
    finally:
        worker.close()
