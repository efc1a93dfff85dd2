"""Runtime benchmarks: planner overhead (CPU), prefix H2D copies and a layer step against the flow-shop bound (GPU).

Functions return lists of JSON-friendly dicts (one per configuration) for ``crisp-bench``;
``python -m crisp_bench.runtime`` prints the planner overhead.

- :func:`measure_planner_overhead`: per MoE layer per decode step, the CPU time from the
  router's ``top_k_index``/``top_k_weights`` to the ordered step plan (plan lookup of the
  widths and roles + serving + grouping + resident lookups + order), through ``CrispRuntime.plan_served``,
  the code path the runtime runs. Target: <= 100 us.
- :func:`measure_transfer` (GPU-only): host-to-device copies of width-k prefixes through the
  prefix cache, GB/s against a plain pinned copy of the same bytes and of one large buffer.
- :func:`measure_layer_step` (GPU-only): one layer step from a cold cache, async (copy stream)
  and sync, against the two-stage flow-shop bound from the measured load and compute times of
  each expert; checks the async output equals the sync one (to within the output's rounding).
"""

from __future__ import annotations

import statistics
import time

import torch

from crisp_kernels import QuantFormat, pack_layer
from crisp_runtime import CrispPlan, RuntimeConfig, Tier, TierWidths
from crisp_runtime.execution.runtime import CrispRuntime, min_budget_bytes
from crisp_runtime.planning.plan import LayerPlan
from crisp_runtime.scheduling.scheduler import flow_shop_makespan, johnson_order


def _random_packed(num_experts: int, inter: int, hidden: int, device="cpu", seed: int = 0, group_size: int = 64):
    g = torch.Generator(device="cpu").manual_seed(seed)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.02).to(device)
    down = (torch.randn(num_experts, hidden, inter, generator=g) * 0.02).to(device)
    layer = pack_layer(gate_up, down, QuantFormat(group_size=group_size))
    del gate_up, down
    return layer


