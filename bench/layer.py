"""``crisp-bench layer``: MoE layer steps of the real runtime under load/compute orders and policies.

The routed experts of each step come from the model's routing on held-out text (decode
steps, every MoE layer in turn), their widths from each policy's plan, served by
``CrispRuntime`` itself (its residency ledger, prefix cache, scheduler and kernels) with the
GPU budget, in one of three orders (``RuntimeConfig.order`` / ``async_copies``):

    serial        copy an expert, compute it, then the next (synchronous path, nothing overlaps),
                  router order
    router        copies on the copy stream, each compute waiting on its own copy's event, in
                  router order
    widest_first  the same, in Johnson's order (cached first, then widest first): the default

Each step is timed wall-clock (device synchronised). Its flow-shop bound comes from the same
step's copies and computes timed one by one by the runtime itself (``record_timings`` on the
synchronous path). The breakdown (router, load, compute, share of load) is this machine's
version of the paper's motivating figure. On a CPU there is no copy engine: the three orders
cannot overlap anything and the copies are memcpy (said in the output).

:func:`measure_expert_overhead`: the CPU cost per expert call of the runtime around its kernels
(checks, planning, residency, dispatch), from steps whose experts are all resident, with the
kernel's arithmetic removed for the measurement.
"""

from __future__ import annotations

import statistics
import time

import torch
from crisp_tools.text import read_texts, sample_sequences

from crisp_runtime import RuntimeConfig
from crisp_runtime.execution.runtime import CrispRuntime
from crisp_runtime.hf.moe_layers import find_moe_layers
from crisp_runtime.scheduling.scheduler import TaskOrder, flow_shop_makespan, johnson_order

from . import common, report
from . import runtime as rt
from . import traces as tr
from .common import ORDERS, ModelInputError, bench_device, load_model_for_bench, sync
from .runtime import _random_packed
from .simulate import budget_for_fraction


def order_config(order: str, device, **kw) -> RuntimeConfig:
    """The runtime configuration of one of :data:`ORDERS`."""
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
    return RuntimeConfig(order=TaskOrder.JOHNSON if order == "widest_first" else TaskOrder.ROUTER,
                         async_copies=order != "serial", pin_memory=device.type == "cuda", **kw)


def replay_steps(runtime: CrispRuntime, steps, x, *, timed_from: int = 0) -> list[float]:
    """Run ``steps`` = [(layer id, top_k_index (1, k), top_k_weights (1, k))] through ``runtime``;
    wall seconds of each step from ``timed_from`` on (the device synchronised around each)."""
    dev = runtime.device
    times = []
    for n, (layer_id, index, weights) in enumerate(steps):
        sync(dev)
        t0 = time.perf_counter()
        runtime.forward(layer_id, x, index, weights)
        sync(dev)
        if n >= timed_from:
            times.append(time.perf_counter() - t0)
    return times


def add_parser(subparsers) -> None:
    """The ``crisp-bench layer`` subcommand's options."""
    p = subparsers.add_parser(
        "layer", help="one MoE layer step under load/compute orders and policies",
        description="One MoE layer step of the model under orders (serial, router, widest_first) "
        "and policies (full, uniform, skip_aux, crisp) at equal GPU memory, against the flow-shop "
        "bound, with the paper's breakdown (router, load, compute, share of load) for this machine.")
    common.add_model_args(p)
    p.add_argument("--budget", type=common.fraction, default=0.25, help="GPU budget, fraction of expert bytes")
    p.add_argument("--steps", type=common.positive_int, default=32, help="decode steps to time")
    p.add_argument("--policies", type=common.csv_choices(common.POLICIES), default=list(common.POLICIES))
    common.add_outputs(p)


