"""Session 14 (issue 10): three-band CRISP plans against skip-auxiliary and uniform at 10 / 25 / 50%.

A three-band plan (``CrispPlan.aux_skip_weight`` S and ``aux_full_weight`` W, optionally ``width_cap``) skips an
auxiliary of routing weight < S, runs one of weight >= W whole, and the ones between at the tiers' widths (here the
Warm 64 / Cold 32 2g128@0.25 tail pack of sessions 11-13). With S = W = t it is skip-auxiliary at t (tests/
test_plan.py::test_equal_thresholds_make_skip_aux), so the family holds skip-aux's points; the question is whether
its points between the bands lie above them.

Two steps, both the product's code:

    # 1. losses at the plan's widths (exact serving: outputs independent of the cache, so one batch run per
    #    configuration is its decode; tests/test_evaluate.py), 128 held-out windows x 256 tokens, each with the
    #    window-clustered standard error (crisp_tools.loss_estimate); ~3 s per configuration
    python -m crisp_tools.tail_pack --model models/tiny-mixtral --crisp models/tiny-mixtral-crisp \\
        --layout 2g128@0.25 --out /tmp/pack-64-32 --tier-widths 256,64,32 --quiet
    PYTHONPATH=. python docs/sim-s14-three-band.py batch /tmp/pack-64-32 docs/eval-s14-three-band-128x256.json
    #    (and with --data data/stdlib-calib.txt: the same configurations on the calibration text)
    # 2. tokens/s: one `crisp-bench simulate` per configuration and budget (the plan written by `plans`), e.g.
    PYTHONPATH=. python docs/sim-s14-three-band.py plans /tmp/pack-64-32 /tmp/plans
    crisp-bench simulate --trace docs/bench-trace-heldout-predicted.npz --pack /tmp/pack-64-32 \\
        --plan /tmp/plans/s0.3-w0.45-cnone.json --tail-layout 2g128@0.25 --budget 0.1 --policies crisp \\
        --serving plan --prefetch trace --orders widest_first --json SIM.json
    # 3. the paired differences behind the coverings (held-out and calibration text)
    PYTHONPATH=. python docs/sim-s14-three-band.py paired /tmp/pack-64-32 [--data data/stdlib-calib.txt]
    # 4. the check: every uniform / skip-aux point against the fastest CRISP point at or below its loss
    PYTHONPATH=. python docs/sim-s14-three-band.py check docs/eval-s14-three-band-128x256.json \\
        --sims SIM.json ... [--decoded DECODE.json ...] [--json docs/bench-simulate-s14-three-band.json] \\
        [--calibration docs/eval-s14-three-band-calib-128x256.json]

The check attaches a loss to a simulated record only through ``bench.sim_policies.accuracy_for`` (the same
thresholds, cap and, for residency-aware serving, the same serving policy, budget and prefetch: a decode of
docs/sim-s10-long-decode.py). The full-width LRU each speed is divided by is the committed frontier simulations'
(same trace, profile and budget); the uniform / skip-aux points and session 11-13's CRISP points are those of
docs/sim-s13-frontier-check.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL, REFERENCE, HELDOUT = "models/tiny-mixtral", "models/tiny-mixtral-crisp", ["data/stdlib-heldout.txt"]
SAMPLES, SEQ_LEN = 128, 256
# (S = aux_skip_weight, W = aux_full_weight, cap in neurons); None: not set. W >= 0.5 is no promotion at top-2.
CONFIGS = [(s, w, None) for w in (0.3, 0.35, 0.4, 0.45) for s in (0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4) if s <= w]
CONFIGS += [(s, None, None) for s in (0.1, 0.2, 0.3, 0.4)]
CONFIGS += [(0.2, 0.2, None), (0.5, 0.5, None)]  # = skip-aux at 0.2 and "always": the machinery's check
CONFIGS += [(s, w, cap) for cap in (240, 224, 208, 192, 160, 128)
            for s, w in ((None, None), (0.2, 0.4), (0.3, 0.4), (0.35, 0.4), (0.3, 0.3), (0.4, 0.4), (0.5, 0.5))]


# (three-band point, the skip-aux point it covers at 10 / 50%): their paired difference per text (`paired`)
PAIRS = [((0.15, 0.3, None), (0.2, 0.2, None)), ((0.25, 0.4, None), (0.3, 0.3, None)),
         ((0.35, 0.45, None), (0.4, 0.4, None)), ((0.3, 0.45, None), (0.4, 0.4, None)),
         ((0.3, 0.4, 192), (0.5, 0.5, None))]


def _config_plan(plan, s, w, cap):
    """``plan`` with the configuration's skip weight S, auxiliary weight W and cap (None: not set)."""
    return plan.promoted(w).skipping(s).capped(cap)


