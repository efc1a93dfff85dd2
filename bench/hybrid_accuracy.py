"""Accuracy of the hybrid (CPU + GPU) serving policies with the runtime in the loop (docs/hybrid.md).

A residency-aware serving policy's widths depend on what is resident, so its accuracy is measured by
decoding text through ``CrispRuntime`` as a server would (``crisp_tools.serving_eval.decode_windows``:
one token per forward, the cache carried across tokens and windows). This module sets the runtime up as
the simulator's hybrid configurations are (so the served widths come from the same rules):

- the cost model of a hardware profile with a CPU, scaled so that each expert of the run model takes the
  time of a target model's expert (each run neuron stands for ``target I / run I`` target neurons' bytes,
  as ``bench.simulate`` maps a trace): the split decisions and what they admit follow the profile;
- the cache first holds the simulator's pinned hot set (``bench.simulate._pin_hot_experts`` on a trace's
  counts, the oracle both simulated hybrids start from), unless the case says ``nopin``;
- the CPU's rows on the exact fp32 path (``cpu_experts.EXACT``), so the accuracy is that of the widths.

- prefetches cut as the simulator cuts them (``--window on``, the default): ``PrefetchPolicy.window`` is the
  profile's modeled copy clock for the target (``bench.simulate.target_window``), which times each hybrid
  step as the simulator does (``CopyClock.hybrid_step``) and admits only the rows that arrive before the next
  router's end; ``--window off``: every prefetch completes whole (an upper bound on accuracy).

What is not the simulator's: the split granule is the runtime's (64 neurons, 1/4 of the tiny model's
256; the simulator's is 1 traced neuron for Mixtral), and the tiny model's routing, so a decode may narrow a
different share of dominant slots than the simulation: every record reports that share
(``narrowed_dominant_fraction``) for comparison with the simulation's, and the prefetches cut.

    python -m crisp_bench.hybrid_accuracy --budget 0.25 --case hybrid_split+prefetch \\
        --case floor=0.875+prefetch --json hybrid-accuracy-25.json

A case is ``full`` (4-bit full width, no offload: the reference) or ``KEY=VALUE,...`` over the named
policy ``hybrid_split`` (ServingPolicy fields, e.g. ``dominant_floor=0.875,dominant_widen=hit``; ``floor``
is short for ``dominant_floor``), optionally followed by ``+prefetch`` (the next layer's predicted
experts at the plan's widths) and ``+nopin``; a bare ``hybrid_split`` is the policy itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from crisp_runtime import CrispPlan, RuntimeConfig, apply
from crisp_runtime.cpu.experts import EXACT
from crisp_runtime.planning.serving import SERVING_POLICIES, ServingPolicy, make_serving
from crisp_runtime.residency.eviction import POLICIES as EVICTION_POLICIES
from crisp_runtime.scheduling.prefetch import PrefetchPolicy
from crisp_runtime.scheduling.scheduler import CostModel
from crisp_runtime.storage.outputs import write_json

from . import traces as tr
from .common import CliError
from .profiles import HardwareProfile, get_profile
from .shapes import TARGETS
from .simulate import _pin_hot_experts, neuron_scale, target_window


@dataclass(frozen=True)
class Case:
    """One decoded configuration: None policy = 4-bit full width, everything resident (the reference)."""

    text: str
    policy: ServingPolicy | None
    prefetch: bool = False
    pin: bool = True


def parse_case(text: str) -> Case:
    """``full`` | ``hybrid_split`` | ``KEY=VALUE,...`` (over hybrid_split), then ``+prefetch`` / ``+nopin``."""
    if text == "full":
        return Case(text, None, pin=False)
    head, *flags = text.split("+")
    unknown = set(flags) - {"prefetch", "nopin"}
    if unknown or not head:
        raise CliError(f"--case {text!r}: expected full, hybrid_split or KEY=VALUE,... then +prefetch / +nopin")
    fields = SERVING_POLICIES["hybrid_split"].to_dict()
    if head != "hybrid_split":
        for item in head.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise CliError(f"--case {text!r}: {item!r} is not KEY=VALUE")
            key = {"floor": "dominant_floor"}.get(key, key)
            try:
                fields[key] = float(value)
            except ValueError:
                fields[key] = value
        fields["name"] = head
    try:
        policy = make_serving(fields)
    except (TypeError, ValueError) as exc:
        raise CliError(f"--case {text!r}: {exc}") from None
    return Case(text, policy, "prefetch" in flags, "nopin" not in flags)


def scaled_cost(profile: HardwareProfile, run_row_nbytes: int, target_row_nbytes: int) -> CostModel:
    """``profile``'s cost model with bandwidths scaled by run / target bytes per row: a run expert's times are
    a target expert's (latencies and the join unchanged)."""
    if not profile.has_cpu:
        raise CliError(f"--profile {profile.name}: needs a CPU (cpu_bytes_per_s), e.g. rtx4090-pcie4-ddr5")
    s = run_row_nbytes / target_row_nbytes
    busy = profile.h2d_bytes_per_s_cpu_busy
    return CostModel(h2d_bytes_per_s=profile.h2d_bytes_per_s * s, device_bytes_per_s=profile.compute_bytes_per_s * s,
                     cpu_bytes_per_s=profile.cpu_bytes_per_s * s, cpu_latency_s=profile.cpu_latency_s,
                     h2d_bytes_per_s_cpu_busy=None if busy is None else busy * s, join_s=profile.join_s)


