"""``crisp-bench layer``: MoE layer steps under load/compute orders and policies, on this machine.

The routed experts of each step come from the model's routing on held-out text (decode
steps, every MoE layer in turn), their widths from each policy's plan, and what is resident
from a prefix cache with the GPU budget (the simulator's ``PrefixCache``, same semantics as
the runtime). Each step is then *executed*: the missing prefix rows are copied from pinned
host memory to the device and each expert's kernel (``crisp_kernels.expert_mlp``) runs over
its prefix, in one of three orders:

    serial        copy an expert, compute it, then the next (one stream, nothing overlaps)
    router        copies on a side stream, computes on the main stream, each compute waiting on
                  its own copy's event, in router order
    widest_first  the same, in Johnson's order (cached first, then widest first)

Each step is timed wall-clock (device synchronised). Its flow-shop bound comes from the same
step's copies and computes timed one by one. The breakdown (router, load, compute, share of
load) is this machine's version of the paper's motivating figure. On a CPU there is no copy
engine: the three orders cannot overlap anything and the copies are memcpy (said in the
output).
"""

from __future__ import annotations

import statistics
import time

import torch

from . import report
from .simulate import Job, PrefixCache, flow_shop_bound, johnson_order, needed_experts

ORDERS = ("serial", "router", "widest_first")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class LayerBench:
    """Host (pinned) packed layers, a device mirror that copies land in, and the step executor."""

    def __init__(self, layers, device):
        from crisp_kernels import PackedLayer

        self.device = device
        pin = device.type == "cuda"
        self.host = {i: (layer.pin_memory() if pin else layer) for i, layer in layers.items()}
        self.dev = {i: PackedLayer(layer.fmt, torch.empty_like(layer.qweight, device=device),
                                   torch.empty_like(layer.scales, device=device),
                                   None if layer.zeros is None else torch.empty_like(layer.zeros, device=device),
                                   layer.neuron_order) for i, layer in self.host.items()}
        for i in self.dev:  # start from the true weights (values matter only for NaN-free kernels)
            for d, h in zip(self.dev[i].tensors().values(), self.host[i].tensors().values(), strict=True):
                d.copy_(h.to(d.device))
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, layer_id, expert, start, stop):
        h, d = self.host[layer_id], self.dev[layer_id]
        for name in ("qweight", "scales", "zeros"):
            ht, dt = getattr(h, name), getattr(d, name)
            if ht is not None:
                dt[expert, start:stop].copy_(ht[expert, start:stop], non_blocking=True)

    def compute(self, layer_id, expert, width, x):
        from crisp_kernels import Backend, expert_mlp

        backend = Backend.TORCH if self.device.type == "cpu" else None  # as the runtime does on a CPU
        return expert_mlp(x, self.dev[layer_id].expert(expert), width, backend=backend)

    def run_step(self, layer_id, jobs, x, order) -> float:
        """Execute one step's jobs = [(expert, resident, width)] in ``order``; wall seconds."""
        dev = self.device
        _sync(dev)
        t0 = time.perf_counter()
        if order == "serial" or self.copy_stream is None:
            for e, r, w in jobs:
                if w > r:
                    self.copy(layer_id, e, r, w)
                    _sync(dev)
                self.compute(layer_id, e, w, x)
        else:
            main = torch.cuda.current_stream(dev)
            for e, r, w in jobs:
                if w > r:
                    with torch.cuda.stream(self.copy_stream):
                        self.copy(layer_id, e, r, w)
                        ev = torch.cuda.Event()
                        ev.record(self.copy_stream)
                    main.wait_event(ev)
                self.compute(layer_id, e, w, x)
        _sync(dev)
        return time.perf_counter() - t0

    def time_parts(self, layer_id, jobs, x) -> list[tuple[float, float]]:
        """(load s, compute s) of each job, timed one at a time."""
        out = []
        for e, r, w in jobs:
            _sync(self.device)
            t0 = time.perf_counter()
            if w > r:
                self.copy(layer_id, e, r, w)
            _sync(self.device)
            t1 = time.perf_counter()
            self.compute(layer_id, e, w, x)
            _sync(self.device)
            out.append((t1 - t0 if w > r else 0.0, time.perf_counter() - t1))
        return out


