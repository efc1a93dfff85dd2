"""Session 9 (issue 10): real 2-bit tail packs, measured with the product's tools only.

For each CRISP tier-width setting: a 2-bit tail pack (python -m crisp_tools.tail_pack, layout 2g128@0.25: the
first 25% of each expert's neurons 4-bit, the rest 2-bit g128, 62.5% of the 4-bit bytes), its accuracy by
crisp-eval on 128 held-out windows x 256 tokens against the 4-bit pack's full width (--reference-crisp;
--frontier adds uniform and skip-aux at the simulator's knob values), then crisp-bench simulate --tail-layout
on the committed predicted trace (rtx4090-pcie4, Mixtral-8x7B sizes) with that accuracy attached:
CRISP at the plan's widths (exact serving: the batch evaluation is the runtime-in-the-loop one) with LRU and
next-use eviction and next-layer prefetch, and for the main setting the frontier matrix (every family over its
knob; residency-aware CRISP's dominant floors carry the decode evaluations given as DECODE_EVALS, made with
crisp-eval --mode decode --prefetch-window rtx4090-pcie4 on the same pack).

    PYTHONPATH=. python docs/sim-s9-tail-pack-study.py WORKDIR [DECODE_EVAL.json ...]     (~15 min on 2 cores)

Writes docs/bench-simulate-tail-packs.json and docs/bench-simulate-tail-packs-25.png (refuses to overwrite).
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
LAYOUT = "2g128@0.25"
TIERS = ["256,40,0", "256,40,16", "256,96,32", "256,128,64", "256,64,32"]  # the pack's plan has 256,40,0
MAIN_TIERS = "256,64,32"
BUDGETS = [0.1, 0.25, 0.5]
OUT_JSON = ROOT / "docs" / "bench-simulate-tail-packs.json"
OUT_PNG = ROOT / "docs" / "bench-simulate-tail-packs-25.png"


def sh(args: list[str]) -> None:
    t0 = time.time()
    subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    print(f"  {time.time() - t0:5.1f}s  {' '.join(args[:4])} ...", flush=True)


def simulate(pack: Path, evals: list[str], budget: float, out: Path, matrix: list[str]) -> dict:
    if not out.exists():
        sh(["crisp-bench", "simulate", "--trace", TRACE, "--plan", str(pack), "--tail-layout", LAYOUT,
            *[a for ev in evals for a in ("--accuracy", ev)], *matrix, "--prefetch", "trace",
            "--orders", "widest_first,router", "--budget", str(budget), "--json", str(out)])
    return json.loads(out.read_text())


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in (OUT_JSON, OUT_PNG):
        if path.exists():
            sys.exit(f"error: {path} exists; refusing to overwrite it")
    work = Path(sys.argv[1])
    decode_evals = sys.argv[2:]
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for tiers in TIERS:
        tag = tiers.replace(",", "-")
        pack = work / f"pack-{tag}"
        if not pack.exists():
            sh([sys.executable, "-m", "crisp_tools.tail_pack", "--model", MODEL, "--crisp", PACK, "--layout", LAYOUT,
                "--tier-widths", tiers, "--out", str(pack), "--quiet"])
        ev = work / f"eval-{tag}.json"
        if not ev.exists():
            sh(["crisp-eval", "--model", MODEL, "--crisp", str(pack), "--reference-crisp", PACK, "--data", HELDOUT,
                "--samples", "128", "--seq-len", "256", "--frontier", "--json", str(ev), "--quiet", "--threads", "2"])
        for b in BUDGETS:
            if tiers == MAIN_TIERS:
                doc = simulate(pack, [str(ev), *decode_evals], b, work / f"sim-frontier-{tag}-{b:g}.json",
                               ["--matrix", "frontier"])
                rows += pick(doc, tiers, b, lambda r: r["order"] == "widest_first" or r["label"] == "full/plan/lru")
            doc = simulate(pack, [str(ev)], b, work / f"sim-{tag}-{b:g}.json",
                           ["--policies", "full,crisp", "--eviction", "lru,next_use"])
            rows += pick(doc, tiers, b, lambda r: r["order"] == "widest_first" and r["policy"] == "crisp")
    OUT_JSON.write_text(json.dumps({"study": __doc__.split("\n")[0], "layout": LAYOUT, "trace": TRACE,
                                    "profile": "rtx4090-pcie4", "target": "mixtral-8x7b",
                                    "heldout_windows": [128, 256], "decode_evals": decode_evals, "rows": rows},
                                   indent=1) + "\n")
    print(f"wrote {OUT_JSON}")
    table(rows)
    plot(rows)
    return 0


def pick(doc: dict, tiers: str, budget: float, keep) -> list[dict]:
    base = next(r for r in doc["records"] if r["label"] == "full/plan/lru" and r["order"] == "router"
                and r.get("tail_layout", "q4") == "q4")
    out = []
    for r in doc["records"]:
        if not keep(r):
            continue
        out.append({"tier_widths": tiers, "budget": budget, "label": r["label"], "order": r["order"],
                    "policy": r["policy"], "family": r.get("family", r["policy"]),
                    "serving": r["serving"], "eviction": r["eviction"], "prefetch": r["prefetch"],
                    "tail_layout": r.get("tail_layout", "q4"), "tokens_per_s": r["tokens_per_s"],
                    "x_full_lru": r["tokens_per_s"] / base["tokens_per_s"],
                    "mb_copied_per_token": (r["bytes_per_token"] + r.get("prefetch_bytes_per_token", 0)) / 1e6,
                    "hit_rate": r["hit_rate"], "accuracy_loss": r["accuracy_loss"],
                    "accuracy_source": r.get("accuracy_source")})
    return out


def table(rows) -> None:
    for b in BUDGETS:
        print(f"\nbudget {b:.0%} (x 4-bit full-width LRU, router order; loss vs 4-bit full width)")
        for r in rows:
            if r["budget"] == b:
                loss = "-" if r["accuracy_loss"] is None else f"{100 * r['accuracy_loss']:.2f}%"
                print(f"  {r['tier_widths']:11s} {r['label']:55s} {r['tokens_per_s']:6.2f} tok/s "
                      f"{r['x_full_lru']:5.2f}x {r['mb_copied_per_token']:6.0f} MB/tok  loss {loss}")


def plot(rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    styles = {"crisp plan widths": ("o", "tab:red"), "crisp residency-aware": ("D", "tab:orange"),
              "uniform": ("s", "tab:blue"), "skip_aux": ("^", "tab:green"), "crisp": ("o", "tab:red")}
    seen, drawn = set(), set()
    for r in rows:
        if r["budget"] != 0.25 or r["accuracy_loss"] is None or r["policy"] == "full":
            continue
        if (r["tier_widths"], r["label"]) in drawn:  # the main setting's CRISP row is in both of its runs
            continue
        drawn.add((r["tier_widths"], r["label"]))
        if r["family"] == "crisp" and r["eviction"] != "lru":
            continue  # the frontier's machinery (LRU + prefetch) for every family
        family = "crisp plan widths" if r["family"] == "crisp" else r["family"]
        marker, color = styles[family]
        ax.scatter(100 * r["accuracy_loss"], r["x_full_lru"], marker=marker, color=color, s=45,
                   label=None if family in seen else family)
        seen.add(family)
        if family == "crisp plan widths":
            ax.annotate(r["tier_widths"].split(",", 1)[1], (100 * r["accuracy_loss"], r["x_full_lru"]),
                        fontsize=7, xytext=(4, -8), textcoords="offset points")
    ax.axvline(2.0, ls=":", color="gray")
    ax.axhline(2.5, ls=":", color="gray")
    ax.set_xlabel("relative next-token accuracy loss vs 4-bit full width (%), tiny Mixtral, held-out text")
    ax.set_ylabel("tokens/s over 4-bit full-width LRU (simulated)")
    ax.set_title(f"25%, RTX 4090 + PCIe 4.0, Mixtral-8x7B sizes: tail pack {LAYOUT}, LRU + prefetch", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(OUT_PNG, dpi=110)
    print(f"wrote {OUT_PNG}")


if __name__ == "__main__":
    sys.exit(main())
