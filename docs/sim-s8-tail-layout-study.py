"""Session 8 (issue 10): importance-ordered tail layouts, measured with the product's tools only.

For each tail layout (crisp_kernels.tail_layout) x CRISP tier widths: the tail emulated inside the
4-bit format (python -m crisp_tools.tail_emulation), its accuracy measured by crisp-eval on 128
held-out windows against the 4-bit pack's full width (--reference-crisp), then crisp-bench simulate
--tail-layout on the committed predicted trace (rtx4090-pcie4, Mixtral-8x7B sizes) with that
accuracy attached. Every configuration here serves the plan's widths (exact serving), so the batch
evaluation is the runtime-in-the-loop one (tests/test_evaluate.py checks they agree).

    PYTHONPATH=. python docs/sim-s8-tail-layout-study.py [WORKDIR]     (~25 min on 2 cores)

Writes docs/bench-simulate-tail-layouts.json and docs/bench-simulate-tail-layouts-25.png.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL, PACK = "models/tiny-mixtral", "models/tiny-mixtral-crisp"
HELDOUT, TRACE = "data/stdlib-heldout.txt", "docs/bench-trace-heldout-predicted.npz"
LAYOUTS = ["q4", "m432", "m42", "q3", "2g128@0.25"]
TIERS = ["256,40,0", "256,40,16", "256,64,32"]  # the pack's plan has 256,40,0
BUDGETS = [0.1, 0.25, 0.5]
OUT_JSON = ROOT / "docs" / "bench-simulate-tail-layouts.json"
OUT_PNG = ROOT / "docs" / "bench-simulate-tail-layouts-25.png"


def sh(args: list[str]) -> None:
    t0 = time.time()
    subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    print(f"  {time.time() - t0:5.1f}s  {' '.join(args[:4])} ...", flush=True)


def main() -> int:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/crisp-s8-tail-study")
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for layout in LAYOUTS:
        for tiers in TIERS:
            tag = f"{layout.replace('@', 'at')}-{tiers.replace(',', '-')}"
            pack = work / f"pack-{tag}"
            if layout == "q4" and tiers == TIERS[0]:
                pack = ROOT / PACK
            elif not pack.exists():
                sh([sys.executable, "-m", "crisp_tools.tail_emulation", "--model", MODEL, "--crisp", PACK, "--layout",
                    layout, "--tier-widths", tiers, "--out", str(pack), "--quiet"])
            ev = work / f"eval-{tag}.json"
            if not ev.exists():
                ref = [] if layout == "q4" else ["--reference-crisp", PACK]
                sh(["crisp-eval", "--model", MODEL, "--crisp", str(pack), *ref, "--data", HELDOUT, "--samples", "128",
                    "--seq-len", "256", "--json", str(ev), "--quiet", "--threads", "2"])
            for b in BUDGETS:
                sim = work / f"sim-{tag}-{b:g}.json"
                if not sim.exists():
                    policies = "full,crisp,uniform,skip_aux" if b == 0.25 else "full,crisp"
                    sh(["crisp-bench", "simulate", "--trace", TRACE, "--plan", str(pack), "--tail-layout", layout,
                        "--accuracy", str(ev), "--policies", policies, "--eviction", "lru,next_use", "--prefetch",
                        "trace", "--orders", "widest_first,router", "--budget", str(b), "--json", str(sim)])
                doc = json.loads(sim.read_text())
                base = next(r for r in doc["records"] if r["label"] == "full/plan/lru" and r["order"] == "router"
                            and r.get("tail_layout", "q4") == "q4")
                for r in doc["records"]:
                    if r["order"] != "widest_first" and r["label"] != "full/plan/lru":
                        continue
                    rows.append({"layout": layout, "tier_widths": tiers, "budget": b, "label": r["label"],
                                 "order": r["order"], "policy": r["policy"], "eviction": r["eviction"],
                                 "prefetch": r["prefetch"], "tokens_per_s": r["tokens_per_s"],
                                 "x_full_lru": r["tokens_per_s"] / base["tokens_per_s"],
                                 "mb_copied_per_token": (r["bytes_per_token"] + r.get("prefetch_bytes_per_token", 0))
                                 / 1e6, "hit_rate": r["hit_rate"], "accuracy_loss": r["accuracy_loss"]})
    OUT_JSON.write_text(json.dumps({"study": __doc__.split("\n")[0], "trace": TRACE, "profile": "rtx4090-pcie4",
                                    "target": "mixtral-8x7b", "heldout_windows": [128, 256], "rows": rows},
                                   indent=1) + "\n")
    print(f"wrote {OUT_JSON}")
    table(rows)
    plot(rows)
    return 0


def table(rows) -> None:
    for b in BUDGETS:
        print(f"\nbudget {b:.0%}: crisp/plan/next_use+prefetch (x full-width 4-bit LRU, router order)")
        for r in rows:
            if r["budget"] == b and r["label"].startswith("crisp/plan/next_use+prefetch"):
                loss = "-" if r["accuracy_loss"] is None else f"{100 * r['accuracy_loss']:.2f}%"
                print(f"  {r['layout']:11s} tiers {r['tier_widths']:10s} {r['tokens_per_s']:6.2f} tok/s "
                      f"{r['x_full_lru']:5.2f}x  {r['mb_copied_per_token']:6.0f} MB/tok  loss {loss}")


def plot(rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    marks = {"crisp": "o", "uniform": "s", "skip_aux": "^", "full": "x"}
    colors = dict(zip(LAYOUTS, ("black", "tab:red", "tab:blue", "tab:green", "tab:purple"), strict=True))
    for r in rows:
        if r["budget"] != 0.25 or r["accuracy_loss"] is None or r["eviction"] != "next_use" or not r["prefetch"]:
            continue
        ax.scatter(100 * r["accuracy_loss"], r["x_full_lru"], marker=marks[r["policy"]], color=colors[r["layout"]],
                   s=40)
    for layout, c in colors.items():
        ax.scatter([], [], color=c, label=f"layout {layout}")
    for p, m in marks.items():
        ax.scatter([], [], marker=m, color="gray", label=p)
    ax.axvline(2.0, ls=":", color="gray")
    ax.axhline(2.5, ls=":", color="gray")
    ax.set_xlabel("relative next-token accuracy loss vs 4-bit full width (%), 128 held-out windows")
    ax.set_ylabel("tokens/s over 4-bit full-width LRU (simulated)")
    ax.set_title("25% budget, RTX 4090 + PCIe 4.0, Mixtral-8x7B sizes: next-use eviction + prefetch")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(OUT_PNG, dpi=110)
    print(f"wrote {OUT_PNG}")


if __name__ == "__main__":
    sys.exit(main())
