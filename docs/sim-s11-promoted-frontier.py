"""Session 11 (issue 10): the 25% frontier with weight-promoted CRISP (``CrispPlan.aux_full_weight``), every loss
from the 128 held-out windows x 256 tokens.

Reads frontier simulations (`crisp-bench simulate --matrix frontier --tail-layout 2g128@0.25`, LRU + prefetch for
every family, the committed predicted trace, rtx4090-pcie4 at Mixtral-8x7B sizes) of three tail packs (CRISP tier
widths 256/64/32, 256/128/64, 256/192/96) whose accuracy files are batch frontier evaluations (`crisp-eval
--frontier`: uniform, skip-aux, CRISP at the plan's widths, capped, weight-promoted) and decodes of residency-aware
CRISP through the runtime (`docs/sim-s10-long-decode.py`, with `--aux-full-weight` / `--narrow-only` this session).

For every uniform and skip-aux point it names the CRISP point at or above it (loss <= and tokens/s >=), or says
none is: "at or above everywhere" in the step (Pareto) sense. Plots tokens/s over 4-bit full-width LRU against
the loss.

    PYTHONPATH=. python docs/sim-s11-promoted-frontier.py      (a second; writes the PNG below, never over one)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "docs"
FILES = {"256/64/32": ROOT / "bench-simulate-tail-pack-s11-64-32-frontier-25.json",
         "256/128/64": ROOT / "bench-simulate-tail-pack-s11-128-64-frontier-25.json",
         "256/192/96": ROOT / "bench-simulate-tail-pack-s11-192-96-frontier-25.json"}
PNG = ROOT / "bench-simulate-tail-pack-s11-frontier-25.png"
BASELINES = ("uniform", "skip_aux")
COLORS = {"crisp residency-aware": "tab:orange", "crisp plan widths": "tab:red", "crisp capped": "tab:purple",
          "crisp capped residency-aware": "tab:brown", "crisp weight-promoted": "tab:pink",
          "crisp weight-promoted residency-aware": "tab:olive", "uniform": "tab:blue", "skip_aux": "tab:green"}


def _s10():
    """docs/sim-s10-capped-frontier.py's points / check (one implementation; its file name is not a module name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sim_s10_capped_frontier", ROOT / "sim-s10-capped-frontier.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    if PNG.exists():
        sys.exit(f"error: {PNG} exists; refusing to overwrite it")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from crisp_bench.report import write_atomic

    s10 = _s10()
    rows = s10.points(FILES)
    print("25% of the 4-bit expert bytes, 128 x 256 held-out windows")
    for r in sorted(rows, key=lambda r: (r["family"], r["loss"])):
        print(f"  {r['family']:38s} {r['note']:30s} {r['x']:5.2f}x  {100 * r['loss']:5.2f}%")
    print("each uniform / skip-aux point against CRISP's (loss <= and tokens/s >=):")
    print("\n".join(s10.check(rows)))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.8), gridspec_kw={"width_ratios": [3, 2]})
    for ax, (xmax, ylim, notes) in zip(axes, ((1.6, (2.15, 2.8), True), (10.0, (2.0, 5.0), False)), strict=True):
        for family, color in COLORS.items():
            pts = sorted((r for r in rows if r["family"] == family and r["loss"] * 100 <= xmax),
                         key=lambda r: r["loss"])
            if not pts:
                continue
            if family in BASELINES:
                ax.plot([100 * r["loss"] for r in pts], [r["x"] for r in pts], "o-", color=color, label=family, ms=5)
            else:
                ax.scatter([100 * r["loss"] for r in pts], [r["x"] for r in pts], color=color, label=family, s=26)
            if notes:
                for r in pts:
                    if ylim[0] <= r["x"] <= ylim[1]:
                        ax.annotate(r["note"], (100 * r["loss"], r["x"]), fontsize=5, xytext=(3, -6),
                                    textcoords="offset points")
        ax.axvline(2.0, ls=":", color="gray")
        ax.axhline(2.5, ls=":", color="gray")
        ax.set_xlim(0.4 if notes else 0, xmax)
        ax.set_ylim(*ylim)
        ax.set_xlabel("relative next-token accuracy loss vs 4-bit full width (%), 128 x 256 held-out windows",
                      fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens/s over 4-bit full-width LRU (simulated)")
    axes[0].set_title("below 1.6% loss (zoom)", fontsize=9)
    axes[1].set_title("every point up to 10% loss", fontsize=9)
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle("25%, RTX 4090 + PCIe 4.0, Mixtral-8x7B sizes: tail pack 2g128@0.25, LRU + prefetch", fontsize=10)
    fig.tight_layout()
    write_atomic(PNG, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
    print(f"wrote {PNG}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
