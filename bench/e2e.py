"""``crisp-bench e2e``: decode a real model under each policy at equal GPU memory.

The model runs through ``crisp_runtime`` (``apply`` with the pack and a device-cache byte
budget); each policy swaps the plan (``handle.set_plan``) and starts from an empty cache.
Decoding is batch 1 with a KV cache, teacher-forced on held-out text, so next-token accuracy
is measured on the same tokens for every policy (and for the unquantized model, as the
reference). ``full`` with the LRU cache is the mixtral-offloading-style baseline: whole
experts at 4 bits, least recently used evicted.

On a CPU the "GPU" is host memory: the cache copies are memcpy, and the tokens/s are the
CPU's, not an offloading system's (the output says so).

``--placements`` (hybrid placement) runs the plans again with the experts placed by the serving policy's
``placement``: ``hybrid`` (per step, the GPU / CPU split of minimal makespan on a cost model with
the CPU's bandwidth measured here), ``hybrid_split`` (the same with the neuron split: an expert's
rows [0, s) on the GPU, [s, width) on the CPU), ``static_hybrid`` (llama.cpp ``--n-cpu-moe`` style: the most
used experts resident at full width, the others on the CPU) and ``cpu_only``. ``hybrid``,
``hybrid_split`` and ``static_hybrid`` start with the most used experts of the decoded tokens' routing (recorded from
the unquantized model: an oracle, as in the simulator) resident at full width within the budget.
Each record of a CPU placement carries the check of every MoE layer step against the float64
reference at the widths that step served (:class:`StepCheck`: ``steps_checked``,
``max_err_over_bound``, ``within_tolerance``; the bound is each expert's tolerance times its
contribution's norm, summed: the CPU's precision contract, ``crisp_runtime.cpu.experts``, for its
experts, the kernels' for the GPU's), and ``max_logit_diff_vs_gpu``: the largest difference of its
logits from the same plan under the GPU placement (information: with ``--cpu-precision fp32``
they differ only by float32 summation order, with bf16 by the bf16 path's rounding). On a
CPU-only machine the "GPU" side runs on the CPU too: this checks the hybrid path end to end, it
measures no offloading speed.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from crisp_tools.text import read_texts, sample_sequences

from crisp_kernels.cpu_expert import Precision
from crisp_kernels.expert_mlp import expert_mlp_ref
from crisp_runtime import cli_args as ca
from crisp_runtime.cpu.experts import EXACT, TOLERANCE, CpuExpertsConfig, CpuKernel
from crisp_runtime.cpu.knob import measure_cpu_bytes_per_s, replay_cpu
from crisp_runtime.execution.runtime import RuntimeConfig
from crisp_runtime.hf.dropin import apply
from crisp_runtime.hf.moe_layers import max_positions
from crisp_runtime.planning.serving import ServingPolicy
from crisp_runtime.residency.ledger import pin_most_used
from crisp_runtime.scheduling.scheduler import CostModel, Placement

from . import common, report
from . import traces as tr
from .common import (
    ModelInputError,
    bench_device,
    cache_argument,
    cache_of,
    load_model_for_bench,
    rel,
    sync,
)
from .sim_policies import DEFAULT_POLICY
from .simulate import budget_for_fraction

PLACEMENTS = ("gpu", "hybrid", "hybrid_split", "static_hybrid", "cpu_only")  # scheduler.Placement values
CPU_PRECISIONS = tuple(p.value for p in Precision)  # RuntimeConfig.cpu_experts: q8 (default), bf16 or fp32 (exact)


class StepCheck:
    """Every layer step of ``runtime`` against the float64 reference at the widths it served.

    Installed as the runtime's ``forward`` (an instance attribute; :meth:`close` removes it). After each
    step, each expert's reference contribution (``expert_mlp_ref`` in float64 on its host rows at the
    step's per-slot widths) is summed, and ``||out - ref||`` is compared with the step's bound:
    ``sum over parts of tol(side) * ||ref_part||``, a part being an expert's rows on one side (a split
    expert has two: [0, split_at) on the GPU, [split_at, width) on the CPU); tol = the CPU's precision
    contract (``cpu_experts.TOLERANCE``) on the CPU, the kernels' on the GPU (1e-5 with fp32
    activations, 2u = ``finfo.eps`` of fp16/bf16 ones), plus the output's rounding to the activations'
    dtype. ``worst``: the largest ratio error / bound (<= 1: within tolerance).
    """

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self._forward = runtime.forward
        self.cpu_tol = TOLERANCE[runtime.config.cpu_experts.precision]
        self.steps = 0
        self.worst = 0.0
        runtime.forward = self

    def __call__(self, layer_id, hidden_states, top_k_index, top_k_weights):
        out = self._forward(layer_id, hidden_states, top_k_index, top_k_weights)
        step = self.runtime.last_step[layer_id]
        dtype = hidden_states.dtype
        gpu_tol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
        x = hidden_states.detach().to("cpu", torch.float64)
        weights = top_k_weights.detach().reshape(-1).to("cpu", torch.float64)
        ref = torch.zeros(x.shape, dtype=torch.float64)
        bound = 0.0
        for t in step.tasks:
            pos, widths = step.flat_pos[t.start:t.stop], step.flat_widths[t.start:t.stop]
            rows = torch.div(pos, step.top_k, rounding_mode="floor")
            host = self.runtime.store.expert(layer_id, t.expert)  # host rows (every CPU placement has a budget)
            scale = weights[pos].unsqueeze(1)

            def expert_ref(xs, width, host=host, rows=rows, widths=widths, scale=scale):
                return expert_mlp_ref(xs[rows], host, width, token_widths=widths, compute_dtype=torch.float64) * scale

            cut = t.gpu_width  # rows [0, cut) on the GPU, [cut, width) on the CPU (a whole side, or the neuron split)
            parts = []
            if cut:
                parts.append((expert_ref(x, cut), gpu_tol))
            if cut < t.width:
                parts.append((expert_ref(x, t.width) - (expert_ref(x, cut) if cut else 0), self.cpu_tol))
            for part, tol in parts:
                ref.index_add_(0, rows, part)
                bound += tol * float(part.norm())
        if dtype != torch.float32:
            bound += torch.finfo(dtype).eps / 2 * float(ref.norm())
        err = float((out.detach().to("cpu", torch.float64) - ref).norm())
        self.steps += 1
        self.worst = max(self.worst, err / bound if bound > 0 else (0.0 if err == 0 else float("inf")))
        return out

    def close(self) -> None:
        del self.runtime.forward

    def record(self) -> dict:
        return {"steps_checked": self.steps, "max_err_over_bound": self.worst,
                "within_tolerance": self.steps > 0 and self.worst <= 1.0}


@torch.no_grad()
def decode(model, ids: torch.Tensor, warmup: int, handle=None, logits: list | None = None) -> dict:
    """Teacher-forced batch-1 decode over ``ids`` (N,): one token per forward, KV cache on.

    Returns tokens/s and accuracy over the positions after ``warmup`` (the first ones fill the
    expert cache and the allocator); runtime stats are reset at the same point.
    """
    device = next(p for p in model.parameters() if not p.is_meta).device
    ids = ids.to(device)
    past = None
    cache_kwargs = cache_argument(model)
    correct = 0
    counted = 0
    t0 = None
    for t in range(len(ids) - 1):
        if t == warmup:
            sync(device)
            if handle is not None:
                handle.reset_stats()
            t0 = time.perf_counter()
        out = model(input_ids=ids[t:t + 1].unsqueeze(0), **cache_kwargs(past), use_cache=True)
        past = cache_of(out)
        if t >= warmup:
            correct += int(out.logits[0, -1].argmax().item() == int(ids[t + 1]))
            counted += 1
            if logits is not None:
                logits.append(out.logits[0, -1].float().cpu())
    sync(device)
    elapsed = time.perf_counter() - t0
    return {"tokens": counted, "seconds": elapsed, "tokens_per_s": counted / elapsed, "accuracy": correct / counted}


def add_parser(subparsers) -> None:
    """The ``crisp-bench e2e`` subcommand's options."""
    p = subparsers.add_parser(
        "e2e", help="decode tokens/s, bytes/token, hit rate, accuracy per policy",
        description="End-to-end decoding of a model under each policy at equal GPU memory: tokens/s, "
        "bytes copied per token, cache hit rate and next-token accuracy. full = the "
        "mixtral-offloading-style full-width LRU baseline.")
    common.add_model_args(p)
    p.add_argument("--budget", type=common.fraction, default=0.25, help="GPU budget, fraction of expert bytes")
    p.add_argument("--tokens", type=common.positive_int, default=128, help="tokens to decode per policy")
    p.add_argument("--record-trace", metavar="PATH.npz", type=ca.nonempty_path,
                   help="save the routing of the decoded tokens (for `simulate --trace PATH.npz --compare E2E.json`)")
    p.add_argument("--policies", type=common.csv_choices(common.POLICIES), default=list(common.POLICIES))
    p.add_argument("--placements", type=common.csv_choices(PLACEMENTS), default=["gpu"],
                   help=f"where experts run, comma separated: {', '.join(PLACEMENTS)} (default gpu; the others use the "
                   "host CPU: the hybrid placements and their baselines)")
    p.add_argument("--default", action="store_true",
                   help=f"also decode with what apply(model, pack, gpu_budget=B) runs given only the budget (record "
                   f"'{DEFAULT_POLICY}', with stats()['serving']; `simulate --compare` matches it with the simulator's "
                   "record of the same name; without a GPU, its device path: cpu='off')")
    p.add_argument("--cpu-precision", choices=CPU_PRECISIONS, default="q8",
                   help="the precision the CPU placements promise: q8 (default: the native kernel with 8-bit "
                   "activations and integer dots, within 2**-5 of the reference), bf16 (the native kernel in fp32, or "
                   "torch's int4pack op on an int4pack copy built lazily, within 2u of bf16) or fp32 (exact)")
    p.add_argument("--cpu-kernel", choices=tuple(k.value for k in CpuKernel), default="auto",
                   help="the CPU experts' kernel: auto (default: the native C kernel on the host rows where it "
                   "builds), native, or torch (int4pack for bf16, the dequant path for fp32)")
    common.add_outputs(p)