def trace_counts(trace, plan: CrispPlan) -> tuple[list, list]:
    """(routed, wanted) per traced layer, as ``bench.simulate`` computes them for its pinned set."""
    routed, wanted = [], []
    for li, layer_id in enumerate(trace.layer_ids):
        idx = torch.from_numpy(np.ascontiguousarray(trace.index[li])).to(torch.int64)
        w, _ = plan.token_widths_and_roles(layer_id, idx, torch.from_numpy(np.ascontiguousarray(trace.weights[li])),
                                           roles=False)
        routed.append(idx)
        wanted.append(w)
    return routed, wanted


def decode_case(model, pack_dir: str, layers, plan: CrispPlan, windows, case: Case, budget: int, cost: CostModel,
                pinned, window=None, eviction: str = "lru") -> dict:
    """Decode ``windows`` under ``case``; the record (accuracy, served-width and cache statistics).
    window: ``PrefetchPolicy.window`` of a case with prefetch (None: every prefetch whole); eviction: the
    runtime's (``RuntimeConfig.eviction``) for an offloading case."""
    from crisp_tools.serving_eval import decode_windows

    first = next(iter(layers.values()))
    inter, nb = first.intermediate_size, first.fmt.neuron_nbytes(first.hidden_size)
    t0 = time.perf_counter()
    if case.policy is None:
        handle = apply(model, pack_dir, plan=CrispPlan.full(first.num_experts, plan.top_k, inter,
                                                            tuple(sorted(layers))), gpu_budget=None)
    else:
        handle = apply(model, pack_dir, gpu_budget=budget,
                       config=RuntimeConfig(serving=case.policy, cost=cost, cpu_experts=EXACT, eviction=eviction,
                                            prefetch=PrefetchPolicy(window=window) if case.prefetch else None))
        if case.pin:
            routed, wanted = pinned
            _pin_hot_experts([handle.runtime.cache] * len(layers), routed, wanted, len(layers), nb, inter)
        handle.runtime.stats.reset()
    try:
        scores = decode_windows(model, windows)
        stats = handle.stats()
    finally:
        handle.restore()
    out = {"case": case.text, "serving": None if case.policy is None else case.policy.to_dict(),
           "prefetch": case.prefetch, "prefetch_window": window is not None and case.prefetch,
           "pinned": case.pin, "eviction": None if case.policy is None else eviction,
           "accuracy": float(scores.correct.float().mean()),
           "tokens_evaluated": int(scores.correct.numel()), "elapsed_s": round(time.perf_counter() - t0, 1)}
    if case.policy is not None:
        out.update({k: stats.get(k) for k in ("fallbacks", "served_dominant_slots", "served_widened", "hit_rate",
                                              "cpu_runs", "cpu_splits", "transients", "prefetches", "prefetch_hits",
                                              "prefetch_bytes", "prefetch_cut", "prefetch_cut_rows")})
        out["narrowed_dominant_fraction"] = stats["fallbacks"] / max(1, stats["served_dominant_slots"])
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m crisp_bench.hybrid_accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny-mixtral",
                   help="local transformers checkpoint folder (default %(default)s)")
    p.add_argument("--crisp", default="models/tiny-mixtral-crisp", help="pack folder with its plan")
    p.add_argument("--data", default="data/stdlib-heldout.txt",
                   help="text decoded for the accuracy (default %(default)s)")
    p.add_argument("--windows", type=int, default=16, help="windows of text (default 16)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window (default 128)")
    p.add_argument("--trace", default="bench/traces/heldout-predicted.npz", help="counts of the pinned hot set")
    p.add_argument("--budget", type=float, required=True, help="GPU budget, a fraction of all expert bytes")
    p.add_argument("--profile", default="rtx4090-pcie4-ddr5",
                   help="hardware profile whose cost model the scheduler uses (default %(default)s)")
    p.add_argument("--target", default="mixtral-8x7b", choices=sorted(TARGETS),
                   help="model whose expert sizes the cost model is scaled to (default %(default)s)")
    p.add_argument("--case", action="append", required=True, help="see the module docstring; repeatable")
    p.add_argument("--eviction", choices=sorted(EVICTION_POLICIES), default="lru",
                   help="the runtime's eviction policy in every offloading case (default lru)")
    p.add_argument("--window", choices=("on", "off"), default="on",
                   help="cut prefetches at the profile's modeled copy clock, as the simulator (default on)")
    p.add_argument("--json", required=True, help="output file (written atomically; an existing file is refused)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args([] if argv is None else argv)
    try:
        return _run(args)
    except CliError as exc:  # crisp_tools' loaders raise the same class (crisp_runtime.cli_args.CliError)
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from pathlib import Path

    from crisp_tools.calibration import contiguous_windows, load_model, load_pack_dir, load_texts
    from crisp_tools.serving_eval import total_expert_bytes

    if not 0.0 < args.budget <= 1.0:
        raise CliError(f"--budget must be a fraction in (0, 1], got {args.budget}")
    if args.windows < 1 or args.seq_len < 2:
        raise CliError(f"--windows must be >= 1 and --seq-len >= 2, got {args.windows} and {args.seq_len}")
    if Path(args.json).exists():
        raise CliError(f"--json {args.json}: exists; refusing to overwrite it")
    cases = [parse_case(c) for c in args.case]
    profile = get_profile(args.profile)  # every cheap check before the model loads
    texts = load_texts([args.data])
    torch.set_num_threads(1)
    layers, plan, _ = load_pack_dir(args.crisp)
    if plan is None:
        raise CliError(f"--crisp {args.crisp}: the pack has no plan (plan.json)")
    model, _ = load_model(args.model, "cpu", "float32")
    windows = contiguous_windows(texts, args.windows, args.seq_len)
    first = next(iter(layers.values()))
    inter = first.intermediate_size
    shape = TARGETS[args.target]
    try:
        scale = neuron_scale(inter, shape)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    cost = scaled_cost(profile, first.fmt.neuron_nbytes(first.hidden_size),
                       shape.neuron_nbytes * scale)
    budget = int(args.budget * total_expert_bytes(layers))
    pinned = trace_counts(tr.Trace.load(args.trace), plan)
    window = target_window(profile, shape, inter) if args.window == "on" else None
    records = []
    for case in cases:
        r = decode_case(model, args.crisp, layers, plan, windows, case, budget, cost, pinned, window, args.eviction)
        records.append(r)
        print(json.dumps(r), flush=True)
    full = next((r["accuracy"] for r in records if r["case"] == "full"), None)
    for r in records:
        r["accuracy_loss"] = None if full is None else 1.0 - r["accuracy"] / full
    meta = {"format": "crisp-hybrid-accuracy", "version": 1, "model": args.model, "crisp": args.crisp,
            "data": args.data, "windows": [args.windows, args.seq_len], "trace": args.trace,
            "budget_fraction": args.budget, "budget_bytes": budget, "profile": args.profile, "target": args.target,
            "cost_model": vars(cost), "prefetch_window": None if window is None else window.to_dict(),
            "notes": "runtime in the loop; see crisp_bench/hybrid_accuracy.py's docstring",
            "records": records}
    write_json(args.json, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
