"""The hot path before and after, in ONE process (docs/hot-path.md).

``before``: another checkout's ``crisp_runtime`` copied as a package named ``crisp_runtime_base`` into
DIR (it imports only itself and ``crisp_kernels``); ``after``: this checkout's ``crisp_runtime``. Both
are timed in interleaved blocks (median per block of steps), so the load of a shared machine hits
both alike; printed: (lowest block, median over blocks) in microseconds.

    mkdir -p /tmp/hp && git archive 29694fc crisp_runtime | tar -x -C /tmp/hp
    mv /tmp/hp/crisp_runtime /tmp/hp/crisp_runtime_base
    OMP_NUM_THREADS=1 python docs/hot-path-ab.py /tmp/hp 20

(session 4 compared against 91bbacf the same way). Both versions use this checkout's ``crisp_kernels``.

Planner: ``CrispRuntime.plan_served`` per layer step as ``crisp_bench.runtime.measure_planner_overhead``
(crisp plan, one token, half the experts resident, fresh routing per step). Per expert call: as
``crisp_bench.layer.measure_expert_overhead`` (all experts resident, the torch kernels' arithmetic
replaced by no-ops: ``expert_mlp_accumulate_ref_`` and the grouped ``experts_mlp_accumulate_ref_``;
(step - planner) / 8 at top-8).

The breakdown times the after-version's parts alone, and the planner's slowdown when any other code
runs between its calls (``planner + 6 us of arithmetic``: a Python loop that allocates nothing), the
part of "step - planner" that no change to the executor removes.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)

import crisp_runtime_base as before_rt  # noqa: E402
from crisp_bench.runtime import _crisp_plan, _random_packed  # noqa: E402

import crisp_kernels.expert_mlp  # noqa: E402,F401
import crisp_runtime as after_rt  # noqa: E402

KERNELS = sys.modules["crisp_kernels.expert_mlp"]  # the attribute crisp_kernels.expert_mlp is a function
VERSIONS = (("before", before_rt), ("after", after_rt))
INTER, HIDDEN = 16, 64


def crisp_plan(mod, num_experts: int, top_k: int):
    """``crisp_bench.runtime._crisp_plan`` rebuilt from ``mod``'s classes."""
    lp = _crisp_plan(num_experts, top_k, INTER, [0]).layers[0]
    tiers = {pair: mod.Tier(t.value) for pair, t in lp.tiers.items()}
    return mod.CrispPlan.crisp(num_experts, top_k, INTER, {0: mod.LayerPlan(tiers, dict(lp.dominant))},
                               mod.TierWidths(INTER, INTER // 2, 0))


def block(fn, iters: int) -> float:
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1000


def interleaved(fns: dict, blocks: int, iters: int) -> dict:
    medians = {key: [] for key in fns}
    for _ in range(blocks):
        for key, fn in fns.items():
            medians[key].append(block(fn, iters))
    return medians


def planner_fn(mod, layer, num_experts: int, top_k: int, serving: str):
    nb = layer.fmt.neuron_nbytes(HIDDEN)
    budget = max(mod.min_budget_bytes({0: layer}, top_k), num_experts // 2 * INTER * nb)
    rt = mod.CrispRuntime({0: layer}, crisp_plan(mod, num_experts, top_k), device="cpu", gpu_budget=budget,
                          config=mod.RuntimeConfig(serving=serving))
    for e in range(0, num_experts, 2):  # half the experts resident, some narrowed
        rt.cache.acquire(0, e, INTER if e % 4 == 0 else INTER // 2)
    g = torch.Generator().manual_seed(0)
    weights, index = torch.softmax(torch.randn(64, 1, num_experts, generator=g), -1).topk(top_k, -1)
    steps = [(index[i], weights[i]) for i in range(64)]
    count = [0]

    def one():
        i, w = steps[count[0] % 64]
        count[0] += 1
        rt.plan_served(0, i, w)

    return one


def breakdown(layer, x, blocks: int) -> dict:
    """Where the after-version's top-8 step goes (kernel arithmetic removed by the caller): its parts
    timed alone, interleaved (private methods of CrispRuntime: a measurement, not an API)."""
    from crisp_kernels.expert_mlp import Backend, expert_mlp_accumulate_unchecked_, experts_mlp_accumulate_unchecked_

    num_experts, top_k = 8, 8
    g = torch.Generator().manual_seed(1)
    index = torch.randperm(num_experts, generator=g)[:top_k][None]
    weights = torch.softmax(torch.randn(1, top_k, generator=g), -1)
    rt = after_rt.CrispRuntime({0: layer}, after_rt.CrispPlan.full(num_experts, top_k, INTER, [0]), device="cpu",
                               gpu_budget=layer.nbytes())
    rt.forward(0, x, index, weights)
    served, step = rt.plan_served(0, index, weights)
    stats = rt.stats.layers[0]
    out = torch.zeros(1, HIDDEN)
    cache = rt.cache
    resident = cache.acquire(0, step.tasks[0].expert, INTER).resident
    one_weight = weights[0, :1]

    def acquire_all():
        for task in step.tasks:
            cache.acquire(0, task.expert, task.width, protected=(), transient_room=0)

    def kernel_all():
        for task in step.tasks:
            expert_mlp_accumulate_unchecked_(out, x, resident, task.width, rt._zero_row, one_weight, None,
                                             Backend.TORCH)

    experts = [t.expert for t in step.tasks]
    widths = [t.width for t in step.tasks]
    inputs = rt._task_inputs(step, step.tasks, weights, True)
    residents = cache.acquire_resident(0, experts, widths)[0]
    served_step = (served, step)
    cached = after_rt.CrispRuntime({0: layer}, after_rt.CrispPlan.full(num_experts, top_k, INTER, [0]),
                                   device="cpu", gpu_budget=layer.nbytes())
    cached.forward(0, x, index, weights)
    cached.plan_served = lambda *a: served_step  # the executor alone: the planner's result reused

    def burn():  # ~6 us of Python arithmetic, nothing allocated, no torch
        total = 0
        for i in range(150):
            total += i

    fns = {
        "part: forward (whole step)": lambda: rt.forward(0, x, index, weights),
        "part: planner (plan_served)": lambda: rt.plan_served(0, index, weights),
        "part: boundary checks (_check_step)": lambda: rt._check_step(0, x, index, weights),
        "part: float32 accumulator (_accumulator)": lambda: rt._accumulator(x),
        "part: executor, 8 tasks (_run_gpu)": lambda: rt._run_gpu(0, step, x, weights, out, stats, step.tasks, True),
        "part:   of which kernel inputs (_task_inputs)": lambda: rt._task_inputs(step, step.tasks, weights, True),
        "part:   of which 8 x PrefixCache.acquire (hits)": acquire_all,
        "part:   of which 8 x unchecked kernel entry": kernel_all,
        "part:   of which PrefixCache.acquire_resident (8 hits)": lambda: cache.acquire_resident(0, experts, widths),
        "part:   of which the grouped kernel entry (8 experts)": lambda: experts_mlp_accumulate_unchecked_(
            out, x, residents, widths, *inputs, Backend.TORCH),
        "part: forward with the planner's result reused (executor only)": lambda: cached.forward(0, x, index, weights),
        "part: 6 us of arithmetic alone": burn,
        "part: planner + 6 us of arithmetic": lambda: (rt.plan_served(0, index, weights), burn()),
    }
    return {key: (min(meds), statistics.median(meds)) for key, meds in interleaved(fns, blocks, 200).items()}


def main() -> None:
    blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    loads = [os.getloadavg()[0]]
    out = {}
    for num_experts, top_k in ((8, 2), (64, 6)):
        layer = _random_packed(num_experts, INTER, HIDDEN)
        for serving in ("plan", "resident-floor75"):
            fns = {name: planner_fn(mod, layer, num_experts, top_k, serving) for name, mod in VERSIONS}
            for name, meds in interleaved(fns, blocks, 300).items():
                out[f"planner E{num_experts} top-{top_k} {serving}, {name}"] = (min(meds), statistics.median(meds))
    num_experts = 8
    layer = _random_packed(num_experts, INTER, HIDDEN)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, HIDDEN, generator=g)
    no_op = lambda *a, **k: None  # noqa: E731
    with (mock.patch.object(KERNELS, "expert_mlp_accumulate_ref_", no_op),
          mock.patch.object(KERNELS, "experts_mlp_accumulate_ref_", no_op)):
        fns = {}
        for top_k in (1, 8):
            index = torch.randperm(num_experts, generator=g)[:top_k][None]
            weights = torch.softmax(torch.randn(1, top_k, generator=g), -1)
            for name, mod in VERSIONS:
                rt = mod.CrispRuntime({0: layer}, mod.CrispPlan.full(num_experts, top_k, INTER, [0]), device="cpu",
                                      gpu_budget=layer.nbytes())
                fns[("step", top_k, name)] = lambda rt=rt, i=index, w=weights: rt.forward(0, x, i, w)
                fns[("planner", top_k, name)] = lambda rt=rt, i=index, w=weights: rt.plan_served(0, i, w)
        meds = interleaved(fns, blocks, 200)
        parts = breakdown(layer, x, blocks)
    for name, _ in VERSIONS:
        for key in (("step", 8, name), ("planner", 8, name), ("step", 1, name)):
            out[f"{key[0]} top-{key[1]} (all resident, no arithmetic), {name}"] = (min(meds[key]),
                                                                                  statistics.median(meds[key]))
        lo = (min(meds[("step", 8, name)]) - min(meds[("planner", 8, name)])) / 8
        med = (statistics.median(meds[("step", 8, name)]) - statistics.median(meds[("planner", 8, name)])) / 8
        out[f"per expert call, planner excluded, {name}"] = (lo, med)
    out.update(parts)
    loads.append(os.getloadavg()[0])
    for key, (lo, med) in out.items():
        print(f"{key:64s} {lo:7.1f} {med:7.1f}")
    print(f"1-minute load average at start / end: {loads[0]:.2f} / {loads[1]:.2f}; torch threads "
          f"{torch.get_num_threads()}; {blocks} blocks")


if __name__ == "__main__":
    main()
