"""Session 10 (issue 10): residency-aware CRISP decoded through the runtime on the long held-out windows.

Session 9 decoded residency-aware CRISP on 64 windows x 128 tokens (8,128 predictions, one standard error ~0.5
point of relative loss), so its one configuration >= 2.5x at <= 2% at 25% (Warm 128 / Cold 64, 1.81%) had a
thin margin. This decodes the chosen configurations on the 128 windows x 256 tokens every batch figure uses
(32,640 predictions, ~0.35 point) with the product's own pieces: ``crisp_tools.serving_eval.run_case`` (teacher-
forced decode through ``crisp_runtime.apply`` with its cache carried across tokens and windows, the prefetch
window of rtx4090-pcie4 at Mixtral-8x7B sizes, as ``crisp-eval --mode decode --prefetch-window`` runs it) and
``serving_eval.record`` / ``write_serving_json`` (the format ``crisp-bench simulate --accuracy`` reads). The
4-bit full-width reference is the batch evaluation's (exact serving: batch = decode, tests/test_evaluate.py),
which saves its ~25 min decode.

    PYTHONPATH=. python docs/sim-s10-long-decode.py OUT.json PACK BUDGET FLOOR [FLOOR ...] [--cap N]
        [--aux-full-weight W] [--aux-skip-weight S] [--narrow-only] [--revive] [--windows N L]
        FLOOR: the dominant floor of the runtime's "resident" serving policy (1 = "resident", 0.75 =
               "resident-floor75"), each decoded with next-layer prefetch through the window (~6 min each at
               128 x 256); --cap: the pack's plan under CrispPlan.width_cap N (neurons); --aux-full-weight
               (session 11): its auxiliaries of routing weight >= W at the dominant width
               (CrispPlan.aux_full_weight); --narrow-only: auxiliaries the plan wants whole are widened
               (AuxNarrower.NARROW_ONLY); --aux-skip-weight (session 14): auxiliaries of routing weight < S
               skipped (CrispPlan.aux_skip_weight); --revive (session 14): an auxiliary the plan skips runs at
               what its expert holds (AuxSkipped.RESIDENT); --windows: other windows than 128 x 256 (session 9's
               50% decodes used 32 x 128)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from crisp_bench.profiles import get_profile
from crisp_tools import serving_eval
from crisp_tools.evaluate import Evaluator

from crisp_runtime.execution.runtime import plan_for_layers
from crisp_runtime.planning.serving import AuxNarrower, AuxSkipped, resident_policy
from crisp_runtime.scheduling.prefetch import PrefetchPolicy
from crisp_runtime.storage.pack import CrispPack

MODEL, REFERENCE, HELDOUT = "models/tiny-mixtral", "models/tiny-mixtral-crisp", ["data/stdlib-heldout.txt"]
SAMPLES, SEQ_LEN = 128, 256


def case(floor: float, narrow_only: bool = False, revive: bool = False) -> serving_eval.ServingCase:
    """What crisp-eval --mode decode names crisp-resident-floorF+prefetch (serving_eval.default_cases); with
    ``narrow_only`` the auxiliaries the plan wants whole are widened (AuxNarrower.NARROW_ONLY, session 11); with
    ``revive`` an auxiliary the plan skips runs at what its expert holds (AuxSkipped.RESIDENT, session 14)."""
    policy = resident_policy(floor, AuxNarrower.NARROW_ONLY if narrow_only else AuxNarrower.RESIDENT,
                             AuxSkipped.RESIDENT if revive else AuxSkipped.SKIP)
    return serving_eval.ServingCase(f"crisp-{policy.name}+prefetch", "crisp", policy, PrefetchPolicy())


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("pack")
    p.add_argument("budget", type=float)
    p.add_argument("floors", nargs="*", type=float)
    p.add_argument("--stored-serving", action="store_true",
                   help="decode the serving choice PACK stores (crisp_tools.plan_throughput / --plan-for-throughput: "
                        "its policy, prefetch and eviction; what crisp-eval --mode decode --stored-serving runs) "
                        "instead of FLOORs")
    p.add_argument("--cap", type=int, default=None)
    p.add_argument("--aux-full-weight", type=float, default=None)
    p.add_argument("--aux-skip-weight", type=float, default=None)
    p.add_argument("--narrow-only", action="store_true")
    p.add_argument("--revive", action="store_true")
    p.add_argument("--windows", type=int, nargs=2, default=(SAMPLES, SEQ_LEN), metavar=("N", "L"))
    args = p.parse_args()
    out, pack_dir, budget = args.out, args.pack, args.budget
    if out.exists():
        sys.exit(f"error: {out} exists; refusing to overwrite it")
    t0 = time.time()
    ev = Evaluator(MODEL, pack_dir, HELDOUT, samples=args.windows[0], seq_len=args.windows[1], quiet=True,
                   reference_dir=REFERENCE)
    pack_plan = ev.pack_plan
    if args.cap is not None:
        pack_plan = pack_plan.capped(args.cap)
    if args.aux_full_weight is not None:
        pack_plan = pack_plan.promoted(args.aux_full_weight)
    if args.aux_skip_weight is not None:
        pack_plan = pack_plan.skipping(args.aux_skip_weight)
    plan = plan_for_layers(pack_plan, ev.layers)  # in the pack's storage rows
    window = ev.prefetch_window(get_profile("rtx4090-pcie4"), "mixtral-8x7b")
    if args.stored_serving:
        from crisp_tools.evaluate import stored_case

        stored, rec = stored_case(ev.info, str(Path(pack_dir) / "pack.json"))
        if rec.gpu_budget_fraction != budget:
            sys.exit(f"error: the pack's stored choice is at {rec.gpu_budget_fraction:g}, not {budget:g}")
        cases = serving_eval.with_window([stored], window)
    elif not args.floors:
        sys.exit("error: give FLOOR(s) or --stored-serving")
    else:
        cases = serving_eval.with_window([case(f, args.narrow_only, args.revive) for f in args.floors], window)
    with ev._runtime_runner(*ev.reference) as run:  # the 4-bit full width, batch (= its decode: exact serving)
        full, _ = run(ev._plan("full", next(iter(ev.reference[0].values())).intermediate_size))
    print(f"4-bit full width (batch): acc {full.accuracy:.4f} ({time.time() - t0:.0f} s)", flush=True)
    pack = CrispPack(ev.layers, plan, ev.info)
    total = serving_eval.total_expert_bytes(ev.reference[0])  # fractions of the 4-bit bytes: equal GPU memory
    records = []
    for c in cases:
        t1 = time.time()
        scores, stats = serving_eval.run_case(ev.model, pack, plan, ev.windows, int(budget * total), c)
        rec = serving_eval.record(c, budget, int(budget * total), scores, stats, full, plan, time.time() - t1,
                                  ev.neurons)
        records.append(rec)
        print(f"{c.name} @ {budget:.0%}: loss {rec['accuracy_loss']:.2%} copied/token "
              f"{rec['bytes_copied_per_token']:,.0f} ({time.time() - t1:.0f} s)", flush=True)
    meta = {"model": MODEL, "crisp": pack_dir, "plan_widths_sha256": ev.plan_digest, "tail_layout": ev.tail_layout,
            "reference_crisp": REFERENCE, "data": HELDOUT, "windows": list(ev.windows.shape),
            "tokens_evaluated": int(full.nll.numel()),
            "full_width": {"accuracy": full.accuracy, "perplexity": full.perplexity,
                           "source": "batch evaluation of the 4-bit reference pack (exact serving)"},
            "budgets": [budget], "total_expert_bytes": total, "elapsed_s": round(time.time() - t0, 1),
            "prefetch_window": window.to_dict(),
            "notes": ["teacher-forced decode through crisp_runtime.apply (docs/sim-s10-long-decode.py)"]}
    serving_eval.write_serving_json(out, records, meta)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