def _name(s, w, cap) -> str:
    def f(v):
        return "none" if v is None else f"{v:g}"
    return f"s{f(s)}-w{f(w)}-c{f(cap)}"


def _frontier_check():
    spec = importlib.util.spec_from_file_location("sim_s13_frontier_check", ROOT / "docs" / "sim-s13-frontier-check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cmd_plans(args) -> int:
    from crisp_runtime.planning.plan import CrispPlan

    base = CrispPlan.load(Path(args.pack) / "plan.json")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for s, w, cap in CONFIGS:
        path = out / f"{_name(s, w, cap)}.json"
        if not path.exists():
            _config_plan(base, s, w, cap).save(path)
    print(f"wrote {len(CONFIGS)} plans to {out}")
    return 0


def cmd_batch(args) -> int:
    from crisp_tools.evaluate import Evaluator
    from crisp_tools.loss_estimate import relative_loss

    from crisp_runtime.execution.runtime import plan_for_layers

    out = Path(args.out)
    if out.exists():
        sys.exit(f"error: {out} exists; refusing to overwrite it")
    t0 = time.time()
    ev = Evaluator(MODEL, args.pack, args.data, samples=SAMPLES, seq_len=SEQ_LEN, quiet=True, reference_dir=REFERENCE)
    with ev._runtime_runner(*ev.reference) as run:  # the 4-bit full width: the reference every loss is paired with
        full, _ = run(ev._plan("full", next(iter(ev.reference[0].values())).intermediate_size))
    records = []
    with ev._runtime_runner() as run:
        for n, (s, w, cap) in enumerate(CONFIGS, 1):
            plan = _config_plan(ev.pack_plan, s, w, cap)
            scores, bpt = run(plan_for_layers(plan, ev.layers))
            est = relative_loss(full.correct, scores.correct)
            records.append({"policy": "crisp", "label": _name(s, w, cap), "aux_skip_weight": s, "aux_full_weight": w,
                            "width_cap": cap, "relative_accuracy_loss_vs_full": est.loss,
                            "accuracy_loss_se": est.standard_error, "windows": est.windows,
                            "bytes_per_token": bpt, "plan_widths_sha256": plan.widths_digest()})
            print(f"[{n}/{len(CONFIGS)} {time.time() - t0:4.0f}s] {_name(s, w, cap)}: loss {est.loss:.2%} +- "
                  f"{est.standard_error:.2%}, {bpt:,.0f} B/token", flush=True)
    doc = {"model": MODEL, "crisp": str(args.pack), "tail_layout": ev.tail_layout, "reference_crisp": REFERENCE,
           "data": args.data, "windows": list(ev.windows.shape), "base_plan_widths_sha256": ev.plan_digest,
           "full_width": {"accuracy": full.accuracy, "source": "batch run of the 4-bit reference pack"},
           "elapsed_s": round(time.time() - t0, 1),
           "notes": ["batch runs at the plans' widths (exact serving) through crisp_runtime.apply "
                     "(docs/sim-s14-three-band.py)"],
           "records": records}
    _write_new(out, doc)
    return 0


def cmd_paired(args) -> int:
    """Each PAIRS' three-band point against its skip-aux point on the same windows: the relative accuracy of the
    first over the second (paired, window-clustered standard error), and their bytes per token."""
    from crisp_tools.evaluate import Evaluator
    from crisp_tools.loss_estimate import relative_loss

    from crisp_runtime.execution.runtime import plan_for_layers

    ev = Evaluator(MODEL, args.pack, args.data, samples=SAMPLES, seq_len=SEQ_LEN, quiet=True, reference_dir=REFERENCE)
    print(f"{args.data}: {tuple(ev.windows.shape)} windows; loss of A relative to B (B's hits as the reference)")
    with ev._runtime_runner() as run:
        for a, b in PAIRS:
            got = {}
            for cfg in (a, b):
                got[cfg] = run(plan_for_layers(_config_plan(ev.pack_plan, *cfg), ev.layers))
            est = relative_loss(got[b][0].correct, got[a][0].correct)
            print(f"  A {_name(*a):18s} vs B {_name(*b):18s}: {est.loss:+.2%} +- {est.standard_error:.2%} "
                  f"(A's bytes / B's {got[a][1] / got[b][1]:.3f})", flush=True)
    return 0


def cmd_check(args) -> int:
    from bench.sim_policies import accuracy_for, read_accuracy

    fc = _frontier_check()
    s10 = fc._s10()
    evaluated, _ = read_accuracy([args.batch, *args.decoded], MODEL)
    base_files = {"10": fc.FILES["10"]["256/64/32"], "25": fc.FILES_25["256/64/32"], "50": fc.FILES["50"]["256/64/32"]}
    base = {}
    for budget, path in base_files.items():
        doc = json.loads(path.read_text())
        base[budget] = next(r["tokens_per_s"] for r in doc["records"] if r["label"] == "full/plan/lru"
                            and r["order"] == "router" and r.get("tail_layout", "q4") == "q4")
    rows = {b: [] for b in base}
    merged = []
    for path in args.sims:
        doc = json.loads(Path(path).read_text())
        for r in doc["records"]:
            if r["policy"] != "crisp" or r["order"] != "widest_first":
                continue
            budget = f"{round(100 * r['budget_fraction'])}"
            loss, source = accuracy_for(r, evaluated)
            name = _name(r.get("aux_skip_weight"), r.get("aux_full_weight"), r.get("width_cap"))
            x = r["tokens_per_s"] / base[budget]
            merged.append({"budget_fraction": r["budget_fraction"], "config": name, "serving": r["serving"],
                           "serving_policy": r["serving_policy"], "prefetch": r["prefetch"],
                           "tokens_per_s": r["tokens_per_s"], "x_full_width_lru": x,
                           "mb_copied_per_token": r["bytes_per_token"] / 1e6, "hit_rate": r["hit_rate"],
                           "accuracy_loss": loss, "accuracy_source": source, "simulation": str(path)})
            if loss is not None:
                rows[budget].append({"family": "crisp three-band", "note": f"{name} {r['serving']}", "x": x,
                                     "loss": loss})
    earlier = {"10": s10.points(fc.FILES["10"]),
               "25": s10.points(fc.FILES_25) + fc.product_points(fc.W033_25, "256/64/32"),
               "50": s10.points(fc.FILES["50"])}
    for budget in ("10", "25", "50"):
        mine = sorted(rows[budget], key=lambda r: r["loss"])
        print(f"{budget}% of the 4-bit expert bytes: three-band CRISP points (x full-width LRU, loss)")
        for r in mine:
            print(f"  {r['note']:48s} {r['x']:5.2f}x at {100 * r['loss']:5.2f}%")
        print("  each uniform / skip-aux point against every CRISP point (sessions 11-14; loss <= and tokens/s >=):")
        print("\n".join(s10.check(earlier[budget] + mine)))
        if args.calibration:
            print(_chosen_on_calibration(args.batch, args.calibration, merged, earlier[budget], budget))
    if args.json:
        _write_new(Path(args.json), {"format": "crisp-s14-three-band", "full_width_lru_tokens_per_s": base,
                                "full_width_lru_source": {b: str(p) for b, p in base_files.items()},
                                "accuracy": [str(args.batch), *map(str, args.decoded)], "records": merged})
    return 0


def _chosen_on_calibration(batch: str, calibration: str, merged: list[dict], earlier: list[dict], budget: str) -> str:
    """For each skip-aux point with an S = W configuration in both batch files: the fastest simulated three-band
    point at the plan's widths whose loss on the calibration text is at most skip-aux's there, and its held-out
    loss and speed against skip-aux's (the choice made on other text than the one that reports it)."""
    held = {r["label"]: r["relative_accuracy_loss_vs_full"] for r in json.loads(Path(batch).read_text())["records"]}
    calib = {r["label"]: r["relative_accuracy_loss_vs_full"]
             for r in json.loads(Path(calibration).read_text())["records"]}
    skip_x = {r["note"]: r["x"] for r in earlier if r["family"] == "skip_aux"}
    lines = ["  chosen on the calibration text (fastest simulated three-band point at <= skip-aux's calibration loss):"]
    for t, note in ((0.2, "t0.2"), (0.3, "t0.3"), (0.4, "t0.4"), (0.5, "always")):
        own = _name(t, t, None)
        if own not in calib or note not in skip_x:
            continue
        ok = [r for r in merged if r["serving"] == "plan" and f"{round(100 * r['budget_fraction'])}" == budget
              and r["config"] != own and r["config"] in calib and calib[r["config"]] <= calib[own]]
        best = max(ok, key=lambda r: r["x_full_width_lru"], default=None)
        head = (f"    skip-aux {note:6s} {skip_x[note]:.2f}x, held-out {100 * held[own]:.2f}%, calibration "
                f"{100 * calib[own]:.2f}%: ")
        if best is None:
            lines.append(head + "no three-band point at or below its calibration loss")
            continue
        c = best["config"]
        verdict = "covers it" if best["x_full_width_lru"] >= skip_x[note] and held[c] <= held[own] else "does not"
        lines.append(head + f"{c} {best['x_full_width_lru']:.2f}x, held-out {100 * held[c]:.2f}%, calibration "
                     f"{100 * calib[c]:.2f}%: {verdict}")
    return "\n".join(lines)


def _write_new(out: Path, doc: dict) -> None:
    """``doc`` as JSON at ``out``, atomically; never over an existing file."""
    from crisp_runtime.storage.outputs import write_atomic

    if out.exists():
        sys.exit(f"error: {out} exists; refusing to overwrite it")
    text = json.dumps(doc, indent=1)
    write_atomic(out, lambda tmp: Path(tmp).write_text(text))
    print(f"wrote {out}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("batch", help="batch losses of every configuration")
    b.add_argument("pack", help="the Warm 64 / Cold 32 2g128@0.25 tail pack")
    b.add_argument("out", help="new JSON file")
    b.add_argument("--data", nargs="+", default=HELDOUT, help="evaluation text (default: the held-out text; "
                   "data/stdlib-calib.txt for the check that a point's place holds on other text)")
    pl = sub.add_parser("plans", help="write every configuration's plan JSON (for crisp-bench simulate --plan)")
    pl.add_argument("pack")
    pl.add_argument("out", help="folder")
    pr = sub.add_parser("paired", help="PAIRS: each three-band point against its skip-aux point, paired")
    pr.add_argument("pack")
    pr.add_argument("--data", nargs="+", default=HELDOUT)
    c = sub.add_parser("check", help="attach losses to simulations; the frontier check")
    c.add_argument("batch", help="the batch JSON of `batch`")
    c.add_argument("--sims", nargs="+", required=True, help="crisp-bench simulate --json files")
    c.add_argument("--decoded", nargs="*", default=[], help="decodes (docs/sim-s10-long-decode.py) of residency-"
                   "aware configurations")
    c.add_argument("--json", default=None, help="write the merged records here (new file)")
    c.add_argument("--calibration", default=None, help="the batch JSON of `batch --data data/stdlib-calib.txt`: "
                   "also choose the points on the calibration text")
    args = p.parse_args()
    return {"batch": cmd_batch, "plans": cmd_plans, "paired": cmd_paired, "check": cmd_check}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
