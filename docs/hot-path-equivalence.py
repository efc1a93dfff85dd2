"""Outputs of two checkouts compared (docs/hot-path.md): planner, runtime and simulator, case by case.

    mkdir -p /tmp/before && git archive 29694fc | tar -x -C /tmp/before
    OMP_NUM_THREADS=1 python docs/hot-path-equivalence.py /tmp/before .

Each checkout runs in its own process (``capture`` mode, its packages first on ``sys.path``):

- planner: ``serving.plan_served_step`` for 5 E/top-k shapes x 5-7 plans (full, uniform, skip_aux with
  and without a threshold, crisp with 1 and 2 dominant experts, crisp with unseen pairs) x every named
  serving policy x both task orders x T in 1, 2, 3, 5, 40 (40 x k > 64: the tensor path) x 6 routing
  cases (plain, invalid ids, a duplicated expert with equal weights, int32 ids + bf16 weights, fp16
  weights, tied weights): served widths, wanted widths, roles, counters, tasks, slot positions and widths;
- runtime: ``CrispRuntime.forward`` over 40 steps (T 1-3, two layers, a budget of 3 full experts, so
  misses, widenings and evictions), 6 serving policies x fp32 / bf16 activations: every output
  (exactly) and the statistics;
- simulator: ``simulate_decode`` on the first 48 tokens of docs/bench-trace-heldout-predicted.npz,
  every configuration of the residency and hybrid matrices (rtx4090-pcie4-ddr5, 25%): ``SimResult``.

Keys only one side has (serving policies or counters added since) are listed, not compared, unless a
counter only the newer side has is non-zero.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile


def _tl(t):
    return None if t is None else (str(t.dtype), tuple(t.shape), t.tolist())


def _step_record(served, step):
    fields = ("expert", "width", "resident_width", "copy_bytes", "tokens", "start", "stop", "load_time",
              "compute_time", "on_cpu", "cpu_time", "split_at", "gpu_width", "cpu_rows")
    return (_tl(served.widths), _tl(served.wanted), _tl(served.dominant), served.fallbacks, served.skips,
            served.wider, served.dominant_slots, served.dominant_neurons, served.aux_slots, served.aux_neurons,
            served.widened, tuple(tuple(getattr(t, f) for f in fields) for t in step.tasks), _tl(step.flat_pos),
            _tl(step.flat_widths), step.num_tokens, step.top_k, step.bytes_missing, step.bytes_read,
            step.bytes_routed, step.skipped, dict(step.extra))


def _as_plain(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _as_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _as_plain(v) for k, v in obj.items()}
    return obj


def capture(root: str, path: str) -> None:
    sys.path.insert(0, root)
    os.chdir(root)
    import torch

    torch.set_num_threads(1)
    import crisp_runtime

    assert crisp_runtime.__file__.startswith(os.path.abspath(root)), crisp_runtime.__file__
    from bench import simulate as sim
    from bench import traces as tr
    from bench.profiles import get_profile
    from bench.runtime import _plan_for, _random_packed
    from bench.shapes import TARGETS
    from bench.sim_policies import configurations
    from crisp_runtime import CrispPlan, RuntimeConfig, Tier
    from crisp_runtime.execution.runtime import CrispRuntime
    from crisp_runtime.planning.plan import LayerPlan
    from crisp_runtime.planning.serving import SERVING_POLICIES, plan_served_step
    from crisp_runtime.scheduling.scheduler import CostModel, TaskOrder

    cpu_cost = CostModel(h2d_bytes_per_s=25e9, device_bytes_per_s=1e12, cpu_bytes_per_s=60e9, cpu_latency_s=2e-6,
                         h2d_bytes_per_s_cpu_busy=15e9, join_s=5e-6)
    res = {}
    g = torch.Generator().manual_seed(1)
    for num_experts, k in ((8, 2), (8, 1), (16, 4), (64, 6), (8, 8)):
        inter = 16
        plans = {p: _plan_for(p, num_experts, k, inter, [0]) for p in ("full", "uniform", "skip_aux", "crisp")}
        plans["skip_thr"] = CrispPlan.skip_aux(num_experts, k, inter, [0], threshold=0.3)
        if k >= 2:
            base = plans["crisp"]
            plans["crisp_dom2"] = CrispPlan.crisp(num_experts, k, inter, base.layers, base.tier_widths, num_dominant=2)
            unseen = {0: LayerPlan({(0, 1): Tier.COLD}, {(0, 1): 1})}
            plans["crisp_unseen"] = CrispPlan.crisp(num_experts, k, inter, unseen, base.tier_widths,
                                                    unseen_tier=Tier.HOT)
        resident = {e: [0, inter, inter // 2, 3, 0, inter][e % 6] for e in range(num_experts)}
        for tokens in (1, 2, 3, 5, 40):
            for case in range(6):
                w, idx = torch.softmax(torch.randn(tokens, num_experts, generator=g), -1).topk(k, -1)
                if case == 1:
                    idx[0, -1] = -1
                    if tokens > 1:
                        idx[-1, 0] = num_experts
                if case == 2 and k > 1:
                    idx[:, 1] = idx[:, 0]
                    w[:, 1] = w[:, 0]
                if case == 3:
                    w, idx = w.to(torch.bfloat16), idx.to(torch.int32)
                if case == 4:
                    w = w.to(torch.float16)
                if case == 5 and k > 1:
                    w[:] = 0.5
                for pname, plan in plans.items():
                    for sname, serving in SERVING_POLICIES.items():
                        cost = cpu_cost if serving.placement.uses_cpu else CostModel()
                        for order in (TaskOrder.JOHNSON, TaskOrder.ROUTER):
                            served, step = plan_served_step(
                                serving, plan, 0, idx, w, num_experts=num_experts, neuron_nbytes=40,
                                resident_width=resident.get, cost=cost, order=order)
                            res[("planner", num_experts, k, tokens, case, pname, sname, order.value)] = _step_record(
                                served, step)
    for sname in ("plan", "resident-floor75", "resident-floor75-widen", "hybrid_split", "cpu_only", "hybrid"):
        for xdtype in (torch.float32, torch.bfloat16):
            num_experts, k, inter, hidden = 8, 2, 32, 64
            layers = {0: _random_packed(num_experts, inter, hidden, seed=3),
                      2: _random_packed(num_experts, inter, hidden, seed=4)}
            plan = _plan_for("crisp", num_experts, k, inter, [0, 2])
            cost = cpu_cost if SERVING_POLICIES[sname].placement.uses_cpu else CostModel()
            rt = CrispRuntime(layers, plan, device="cpu", gpu_budget=3 * inter * layers[0].neuron_nbytes,
                              config=RuntimeConfig(serving=sname, cost=cost))
            g2 = torch.Generator().manual_seed(5)
            outs = []
            for n in range(40):
                tokens = (1, 1, 1, 3, 1, 2)[n % 6]
                x = torch.randn(tokens, hidden, generator=g2).to(xdtype)
                w, idx = torch.softmax(torch.randn(tokens, num_experts, generator=g2), -1).topk(k, -1)
                if n % 7 == 3:
                    idx[0, 1] = idx[0, 0]
                lid = (0, 2)[n % 2]
                out = rt.forward(lid, x, idx, w)
                record = _step_record(rt.last_served[lid], rt.last_step[lid])
                outs.append((str(out.dtype), out.float().tolist(), record))
            rt.close()
            res[("runtime", sname, str(xdtype))] = {"outputs": outs, "stats": rt.stats.as_dict()}
    trace = tr.Trace.load("docs/bench-trace-heldout-predicted.npz")
    n = 48
    trace = dataclasses.replace(trace, index=trace.index[:, :n], weights=trace.weights[:, :n], seq_starts=[0],
                                predicted=trace.predicted[:, :n])
    plans = tr.policy_plans(trace, tr.plan_from_trace(trace))
    profile = get_profile("rtx4090-pcie4-ddr5")
    shape = TARGETS["mixtral-8x7b"]
    for matrix in ("residency", "hybrid"):
        for pol in configurations(plans, matrix, prefetch=(False, True)):
            kw = {"orders": ["widest_first"]} if pol.prefetch or pol.serving.placement.uses_cpu else {}
            r = sim.simulate_decode(trace, pol, profile, shape, int(0.25 * shape.total_expert_nbytes), warmup=4,
                                    predicted=trace.predicted if pol.prefetch else None, **kw)
            res[("sim", matrix, pol.label)] = _as_plain(r)
    with open(path, "wb") as f:
        pickle.dump(res, f)


def _diff(a, b, where: str, out: list) -> None:
    """Differences of a (before) and b (after); dict keys only b has must be zero."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in set(a) | set(b):
            if key not in b:
                out.append(f"{where}.{key}: missing after")
            elif key not in a:
                if b[key] not in (0, 0.0, None, {}, []):
                    out.append(f"{where}.{key}: new and non-zero after ({b[key]!r})")
            else:
                _diff(a[key], b[key], f"{where}.{key}", out)
    elif a != b:
        out.append(f"{where}: {str(a)[:200]} | {str(b)[:200]}")


def main() -> int:
    if sys.argv[1] == "capture":
        capture(sys.argv[2], sys.argv[3])
        return 0
    before, after = (os.path.abspath(p) for p in sys.argv[1:3])
    with tempfile.TemporaryDirectory() as tmp:
        got = []
        for i, root in enumerate((before, after)):
            path = os.path.join(tmp, f"{i}.pkl")
            subprocess.run([sys.executable, os.path.abspath(__file__), "capture", root, path], check=True)
            with open(path, "rb") as f:
                got.append(pickle.load(f))
    a, b = got
    common = sorted(set(a) & set(b), key=str)
    diffs: list[str] = []
    for key in common:
        _diff(a[key], b[key], str(key), diffs)
    only = sorted({str(k[-2] if k[0] == "planner" else k[-1]) for k in set(b) - set(a)})
    print(f"cases: {len(a)} before, {len(b)} after, {len(common)} compared; only after (not compared): {only[:8]}")
    for line in diffs[:20]:
        print("DIFF", line)
    print(f"{len(diffs)} differences")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
