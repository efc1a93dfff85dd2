"""Session 9 (issue 10): the 25% frontier on a 2-bit tail pack with every loss from the same held-out windows.

Reads the frontier simulations of four tail packs (2g128@0.25 at CRISP tier widths 256/64/32, 256/96/32,
256/128/64 and 256/192/96; `crisp-bench simulate --matrix frontier --tail-layout 2g128@0.25`) whose accuracy
files all evaluate the same 64 held-out windows x 128 tokens: the decodes through the runtime with the prefetch window
(`crisp-eval --mode decode --budgets 0.25 --prefetch-window rtx4090-pcie4`, residency-aware CRISP) and the batch
frontier evaluation (`crisp-eval --frontier --samples 64 --seq-len 128`, uniform and skip-aux, exact serving).
Prints the table and plots tokens/s over 4-bit full-width LRU against the loss, one line per family.

    PYTHONPATH=. python docs/sim-s9-same-window-frontier.py     (a second; writes the PNG below, never over one)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "docs"
RUNS = {"256/64/32": ROOT / "bench-simulate-tail-pack-frontier-25.json",
        "256/96/32": ROOT / "bench-simulate-tail-pack-96-32-frontier-25.json",
        "256/128/64": ROOT / "bench-simulate-tail-pack-128-64-frontier-25.json",
        "256/192/96": ROOT / "bench-simulate-tail-pack-192-96-frontier-25.json"}
OUT_PNG = ROOT / "bench-simulate-tail-pack-same-window-frontier-25.png"


def points() -> list[dict]:
    out = []
    for tiers, path in RUNS.items():
        doc = json.loads(path.read_text())
        base = next(r["tokens_per_s"] for r in doc["records"] if r["label"] == "full/plan/lru"
                    and r["order"] == "router" and r.get("tail_layout", "q4") == "q4")
        for r in doc["records"]:
            if r["order"] != "widest_first" or r["accuracy_loss"] is None or r["policy"] == "full":
                continue
            if r["policy"] != "crisp" and tiers != "256/64/32":
                continue  # uniform / skip-aux do not depend on the CRISP plan: drawn once
            out.append({"family": r.get("family", r["policy"]), "tiers": tiers, "label": r["label"],
                        "knob": r.get("knob_value"), "x": r["tokens_per_s"] / base, "loss": r["accuracy_loss"]})
    return out


def main() -> int:
    if OUT_PNG.exists():
        sys.exit(f"error: {OUT_PNG} exists; refusing to overwrite it")
    rows = points()
    for r in sorted(rows, key=lambda r: (r["family"], r["loss"])):
        print(f"{r['family']:24s} {r['tiers']:11s} {r['label']:52s} {r['x']:5.2f}x  {100 * r['loss']:5.2f}%")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    colors = {"crisp residency-aware": "tab:orange", "crisp plan widths": "tab:red", "uniform": "tab:blue",
              "skip_aux": "tab:green"}
    for family, color in colors.items():
        pts = sorted((r for r in rows if r["family"] == family), key=lambda r: r["loss"])
        if family.startswith("crisp"):
            ax.scatter([100 * r["loss"] for r in pts], [r["x"] for r in pts], color=color, label=family, s=40)
            for r in pts:
                note = r["tiers"].split("/", 1)[1] + ("" if r["knob"] in (None, "plan") else f" f{r['knob']:g}")
                ax.annotate(note, (100 * r["loss"], r["x"]), fontsize=7, xytext=(4, -9), textcoords="offset points")
        else:
            ax.plot([100 * r["loss"] for r in pts], [r["x"] for r in pts], "o-", color=color, label=family, ms=5)
    ax.axvline(2.0, ls=":", color="gray")
    ax.axhline(2.5, ls=":", color="gray")
    ax.set_xlim(0, 8)
    ax.set_xlabel("relative next-token accuracy loss vs 4-bit full width (%), the same 64 held-out windows x 128")
    ax.set_ylabel("tokens/s over 4-bit full-width LRU (simulated)")
    ax.set_title("25%, RTX 4090 + PCIe 4.0, Mixtral-8x7B sizes: tail pack 2g128@0.25, LRU + prefetch", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(OUT_PNG, dpi=110)
    print(f"wrote {OUT_PNG}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