def run(args) -> int:
    device = bench_device()
    model, pack_dir = load_model_for_bench(args.model, args.pack, need_pack=True, device=device)
    pack = common.load_pack_for_model(pack_dir, model)
    if pack.plan is None and "crisp" in args.policies:
        raise ModelInputError(f"{pack_dir}: the pack has no plan.json, so there is no CRISP policy to run")
    warm = min(16, args.tokens // 4)
    limit = max_positions(model)
    if limit is not None and args.tokens + 1 + warm > limit:  # one sequence, KV cache: positions grow per token
        raise ModelInputError(f"--tokens {args.tokens} (+{warm} warm-up +1) is beyond the model's "
                              f"max_position_embeddings ({limit}); at most {limit - 1 - min(16, limit // 5)}")
    try:
        texts = read_texts(args.text)
        ids = sample_sequences(texts, 1, args.tokens + 1 + warm, seed=1)[0]
    except ValueError as exc:
        raise ModelInputError(str(exc)) from exc
    total = sum(layer.nbytes() for layer in pack.layers.values())
    budget = budget_for_fraction("--budget", args.budget, pack.layers, common.pack_top_k(pack), total)

    what = "GPU" if device.type == "cuda" else "CPU (cache 'copies' are host memcpy; not an offloading measurement)"
    print(f"e2e: {rel(args.model)} + pack {rel(pack_dir)} on {what}; budget {args.budget:.0%} of "
          f"{total / 1e6:.2f} MB expert bytes = {budget / 1e6:.2f} MB; {args.tokens} tokens (+{warm} warm-up) "
          f"of {rel(args.text)}")

    # The reference: the unquantized model, and its routing on these tokens (to match uniform's bytes).
    ref = decode(model, ids, warm)
    # the routing of these tokens and the next layer's experts predicted from it (what the default's prefetch
    # reads): the simulator replays the same decisions (`simulate --trace ... --compare`)
    with torch.no_grad():
        trace = tr.record_trace(model, ids[:-1].unsqueeze(0),
                                source=f"{args.text} (the e2e tokens; warm-up {warm})")
    if getattr(args, "record_trace", None):
        trace.meta.update(model=str(args.model), warmup=warm)
        trace.save(args.record_trace)  # atomically
        print(f"routing of the decoded tokens saved to {args.record_trace} (simulate it with --warmup {warm})")
    plans = tr.policy_plans(trace, pack.plan if pack.plan is not None and pack.plan.policy.value == "crisp" else None)
    plans = {k: v for k, v in plans.items() if k in args.policies}

    records = [{"policy": "unquantized (no offload)", "tokens_per_s": ref["tokens_per_s"], "bytes_per_token": 0.0,
                "hit_rate": None, "accuracy": ref["accuracy"], "tokens": ref["tokens"]}]
    placements = list(getattr(args, "placements", None) or ["gpu"])
    gpu_logits: dict[str, torch.Tensor] = {}
    precision = Precision(getattr(args, "cpu_precision", "q8"))
    cpu_experts = replace(EXACT if precision is Precision.FP32 else CpuExpertsConfig(precision=precision),
                          kernel=CpuKernel(getattr(args, "cpu_kernel", "auto")))
    for placement in placements:
        config = _placement_config(placement, pack, cpu_experts)
        # gpu: what apply runs on a GPU machine (here, without a GPU, its device path: replay_cpu); the CPU
        # placements as configured
        handle = apply(model, pack, plan=plans.get("full") or next(iter(plans.values())), gpu_budget=budget,
                       config=config, cpu=replay_cpu(device) if config is None else None)
        try:
            for name, plan in plans.items():
                handle.set_plan(plan)
                handle.runtime.cache.clear()
                if placement in ("hybrid", "hybrid_split", "static_hybrid"):
                    _pin_hot_experts(handle.runtime, trace)
                label = name if placement == "gpu" else f"{name}/{placement}"
                prog = report.Progress(f"e2e {label}")
                prog(0, 1)
                logits: list = []
                check = StepCheck(handle.runtime) if placement != "gpu" else None
                try:
                    res = decode(model, ids, warm, handle, logits=logits)
                finally:
                    if check is not None:
                        check.close()
                prog(1, 1)
                st = handle.stats()
                rec = {
                    "policy": label, "tokens_per_s": res["tokens_per_s"], "ms_per_token": 1e3 / res["tokens_per_s"],
                    "bytes_per_token": st["bytes_h2d_per_token"], "bytes_read_per_token": st["bytes_read_per_token"],
                    "hit_rate": st["hit_rate"], "accuracy": res["accuracy"], "tokens": res["tokens"],
                    "budget_bytes": budget, "budget_fraction": args.budget, "device": str(device),
                    "placement": placement, "cpu_runs_per_token": st["cpu_runs"] / max(1, st["tokens"]),
                }
                if check is not None:
                    rec.update(check.record(), cpu_precision=cpu_experts.precision.value,
                               cpu_experts=(st["cpu"] or {}).get("experts"))
                stacked = torch.stack(logits)
                if placement == "gpu":
                    gpu_logits[name] = stacked
                elif name in gpu_logits:
                    rec["max_logit_diff_vs_gpu"] = float((stacked - gpu_logits[name]).abs().max())
                records.append(rec)
        finally:
            handle.restore()
    if getattr(args, "default", False):
        records.append(_default_record(model, pack, ids, warm, budget, args.budget, device))
    full = next((r for r in records if r["policy"] == "full"), None)
    for r in records:
        if full is not None:
            r["accuracy_loss_vs_full"] = full["accuracy"] - r["accuracy"]
            r["speedup_vs_full"] = r["tokens_per_s"] / full["tokens_per_s"]
        plan_name = r["policy"].split("/")[0]
        if plan_name in plans and plans[plan_name].policy.value == "uniform":
            r["uniform_width"] = plans[plan_name].uniform_width
    cols = [("policy", "policy"), ("tokens_per_s", "tok/s"), ("speedup_vs_full", "x full"),
            ("kb_per_token", "kB copied/tok"), ("kb_read_per_token", "kB read/tok"), ("hit_rate", "hit rate"),
            ("accuracy", "next-token acc"), ("accuracy_loss_vs_full", "acc loss vs full")]
    if placements != ["gpu"]:
        cols += [("cpu_runs_per_token", "CPU experts/tok"), ("max_err_over_bound", "max err/bound"),
                 ("max_logit_diff_vs_gpu", "max |logit diff| vs GPU")]
    rows = [dict(r, kb_per_token=r["bytes_per_token"] / 1e3, kb_read_per_token=r.get("bytes_read_per_token", 0) / 1e3,
                 hit_rate=r["hit_rate"] if r["hit_rate"] is not None else "-") for r in records]
    print(report.table(rows, cols))
    print("full = 4-bit whole experts + LRU cache: the mixtral-offloading-style baseline. "
          f"Accuracy over {ref['tokens']} tokens is noisy below ~1,000 tokens.")
    checked = [r for r in records if "within_tolerance" in r]
    if checked:
        bad = [r["policy"] for r in checked if not r["within_tolerance"]]
        impl = (checked[0].get("cpu_experts") or {}).get("impl", "?")
        print(f"CPU placements (kernel {impl}, held to the {checked[0]['cpu_precision']} tolerance): every layer step "
              "against the float64 reference at the "
              f"widths served: {'all within tolerance' if not bad else 'OUT OF TOLERANCE: ' + ', '.join(bad)} "
              f"(max error / bound {max(r['max_err_over_bound'] for r in checked):.3f})")
        if bad:
            return 1
    if args.plot:
        groups = {r["policy"]: {"tokens/s": r["tokens_per_s"]} for r in records[1:]}
        report.plot_bars(args.plot, groups, ylabel="decode tokens/s",
                         title=f"e2e decode at {args.budget:.0%} budget on {device} ({Path(args.model).name})",
                         note=report.environment()["date"])
        print(f"wrote {args.plot}")
    if args.json:
        report.write_json(args.json, "e2e", records, model=rel(args.model), pack=rel(pack_dir),
                          plans={k: json.loads(json.dumps(v.to_dict()))["policy"] for k, v in plans.items()})
        print(f"wrote {args.json}")
    return 0


def _default_record(model, pack, ids, warm: int, budget: int, fraction: float, device) -> dict:
    """The record ``crisp-default``: the decode of what ``apply(model, pack, gpu_budget=budget)`` runs with no
    other argument (the pack's stored choice for the budget, else the default rule; ``stats()["serving"]``) on a GPU
    machine; on a machine without one, its device path (``cpu="off"``, :func:`replay_cpu`: the default there serves
    every expert on the CPU kernel, which the simulator's ``crisp-default`` does not model)."""
    handle = apply(model, pack, gpu_budget=budget, cpu=replay_cpu(device))
    try:
        prog = report.Progress(f"e2e {DEFAULT_POLICY}")
        prog(0, 1)
        res = decode(model, ids, warm, handle)
        prog(1, 1)
        st = handle.stats()
    finally:
        handle.restore()
    serving = st.get("serving") or {}
    return {"policy": DEFAULT_POLICY, "tokens_per_s": res["tokens_per_s"], "ms_per_token": 1e3 / res["tokens_per_s"],
            "bytes_per_token": st["bytes_h2d_per_token"], "bytes_read_per_token": st["bytes_read_per_token"],
            "hit_rate": st["hit_rate"], "accuracy": res["accuracy"], "tokens": res["tokens"], "budget_bytes": budget,
            "budget_fraction": fraction, "device": str(device), "placement": (st.get("cpu") or {}).get("placement"),
            "cpu_runs_per_token": st["cpu_runs"] / max(1, st["tokens"]), "serving": json.loads(json.dumps(
                serving, default=str))}


def _placement_config(placement: str, pack, cpu_experts: CpuExpertsConfig):
    """The runtime configuration of one ``--placements`` entry: GPU (default) or a CPU placement computing its
    experts as ``cpu_experts`` says, whose cost model has the CPU's bandwidth measured here that way
    (``crisp_runtime.cpu.knob``)."""
    if placement == "gpu":
        return None
    first = pack.layers[min(pack.layers)]
    cost = CostModel(cpu_bytes_per_s=measure_cpu_bytes_per_s(first, config=cpu_experts))
    return RuntimeConfig(serving=ServingPolicy(placement, placement=Placement(placement)), cost=cost,
                         cpu_experts=cpu_experts)


def _pin_hot_experts(runtime, trace) -> None:
    """The static hot set (``crisp_runtime.residency.ledger.pin_most_used``) of the trace's routed slots: the most
    used (layer, expert) pairs resident at full width while they fit in the runtime's cache."""
    counts: dict[tuple[int, int], int] = {}
    for li, layer_id in enumerate(trace.layer_ids):
        for e in trace.index[li].reshape(-1).tolist():
            counts[(layer_id, e)] = counts.get((layer_id, e), 0) + 1
    cache = runtime.cache
    pin_most_used(counts, {layer_id: cache for layer_id in runtime.layers},
                  {layer_id: layer.intermediate_size for layer_id, layer in runtime.layers.items()})