def _crisp_plan(num_experts: int, top_k: int, inter: int, layer_ids, seed: int = 0) -> CrispPlan:
    """A CRISP plan with every pair tiered at random (the densest lookup table)."""
    g = torch.Generator().manual_seed(seed)
    tiers, dominant = {}, {}
    codes = list(Tier)
    for a in range(num_experts):
        for b in range(a + 1, num_experts):
            tiers[(a, b)] = codes[int(torch.randint(0, 3, (1,), generator=g))]
            dominant[(a, b)] = a if torch.rand(1, generator=g) < 0.5 else b
    layers = {i: LayerPlan(tiers, dominant) for i in layer_ids}
    return CrispPlan.crisp(num_experts, top_k, inter, layers, TierWidths(inter, inter // 2, 0))


def _plan_for(policy: str, num_experts, top_k, inter, layer_ids) -> CrispPlan:
    if policy == "crisp":
        return _crisp_plan(num_experts, top_k, inter, layer_ids)
    if policy == "crisp_aux":  # heavy auxiliaries at the dominant width (CrispPlan.aux_full_weight)
        return _crisp_plan(num_experts, top_k, inter, layer_ids).promoted(0.3)
    if policy == "full":
        return CrispPlan.full(num_experts, top_k, inter, layer_ids)
    if policy == "uniform":
        return CrispPlan.uniform(num_experts, top_k, inter, layer_ids, inter // 2)
    if policy == "skip_aux":
        return CrispPlan.skip_aux(num_experts, top_k, inter, layer_ids)
    raise ValueError(f"policy: expected crisp, crisp_aux, full, uniform or skip_aux, got {policy!r}")


def measure_planner_overhead(
    configs=((8, 2), (64, 6)),
    *,
    policies=("crisp", "full"),
    servings=("plan", "resident-floor75"),
    tokens: int = 1,
    iters: int = 2000,
    warmup: int = 200,
    target_us: float = 100.0,
    seed: int = 0,
) -> list[dict]:
    """CPU microseconds per MoE layer per step, from router output to the ordered step plan.

    configs: (num_experts, top_k) pairs. The cache is warm and holds about half the experts,
    so resident lookups, misses and widenings all occur. Routing tensors are fresh per step.
    servings: serving policies (``crisp_runtime.planning.serving`` names), each timed through
    ``CrispRuntime.plan_served`` (plan widths and roles, serving, scheduler).
    """
    records = []
    inter, hidden = 16, 64  # the planner never touches weights; sizes only scale byte counts
    for num_experts, top_k in configs:
        layer = _random_packed(num_experts, inter, hidden, seed=seed)
        for policy, serving in ((p, s) for p in policies for s in servings):
            plan = _plan_for(policy, num_experts, top_k, inter, [0])
            nb = layer.fmt.neuron_nbytes(hidden)
            budget = max(min_budget_bytes({0: layer}, top_k), num_experts // 2 * inter * nb)
            runtime = CrispRuntime({0: layer}, plan, device="cpu", gpu_budget=budget,
                                   config=RuntimeConfig(serving=serving))
            g = torch.Generator().manual_seed(seed)
            n = warmup + iters
            logits = torch.randn(n, tokens, num_experts, generator=g)
            weights_all, index_all = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
            for e in range(0, num_experts, 2):  # half the experts resident, some narrowed
                runtime.cache.acquire(0, e, inter if e % 4 == 0 else inter // 2)
            widths_us, total_us = [], []
            for i in range(n):
                index, weights = index_all[i], weights_all[i]
                t0 = time.perf_counter()
                plan.token_widths(0, index, weights)
                t1 = time.perf_counter()
                runtime.plan_served(0, index, weights)
                t2 = time.perf_counter()
                if i >= warmup:
                    widths_us.append((t1 - t0) * 1e6)
                    total_us.append((t2 - t1) * 1e6)
            total_us.sort()
            records.append({
                "num_experts": num_experts, "top_k": top_k, "tokens": tokens, "policy": policy, "serving": serving,
                "planner_us_mean": statistics.fmean(total_us),
                "planner_us_p50": total_us[len(total_us) // 2],
                "planner_us_p99": total_us[int(len(total_us) * 0.99)],
                "plan_widths_us_mean": statistics.fmean(widths_us),
                "target_us": target_us,
                "meets_target": total_us[len(total_us) // 2] <= target_us,
                "threads": torch.get_num_threads(),
            })
    return records


# ------------------------------------------------------------------------------ GPU-only


def _require_cuda():
    if not torch.cuda.is_available():
        raise RuntimeError("this benchmark needs a CUDA GPU")
    return torch.device("cuda")


def _time_cuda(fn, iters: int, warmup: int = 3) -> float:  # GPU-only: median seconds per call
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_transfer(
    *,
    hidden: int = 4096,
    intermediate: int = 14336,
    num_experts: int = 2,
    fractions=(0.125, 0.25, 0.5, 1.0),
    iters: int = 10,
    target: float = 0.85,
) -> list[dict]:
    """GPU-only. Prefix copies through the cache (miss at width k) vs a plain pinned copy.

    ``pinned_gbps``: one large pinned host buffer copied to the device (the link's measured
    bandwidth); ``prefix_gbps``: the cache's copy of a width-k prefix (three tensors: qweight,
    scales, zeros); ``ratio`` = prefix / pinned, target >= 0.85.
    """
    device = _require_cuda()
    layer = _random_packed(num_experts, intermediate, hidden, device=device)
    layer = _to_cpu_layer(layer)
    full = layer.intermediate_size
    nb = layer.fmt.neuron_nbytes(hidden)
    plan = CrispPlan.full(num_experts, 1, full, [0])
    runtime = CrispRuntime({0: layer}, plan, device=device, gpu_budget=num_experts * full * nb,
                           config=RuntimeConfig(pin_memory=True))
    cache = runtime.cache
    big = torch.empty(full * nb, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(big, device=device)
    pinned_s = _time_cuda(lambda: dst.copy_(big, non_blocking=True), iters)
    pinned_gbps = big.numel() / pinned_s / 1e9
    records = []
    for frac in fractions:
        width = max(1, int(full * frac))

        def copy_prefix(width=width):
            cache.clear()
            cache.acquire(0, 0, width)

        prefix_s = _time_cuda(copy_prefix, iters)
        plain_s = _time_cuda(lambda w=width: dst[: w * nb].copy_(big[: w * nb], non_blocking=True), iters)
        nbytes = width * nb
        records.append({
            "width": width, "fraction": frac, "bytes": nbytes, "prefix_ms": prefix_s * 1e3,
            "prefix_gbps": nbytes / prefix_s / 1e9, "plain_same_bytes_gbps": nbytes / plain_s / 1e9,
            "pinned_gbps": pinned_gbps, "ratio": nbytes / prefix_s / 1e9 / pinned_gbps, "target": target,
            "device": torch.cuda.get_device_name(device),
        })
    return records


def measure_layer_step(
    *,
    hidden: int = 4096,
    intermediate: int = 14336,
    num_experts: int = 8,
    top_k: int = 2,
    tokens: int = 1,
    widths=None,
    iters: int = 10,
    target: float = 1.10,
) -> list[dict]:
    """GPU-only. One layer step from a cold cache against the flow-shop bound.

    widths: the width of each routed slot of token 0's experts (default: full, then half,
    quarter...: CRISP-like mixed widths). The bound is the makespan of Johnson's order with
    each expert's measured load (cache miss at its width) and compute (kernels on a resident
    prefix) times; ``ratio`` = measured / bound, target <= 1.10.
    """
    device = _require_cuda()
    layer = _to_cpu_layer(_random_packed(num_experts, intermediate, hidden, device=device))
    full = layer.intermediate_size
    nb = layer.fmt.neuron_nbytes(hidden)
    if widths is None:
        widths = [max(1, full >> i) for i in range(top_k)]
    g = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]).to(device)
    index[:] = index[0]  # every token routes to the same experts, so the slot widths below are the experts'
    weights = torch.full((tokens, top_k), 1.0 / top_k, device=device)
    plan_widths = torch.tensor(widths, dtype=torch.int64)

    class _FixedWidths(CrispPlan):  # the plan lookup returns the requested widths per slot
        def token_widths(self, layer_id, top_k_index, top_k_weights):
            return plan_widths.expand(top_k_index.shape[0], -1).clone()

    plan = _FixedWidths.full(num_experts, top_k, full, [0])
    x = torch.randn(tokens, hidden, device=device, dtype=torch.float16)
    records = []
    outs = {}
    budget = num_experts * full * nb
    for mode in ("async", "sync"):
        runtime = CrispRuntime({0: layer}, plan, device=device, gpu_budget=budget,
                               config=RuntimeConfig(async_copies=mode == "async", pin_memory=True))

        def step(runtime=runtime):
            runtime.cache.clear()
            return runtime.forward(0, x, index, weights)

        outs[mode] = step()
        records.append({"mode": mode, "measured_ms": _time_cuda(step, iters) * 1e3})
    # Not bitwise: with a stage-2 split > 1 the kernels add fp32 partial sums with atomics in no
    # fixed order, so two runs of the same path may differ in the last bits. Equal here means
    # within one rounding of the output dtype (a stream bug gives garbage, not one ulp).
    diff = (outs["async"].double() - outs["sync"].double()).norm().item()
    rel_diff = diff / max(outs["sync"].double().norm().item(), 1e-300)
    identical = rel_diff <= torch.finfo(x.dtype).eps

    # Per-expert load and compute times, measured separately.
    runtime = CrispRuntime({0: layer}, plan, device=device, gpu_budget=budget, config=RuntimeConfig(pin_memory=True))
    experts = index[0].tolist()
    load, compute = [], []
    from crisp_kernels import expert_mlp_accumulate_

    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)
    rows = torch.arange(tokens, device=device)
    w = torch.full((tokens,), 1.0 / top_k, device=device)
    for e, width in zip(experts, widths, strict=True):
        def load_one(e=e, width=width):
            runtime.cache.clear()
            runtime.cache.acquire(0, e, width)

        load.append(_time_cuda(load_one, iters))
        got = runtime.cache.acquire(0, e, width)
        compute.append(_time_cuda(lambda got=got, width=width: expert_mlp_accumulate_(
            out, x, got.expert, width, rows=rows, weights=w), iters))
    order = johnson_order(load, compute)
    bound = flow_shop_makespan(order, load, compute)
    serial = sum(load) + sum(compute)
    for r in records:
        r.update({
            "num_experts": num_experts, "top_k": top_k, "tokens": tokens, "widths": list(widths),
            "bound_ms": bound * 1e3, "serial_ms": serial * 1e3, "ratio": r["measured_ms"] / (bound * 1e3),
            "target": target, "load_ms": [t * 1e3 for t in load], "compute_ms": [t * 1e3 for t in compute],
            "async_equals_sync": identical, "async_vs_sync_rel_diff": rel_diff,
            "device": torch.cuda.get_device_name(device),
        })
    return records


def measure_cpu_worker(
    *,
    hidden: int = 4096,
    intermediate: int = 14336,
    top_k: int = 2,
    fractions=(0.25, 1.0),
    tokens: int = 1,
    repeats: int = 3,
    config: RuntimeConfig | None = None,
) -> list[dict]:
    """The runtime's CPU worker (hybrid placement ``cpu_only``) per expert, through ``CrispRuntime.forward``.

    One layer of ``top_k`` experts of random 4-bit rows (timing only: the values do not matter), every
    token routed to all of them at ``fraction`` of the full width (a uniform plan). Each record: the
    median wall time of a layer step over ``repeats`` (after one warm-up step, which also builds the
    int4pack copy of a lazily prepared expert) divided by ``top_k``, and the GB/s of the format's
    prefix bytes. ``config``: the runtime configuration (its serving policy becomes ``cpu_only``).
    """
    from dataclasses import replace

    from crisp_kernels import PackedLayer
    from crisp_runtime.scheduling.scheduler import CostModel

    fmt = QuantFormat(group_size=64)
    g = torch.Generator().manual_seed(0)
    groups = hidden // fmt.group_size
    shape = (top_k, intermediate, 3)
    layer = PackedLayer(fmt, torch.randint(0, 256, (*shape, hidden // 2), dtype=torch.uint8, generator=g),
                        (torch.rand(*shape, groups, generator=g) * 1e-2).half(),
                        torch.randint(0, 16, (*shape, groups), dtype=torch.uint8, generator=g),
                        torch.arange(intermediate).repeat(top_k, 1))
    base = RuntimeConfig() if config is None else config
    config = replace(base, serving="cpu_only",
                     cost=base.cost if base.cost.has_cpu else CostModel(cpu_bytes_per_s=1e9))
    x = torch.randn(tokens, hidden)
    index = torch.arange(top_k).repeat(tokens, 1)
    weights = torch.full((tokens, top_k), 1.0 / top_k)
    records = []
    for fraction in fractions:
        width = max(1, round(fraction * intermediate))
        plan = CrispPlan.uniform(top_k, top_k, intermediate, [0], width=width)
        runtime = CrispRuntime({0: layer}, plan, device="cpu", gpu_budget=top_k * intermediate * layer.neuron_nbytes,
                               config=config)
        try:
            runtime.forward(0, x, index, weights)  # warm-up (and a lazy preparation)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                runtime.forward(0, x, index, weights)
                times.append(time.perf_counter() - t0)
        finally:
            runtime.close()
        per_expert = statistics.median(times) / top_k
        records.append({"hidden": hidden, "intermediate": intermediate, "width": width, "fraction": fraction,
                        "tokens": tokens, "ms_per_expert": per_expert * 1e3,
                        "gbps": width * layer.neuron_nbytes / per_expert / 1e9, "repeats": repeats,
                        "threads_main": torch.get_num_threads()})
    return records


def _to_cpu_layer(layer):
    from crisp_kernels import PackedLayer

    return PackedLayer(layer.fmt, layer.qweight.cpu(), layer.scales.cpu(),
                       None if layer.zeros is None else layer.zeros.cpu(), layer.neuron_order.cpu())


def main() -> None:
    runs = measure_planner_overhead() + measure_planner_overhead(policies=("crisp_aux",),
                                                                 servings=("resident", "resident-narrow-aux"))
    for r in runs:
        print(f"E={r['num_experts']:3d} top-{r['top_k']} T={r['tokens']} {r['policy']:9s} {r['serving']:19s} planner "
              f"p50 {r['planner_us_p50']:6.1f} us  mean {r['planner_us_mean']:6.1f} us  "
              f"p99 {r['planner_us_p99']:6.1f} us  (plan widths alone {r['plan_widths_us_mean']:5.1f} us)  "
              f"target <= {r['target_us']:.0f} us: {'yes' if r['meets_target'] else 'NO'}  threads={r['threads']}")


if __name__ == "__main__":
    main()
