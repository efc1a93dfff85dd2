"""docs/hybrid.md, 2026-12-01 session 4: the split with prefetch at two dominant floors x two evictions.

The inputs of ``crisp-bench simulate`` (its own argument parser and ``_simulation_inputs``: the trace, the
plans, the target, the warm-up), configurations the named matrices do not hold: ``hybrid_split`` with a missed
dominant served at a ``FLOOR`` prefix (never widened), next-layer prefetch at the plan's widths, LRU or next-use
eviction, beside the full-width LRU baseline (no prefetch, router order: the issue's baseline). One record per
configuration, the simulator's own (``bench.simulate.simulate_policies``). Usage (the simulate options, then --floors):

    python docs/hybrid-s4-variants.py --trace docs/bench-trace-heldout-predicted.npz \\
        --plan models/tiny-mixtral-crisp --profile rtx4090-pcie4-ddr5 --budget 0.25 \\
        --floors 0.875,0.9375 --eviction lru,next_use --json docs/hybrid-sim-s4-pcie4-25-variants.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from crisp_bench import simulate as sim
from crisp_bench import simulate_cmd as cmd

from crisp_runtime.planning.serving import ServingPolicy
from crisp_runtime.scheduling.scheduler import Placement
from crisp_runtime.storage.outputs import write_json


def main(argv: list[str]) -> int:
    top = argparse.ArgumentParser(prog="hybrid-s4-variants")
    sub = top.add_subparsers(dest="command")
    cmd.add_parser(sub)
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--floors", default="0.875,0.9375")
    extra.add_argument("--json", required=True)
    mine, rest = extra.parse_known_args(argv)
    args = top.parse_args(["simulate", *rest])
    if Path(mine.json).exists():
        print(f"error: --json {mine.json}: exists; refusing to overwrite it", file=sys.stderr)
        return 2
    floors = [float(f) for f in mine.floors.split(",")]
    profile, shape, trace, plans, notes = cmd._simulation_inputs(args)
    warmup = min(32, trace.num_tokens // 4) if args.warmup is None else args.warmup
    configs = [sim.SimPolicy("full", plans["full"])]
    for floor in floors:
        serving = ServingPolicy(f"hybrid_split-floor{100 * floor:g}", dominant_floor=floor, placement=Placement.SPLIT)
        configs += [sim.SimPolicy("crisp", plans["crisp"], serving, e, prefetch=True) for e in args.eviction]
    t0 = time.perf_counter()
    records = sim.simulate_policies(trace, configs[:1], profile, shape, args.budget, orders=["router"],
                                    warmup=warmup, predicted=trace.predicted)
    records += sim.simulate_policies(trace, configs[1:], profile, shape, args.budget, orders=["widest_first"],
                                     warmup=warmup, predicted=trace.predicted)
    base = records[0]["tokens_per_s"]  # full-width LRU, router order
    for r in records:
        r["speedup_vs_full_lru"] = r["tokens_per_s"] / base
        r["narrowed_dominant_fraction"] = r["fallbacks_per_token"] / shape.num_layers  # one dominant per layer
        print(f"{r['label']:50s} {r['tokens_per_s']:7.3f} tok/s  {r['speedup_vs_full_lru']:.3f}x  "
              f"dominants narrowed {r['narrowed_dominant_fraction']:.1%}")
    write_json(mine.json, {"format": "crisp-hybrid-variants", "version": 1, "argv": argv, "profile": profile.name,
                           "target": shape.name, "warmup": warmup, "notes": notes,
                           "elapsed_s": round(time.perf_counter() - t0, 1), "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