def run(args) -> int:
    from crisp_runtime.pack import load_pack
    from crisp_runtime.text import read_texts, sample_sequences

    from . import traces as tr
    from .e2e import ModelInputError, bench_device, load_model_for_bench
    from .simulate import BudgetTooSmall

    device = bench_device()
    model, pack_dir = load_model_for_bench(args.model, args.pack, need_pack=True, device=device)
    pack = load_pack(pack_dir)
    warm = 8
    try:
        seqs = sample_sequences(read_texts(args.text), 1, args.steps + warm, seed=2)
    except ValueError as exc:
        raise ModelInputError(str(exc)) from exc
    trace = tr.record_trace(model, seqs, source=str(args.text))
    crisp = pack.plan if pack.plan is not None and pack.plan.policy.value == "crisp" else None
    plans = {k: v for k, v in tr.policy_plans(trace, crisp).items() if k in args.policies}
    total = sum(layer.nbytes() for layer in pack.layers.values())
    nb = {i: layer.fmt.neuron_nbytes(layer.hidden_size) for i, layer in pack.layers.items()}
    full_expert = max(layer.nbytes() // layer.num_experts for layer in pack.layers.values())
    budget = int(args.budget * total)
    if budget < trace.top_k * full_expert:
        raise BudgetTooSmall(f"--budget {args.budget:g} is below one token's experts at full width "
                             f"({trace.top_k * full_expert / total:.1%} of the expert bytes)")
    bench = LayerBench(pack.layers, device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    hidden = next(iter(pack.layers.values())).hidden_size
    x = torch.randn(1, hidden, dtype=dtype).to(device)
    router_s = _router_time(model, device, hidden)
    what = "GPU" if device.type == "cuda" else "CPU (no copy engine: orders cannot overlap; copies are memcpy)"
    print(f"layer: {args.model} on {what}; budget {args.budget:.0%} of {total / 1e6:.2f} MB; "
          f"{args.steps} decode steps x {trace.num_layers} MoE layers per policy and order")
    records = []
    for name, plan in plans.items():
        widths = tr.token_widths(trace, plan)
        steps = []  # (layer id, jobs)
        cache = PrefixCache(budget, next(iter(nb.values())))
        for t in range(trace.num_tokens):
            for li, layer_id in enumerate(trace.layer_ids):
                need = needed_experts(trace.index[li, t], widths[li, t])
                resident = {e: cache.resident(li, e) for e in need}
                cache.step(li, need)
                if t >= warm:
                    steps.append((layer_id, [(e, min(resident[e], w), w) for e, w in need.items()]))
        # Each job's load and compute timed alone, median of 3 (the first pass also warms the buffers up).
        reps = [[bench.time_parts(layer_id, jobs, x) for layer_id, jobs in steps] for _ in range(3)]
        parts = [[(statistics.median(r[i][j][0] for r in reps), statistics.median(r[i][j][1] for r in reps))
                  for j in range(len(steps[i][1]))] for i in range(len(steps))]
        jobs_t = [[Job(e, w, lo, co) for (e, _, w), (lo, co) in zip(jobs, p, strict=True)]
                  for (_, jobs), p in zip(steps, parts, strict=True)]
        bound = statistics.fmean(flow_shop_bound(j) for j in jobs_t)
        load = statistics.fmean(sum(j.load_s for j in js) for js in jobs_t)
        comp = statistics.fmean(sum(j.compute_s for j in js) for js in jobs_t)
        prog = report.Progress(f"layer {name}")
        # Orders interleaved step by step (so drifting machine load hits all alike), median over steps.
        times: dict[str, list[float]] = {o: [] for o in ORDERS}
        for n, ((layer_id, jobs), js) in enumerate(zip(steps, jobs_t, strict=True)):
            pos = {j.expert: i for i, j in enumerate(johnson_order(js))}
            for order in ORDERS:
                seq = sorted(jobs, key=lambda j: pos[j[0]]) if order == "widest_first" else jobs
                times[order].append(bench.run_step(layer_id, seq, x, order))
            prog(n + 1, len(steps))
        bound_med = statistics.median(flow_shop_bound(j) for j in jobs_t)
        for order in ORDERS:
            step = statistics.median(times[order])
            records.append({"policy": name, "order": order, "step_ms": 1e3 * step,
                            "step_mean_ms": 1e3 * statistics.fmean(times[order]), "bound_ms": 1e3 * bound_med,
                            "bound_mean_ms": 1e3 * bound,
                            "over_bound": step / bound_med if bound_med > 0 else None, "load_ms": 1e3 * load,
                            "compute_ms": 1e3 * comp, "router_ms": 1e3 * router_s,
                            "load_share": load / (load + comp + router_s) if load + comp + router_s > 0 else 0.0,
                            "bytes_per_step": cache.stats.bytes_copied / max(1, len(steps) + warm * trace.num_layers),
                            "hit_rate": cache.stats.hits / max(1, cache.stats.accesses), "steps": len(steps),
                            "device": str(device), "budget_fraction": args.budget})
    cols = [("policy", "policy"), ("order", "order"), ("step_ms", "step ms (median)"),
            ("bound_ms", "flow-shop bound ms (median)"),
            ("over_bound", "step/bound"), ("router_ms", "router ms"), ("load_ms", "load ms"),
            ("compute_ms", "compute ms"), ("load_share", "load share"), ("hit_rate", "hit rate")]
    print(report.table(records, cols))
    print("paper (RTX 4090, Mixtral, full width): 14.4 ms layer = router 0.4 + load 11.2 + compute 2.6; load share 78%")
    runtime_records = _runtime_measurements(trace, device, hidden)
    if args.plot:
        groups: dict = {}
        for r in records:
            groups.setdefault(r["policy"], {})[r["order"]] = r["step_ms"]
        report.plot_bars(args.plot, groups, ylabel="ms per MoE layer step",
                         title=f"layer step per policy and order ({device})", note=report.environment()["date"])
        print(f"wrote {args.plot}")
    if args.json:
        report.write_json(args.json, "layer", records, model=str(args.model), runtime=runtime_records)
        print(f"wrote {args.json}")
    return 0


@torch.no_grad()
def _router_time(model, device, hidden) -> float:
    """Seconds of one MoE block's router (gate) on one token."""
    from crisp_runtime.models import find_moe_layers

    ref = find_moe_layers(model)[0]
    parent = model.get_submodule(ref.name.rsplit(".", 1)[0])
    gate = getattr(parent, "gate", None) or getattr(parent, "router", None)
    if gate is None:
        return 0.0
    x = torch.randn(1, hidden, device=device)
    times = []
    for _ in range(20):
        _sync(device)
        t0 = time.perf_counter()
        gate(x)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[5:])


def _runtime_measurements(trace, device, hidden) -> list[dict]:
    """The runtime engineer's measurements (``crisp_bench.runtime``): the planner's CPU time per layer step,
    and on a GPU one runtime layer step (async copy stream) against the flow-shop bound."""
    try:
        from . import runtime as rt
    except ImportError as exc:  # pragma: no cover - depends on the runtime package
        print(f"(runtime measurements unavailable: {exc})")
        return []
    out = []
    recs = rt.measure_planner_overhead(configs=((trace.num_experts, trace.top_k),), iters=300, warmup=30)
    for r in recs:
        print(f"runtime planner (CrispRuntime.plan_step), E={r['num_experts']} top-{r['top_k']} {r['policy']}: "
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