def run(args) -> int:
    device = bench_device()
    model, pack_dir = load_model_for_bench(args.model, args.pack, need_pack=True, device=device)
    pack = common.load_pack_for_model(pack_dir, model)
    total = sum(layer.nbytes() for layer in pack.layers.values())
    budget = budget_for_fraction("--budget", args.budget, pack.layers, common.pack_top_k(pack), total)
    warm = 8
    try:
        seqs = sample_sequences(read_texts(args.text), 1, args.steps + warm, seed=2)
    except ValueError as exc:
        raise ModelInputError(str(exc)) from exc
    trace = tr.record_trace(model, seqs, source=str(args.text))
    crisp = pack.plan if pack.plan is not None and pack.plan.policy.value == "crisp" else None
    plans = {k: v for k, v in tr.policy_plans(trace, crisp).items() if k in args.policies}
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    hidden = next(iter(pack.layers.values())).hidden_size
    x = torch.randn(1, hidden, dtype=dtype).to(device)
    router_s = _router_time(model, device, hidden)
    # Decode steps in order, every MoE layer in turn; the first `warm` tokens fill the cache.
    steps = [(layer_id, torch.from_numpy(trace.index[li, t][None]).long(), torch.from_numpy(trace.weights[li, t][None]))
             for t in range(trace.num_tokens) for li, layer_id in enumerate(trace.layer_ids)]
    first = warm * trace.num_layers
    what = "GPU" if device.type == "cuda" else "CPU (no copy engine: orders cannot overlap; copies are memcpy)"
    print(f"layer: {args.model} on {what}; budget {args.budget:.0%} of {total / 1e6:.2f} MB; "
          f"{args.steps} decode steps x {trace.num_layers} MoE layers per policy and order (CrispRuntime)")
    records = []
    for name, plan in plans.items():
        # Each task's load and compute timed alone by the runtime (synchronous path), median of 3 passes.
        parts = []
        for _ in range(3):
            rt = CrispRuntime(pack.layers, plan, device=device, gpu_budget=budget,
                              config=order_config("serial", device, record_timings=True))
            one = []
            for n, (layer_id, index, weights) in enumerate(steps):
                rt.forward(layer_id, x, index, weights)
                if n >= first:
                    one.append(list(rt.last_timings.get(layer_id, [])) if rt.last_step[layer_id].tasks else [])
            parts.append(one)
        jobs = [[(statistics.median(p[i][j][0] for p in parts), statistics.median(p[i][j][1] for p in parts))
                 for j in range(len(parts[0][i]))] for i in range(len(parts[0]))]
        bounds = [_bound(js) for js in jobs]
        load = statistics.fmean(sum(lo for lo, _ in js) for js in jobs)
        comp = statistics.fmean(sum(co for _, co in js) for js in jobs)
        runtimes = {o: CrispRuntime(pack.layers, plan, device=device, gpu_budget=budget, config=order_config(o, device))
                    for o in ORDERS}
        prog = report.Progress(f"layer {name}")
        # Orders interleaved step by step (so drifting machine load hits all alike), median over steps.
        times: dict[str, list[float]] = {o: [] for o in ORDERS}
        for n, step in enumerate(steps):
            for order, rt in runtimes.items():
                t = replay_steps(rt, [step], x)[0]
                if n >= first:
                    times[order].append(t)
            prog(n + 1, len(steps))
        bound_med = statistics.median(bounds)
        for order, rt in runtimes.items():
            st = rt.stats.as_dict()
            step_s = statistics.median(times[order])
            lookups = st["hits"] + st["misses"] + st["widenings"]
            records.append({"policy": name, "order": order, "step_ms": 1e3 * step_s,
                            "step_mean_ms": 1e3 * statistics.fmean(times[order]), "bound_ms": 1e3 * bound_med,
                            "bound_mean_ms": 1e3 * statistics.fmean(bounds),
                            "over_bound": step_s / bound_med if bound_med > 0 else None, "load_ms": 1e3 * load,
                            "compute_ms": 1e3 * comp, "router_ms": 1e3 * router_s,
                            "load_share": load / (load + comp + router_s) if load + comp + router_s > 0 else 0.0,
                            "bytes_per_step": st["bytes_h2d"] / max(1, len(steps)),
                            "hit_rate": st["hits"] / max(1, lookups), "steps": len(steps) - first,
                            "device": str(device), "budget_fraction": args.budget})
    cols = [("policy", "policy"), ("order", "order"), ("step_ms", "step ms (median)"),
            ("bound_ms", "flow-shop bound ms (median)"),
            ("over_bound", "step/bound"), ("router_ms", "router ms"), ("load_ms", "load ms"),
            ("compute_ms", "compute ms"), ("load_share", "load share"), ("hit_rate", "hit rate")]
    print(report.table(records, cols))
    print("paper (RTX 4090, Mixtral, full width): 14.4 ms layer = router 0.4 + load 11.2 + compute 2.6; load share 78%")
    overhead = measure_expert_overhead(num_experts=trace.num_experts, top_ks=(1, trace.num_experts))
    hi = trace.num_experts
    print(f"runtime overhead per expert call (CPU, all experts resident, kernel arithmetic removed, "
          f"E={hi} top-{hi}): {overhead['per_expert_us']:.1f} us, planner excluded (target < 5 us; median over "
          f"blocks {overhead['per_expert_us_median']:.1f} us; step {overhead[f'step_us_top{hi}']:.1f} us, planner "
          f"{overhead[f'planner_us_top{hi}']:.1f} us); {overhead['marginal_us']:.1f} us per extra expert; "
          f"{overhead['threads']} torch thread(s), load average {overhead['load_average'][0]:.2f} -> "
          f"{overhead['load_average'][1]:.2f}")
    runtime_records = _runtime_measurements(trace, device, hidden)
    if args.plot:
        groups: dict = {}
        for r in records:
            groups.setdefault(r["policy"], {})[r["order"]] = r["step_ms"]
        report.plot_bars(args.plot, groups, ylabel="ms per MoE layer step",
                         title=f"layer step per policy and order ({device})", note=report.environment()["date"])
        print(f"wrote {args.plot}")
    if args.json:
        report.write_json(args.json, "layer", records, model=str(args.model), runtime=runtime_records,
                          overhead=overhead)
        print(f"wrote {args.json}")
    return 0


