"""Session 10 (issue 10): the frontier on a 2-bit tail pack with CRISP under a width cap, every loss from one set
of held-out windows per budget.

Reads frontier simulations (`crisp-bench simulate --matrix frontier --tail-layout 2g128@0.25`, LRU + prefetch for
every family, the committed predicted trace, rtx4090-pcie4 at Mixtral-8x7B sizes) of three tail packs (CRISP tier
widths 256/64/32, 256/128/64, 256/192/96), whose accuracy files evaluate:

- 25%: the 128 held-out windows x 256 tokens (32,640 predictions, one standard error ~0.35 point): batch frontier
  evaluations (`crisp-eval --frontier`: uniform, skip-aux, CRISP at the plan's widths and capped) and decodes of
  residency-aware CRISP through the runtime (`docs/sim-s10-long-decode.py`);
- 50%: session 9's 32 windows x 128 tokens (4,064 predictions, ~0.7 point), its decodes plus this session's
  capped residency-aware decodes.

For every uniform and skip-aux point it names the CRISP point at or above it (loss <= and tokens/s >=), or says
none is: "at or above everywhere" in the step (Pareto) sense. Plots tokens/s over 4-bit full-width LRU against
the loss.

    PYTHONPATH=. python docs/sim-s10-capped-frontier.py      (a second; writes the PNGs below, never over one)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "docs"
RUNS = {
    "25": {"windows": "128 x 256", "files": {
        "256/64/32": ROOT / "bench-simulate-tail-pack-s10-64-32-frontier-25.json",
        "256/128/64": ROOT / "bench-simulate-tail-pack-s10-128-64-frontier-25.json",
        "256/192/96": ROOT / "bench-simulate-tail-pack-s10-192-96-frontier-25.json"}},
    "50": {"windows": "32 x 128", "files": {
        "256/64/32": ROOT / "bench-simulate-tail-pack-s10-64-32-frontier-50.json"}},
}
CRISP = ("crisp residency-aware", "crisp plan widths", "crisp capped", "crisp capped residency-aware")
BASELINES = ("uniform", "skip_aux")  # every other family is a CRISP one
COLORS = {"crisp residency-aware": "tab:orange", "crisp plan widths": "tab:red", "crisp capped": "tab:purple",
          "crisp capped residency-aware": "tab:brown", "uniform": "tab:blue", "skip_aux": "tab:green"}


def points(files: dict[str, Path]) -> list[dict]:
    out, seen = [], set()
    for tiers, path in files.items():
        doc = json.loads(path.read_text())
        base = next(r["tokens_per_s"] for r in doc["records"] if r["label"] == "full/plan/lru"
                    and r["order"] == "router" and r.get("tail_layout", "q4") == "q4")
        for r in doc["records"]:
            if r["order"] != "widest_first" or r["accuracy_loss"] is None or not r.get("family"):
                continue
            family = r["family"]
            key = (family, r["label"]) if family in BASELINES else (family, tiers, r["label"])
            if key in seen:
                continue  # uniform / skip-aux do not depend on the CRISP plan: once
            seen.add(key)
            knob = r.get("knob_value")
            cap = r.get("width_cap")
            note = f"{tiers.split('/', 1)[1]}" if family not in BASELINES else (
                f"w{knob}" if family == "uniform" else "always" if knob is None else f"t{knob:.3g}")
            if family not in BASELINES:
                if cap is not None:
                    note += f" cap{cap}"
                if r.get("aux_full_weight") is not None:  # session 11's weight-promoted families
                    note += f" aux{r['aux_full_weight']:g}"
                if family.endswith("residency-aware"):
                    note += f" f{r['dominant_floor']:g}"
                    if r["serving_policy"].get("aux_narrower") == "narrow_only":
                        note += " narrow-only"
            out.append({"family": family, "note": note, "x": r["tokens_per_s"] / base, "loss": r["accuracy_loss"]})
    return out


def check(rows: list[dict]) -> list[str]:
    """For each uniform / skip-aux point, the fastest CRISP point (any other family) at or below its loss."""
    crisp = [r for r in rows if r["family"] not in BASELINES]
    lines = []
    for r in sorted((r for r in rows if r["family"] in BASELINES), key=lambda r: r["loss"]):
        best = max((c for c in crisp if c["loss"] <= r["loss"] + 1e-12), key=lambda c: c["x"], default=None)
        ok = best is not None and best["x"] >= r["x"] - 1e-9
        what = "none at or below its loss" if best is None else (
            f"{best['family']} {best['note']}: {best['x']:.2f}x at {100 * best['loss']:.2f}%")
        lines.append(f"  {r['family']:8s} {r['note']:7s} {r['x']:5.2f}x at {100 * r['loss']:5.2f}%  "
                     f"{'covered by' if ok else 'NOT covered; best CRISP at <= its loss:'} {what}")
    return lines


def main() -> int:
    for budget in RUNS:
        png = ROOT / f"bench-simulate-tail-pack-s10-frontier-{budget}.png"
        if png.exists():
            sys.exit(f"error: {png} exists; refusing to overwrite it")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from crisp_bench.report import write_atomic

    for budget, run in RUNS.items():
        rows = points(run["files"])
        print(f"\n{budget}% of the 4-bit expert bytes, {run['windows']} held-out windows")
        for r in sorted(rows, key=lambda r: (r["family"], r["loss"])):
            print(f"  {r['family']:30s} {r['note']:18s} {r['x']:5.2f}x  {100 * r['loss']:5.2f}%")
        print("each uniform / skip-aux point against CRISP's (loss <= and tokens/s >=):")
        print("\n".join(check(rows)))
        fig, ax = plt.subplots(figsize=(8.5, 5.5))
        for family, color in COLORS.items():
            pts = sorted((r for r in rows if r["family"] == family), key=lambda r: r["loss"])
            if not pts:
                continue
            if family in CRISP:
                ax.scatter([100 * r["loss"] for r in pts], [r["x"] for r in pts], color=color, label=family, s=36)
                for r in pts:
                    ax.annotate(r["note"], (100 * r["loss"], r["x"]), fontsize=6, xytext=(4, -8),
                                textcoords="offset points")
            else:
                ax.plot([100 * r["loss"] for r in pts], [r["x"] for r in pts], "o-", color=color, label=family, ms=5)
        ax.axvline(2.0, ls=":", color="gray")
        ax.axhline(2.5, ls=":", color="gray")
        ax.set_xlim(0, 7)
        ax.set_xlabel(f"relative next-token accuracy loss vs 4-bit full width (%), {run['windows']} held-out windows")
        ax.set_ylabel("tokens/s over 4-bit full-width LRU (simulated)")
        ax.set_title(f"{budget}%, RTX 4090 + PCIe 4.0, Mixtral-8x7B sizes: tail pack 2g128@0.25, LRU + prefetch",
                     fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        png = ROOT / f"bench-simulate-tail-pack-s10-frontier-{budget}.png"
        write_atomic(png, lambda tmp, fig=fig: fig.savefig(tmp, format="png", dpi=110))
        plt.close(fig)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