def _bound(jobs: list[tuple[float, float]]) -> float:
    """The two-stage flow-shop optimum (Johnson's order) of one step's (load s, compute s) jobs."""
    load = [lo for lo, _ in jobs]
    compute = [co for _, co in jobs]
    return flow_shop_makespan(johnson_order(load, compute), load, compute)


def measure_expert_overhead(*, num_experts: int = 8, top_ks=(1, 8), hidden: int = 64, inter: int = 16,
                            iters: int = 200, blocks: int = 15, seed: int = 0) -> dict:
    """CPU microseconds that ``CrispRuntime.forward`` spends around its kernels, per expert call.

    Decode steps (one token, all experts resident) on a CPU with the torch kernel's arithmetic
    replaced by no-ops for the measurement (``expert_mlp_accumulate_ref_``, one expert, and
    ``experts_mlp_accumulate_ref_``, a step's experts through the grouped entry), so that what
    is timed is the runtime's own work: checks, planning, residency lookups, dispatch and the
    kernel entry. For each top-k in ``top_ks``: the step and the planner alone; medians per block
    of ``iters`` steps, the lowest block kept (a shared machine only ever adds time), and the
    median over blocks beside it (``*_median``). ``per_expert_us`` = (step - planner) / k at the
    largest k; ``marginal_us`` = the slope of the step time from the smallest to the largest k.
    ``load_average``: the 1-minute load average before and after (the VM is shared).
    """
    import os
    import sys
    from unittest import mock

    from crisp_runtime import CrispPlan

    layer = _random_packed(num_experts, inter, hidden, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, hidden, generator=g)
    out = {"num_experts": num_experts, "hidden": hidden, "inter": inter, "threads": torch.get_num_threads()}
    load_before = os.getloadavg()[0]
    kernels = sys.modules["crisp_kernels.expert_mlp"]
    no_op = lambda *a, **k: None  # noqa: E731
    with (mock.patch.object(kernels, "expert_mlp_accumulate_ref_", no_op),
          mock.patch.object(kernels, "experts_mlp_accumulate_ref_", no_op)):
        for k in top_ks:
            rt = CrispRuntime({0: layer}, CrispPlan.full(num_experts, k, inter, [0]), device="cpu",
                              gpu_budget=layer.nbytes())
            index = torch.randperm(num_experts, generator=g)[:k][None]
            weights = torch.softmax(torch.randn(1, k, generator=g), -1)
            medians: dict[str, list[float]] = {"step": [], "planner": []}
            for _ in range(blocks):
                for name, fn in (("step", lambda rt=rt, i=index, w=weights: rt.forward(0, x, i, w)),
                                 ("planner", lambda rt=rt, i=index, w=weights: rt.plan_served(0, i, w))):
                    ts = []
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        fn()
                        ts.append(time.perf_counter() - t0)
                    medians[name].append(statistics.median(ts))
            for name in ("step", "planner"):
                out[f"{name}_us_top{k}"] = 1e6 * min(medians[name])
                out[f"{name}_us_top{k}_median"] = 1e6 * statistics.median(medians[name])
    lo, hi = min(top_ks), max(top_ks)
    out["per_expert_us"] = (out[f"step_us_top{hi}"] - out[f"planner_us_top{hi}"]) / hi
    out["per_expert_us_median"] = (out[f"step_us_top{hi}_median"] - out[f"planner_us_top{hi}_median"]) / hi
    out["load_average"] = [load_before, os.getloadavg()[0]]
    out["marginal_us"] = (out[f"step_us_top{hi}"] - out[f"step_us_top{lo}"]) / (hi - lo) if hi > lo else None
    out["top_ks"] = list(top_ks)
    return out


@torch.no_grad()
def _router_time(model, device, hidden) -> float:
    """Seconds of one MoE block's router (gate) on one token."""
    ref = find_moe_layers(model)[0]
    parent = model.get_submodule(ref.name.rsplit(".", 1)[0])
    gate = getattr(parent, "gate", None) or getattr(parent, "router", None)
    if gate is None:
        return 0.0
    x = torch.randn(1, hidden, device=device)
    times = []
    for _ in range(20):
        sync(device)
        t0 = time.perf_counter()
        gate(x)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[5:])


def _runtime_measurements(trace, device, hidden) -> list[dict]:
    """The runtime engineer's measurements (``crisp_bench.runtime``): the planner's CPU time per layer step,
    and on a GPU one runtime layer step (async copy stream) against the flow-shop bound."""
    out = []
    recs = rt.measure_planner_overhead(configs=((trace.num_experts, trace.top_k),), iters=300, warmup=30)
    for r in recs:
        print(f"runtime planner (CrispRuntime.plan_served), E={r['num_experts']} top-{r['top_k']} {r['policy']}, "
              f"serving {r['serving']}: "
              f"p50 {r['planner_us_p50']:.1f} us per layer step (target <= {r['target_us']:.0f} us)")
    out += [dict(r, kind="planner") for r in recs]
    if device.type == "cuda":
        inter = trace.intermediate_size
        recs = rt.measure_layer_step(hidden=hidden, intermediate=inter, num_experts=trace.num_experts,
                                     top_k=trace.top_k, iters=5)
        recs += rt.measure_layer_step(iters=5)  # Mixtral-8x7B shapes
        print(report.table(recs, [(k, k) for k in recs[0]], title="runtime layer step vs flow-shop bound (GPU)"))
        out += [dict(r, kind="layer_step") for r in recs]
    return out
