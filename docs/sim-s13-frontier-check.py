"""Session 13 (issue 10): the frontier check at 10 / 25 / 50% with this session's points, every loss from the 128
held-out windows x 256 tokens.

25%: session 11's three tail-pack frontier simulations (`docs/sim-s11-promoted-frontier.py`'s files) plus the
Warm 64 / Cold 32 pack with auxiliaries of weight >= 0.33 whole under `resident-narrow-aux` + prefetch (simulated
by `crisp-bench simulate --plan PACK --serving resident-narrow-aux --prefetch trace`, product mode, into
`docs/bench-simulate-s13-w033-narrow-25.json`; decoded in session 12). 10% / 50%: the Warm 64 / Cold 32 frontier
simulations of session 11 re-reported with session 12 / 13 decodes attached (`crisp-bench simulate --from-json`
into `docs/bench-simulate-s13-64-32-frontier-{10,50}.json`). For every uniform and skip-aux point: the fastest
CRISP point at or below its loss, and whether it is at least as fast (docs/sim-s10-capped-frontier.py's check).

    PYTHONPATH=. python docs/sim-s13-frontier-check.py      (a second; prints only)
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "docs"
FILES_25 = {"256/64/32": ROOT / "bench-simulate-tail-pack-s11-64-32-frontier-25.json",
            "256/128/64": ROOT / "bench-simulate-tail-pack-s11-128-64-frontier-25.json",
            "256/192/96": ROOT / "bench-simulate-tail-pack-s11-192-96-frontier-25.json"}
W033_25 = ROOT / "bench-simulate-s13-w033-narrow-25.json"
FILES = {"10": {"256/64/32": ROOT / "bench-simulate-s13-64-32-frontier-10.json"},
         "50": {"256/64/32": ROOT / "bench-simulate-s13-64-32-frontier-50.json"}}


def _s10():
    """docs/sim-s10-capped-frontier.py's points / check (one implementation; its file name is not a module name)."""
    spec = importlib.util.spec_from_file_location("sim_s10_capped_frontier", ROOT / "sim-s10-capped-frontier.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def product_points(path: Path, tiers: str) -> list[dict]:
    """The CRISP records with a loss of a product-mode simulation (no family field), over its own full-width LRU."""
    doc = json.loads(path.read_text())
    base = next(r["tokens_per_s"] for r in doc["records"] if r["label"] == "full/plan/lru" and r["order"] == "router"
                and r.get("tail_layout", "q4") == "q4")
    out = []
    for r in doc["records"]:
        if r["policy"] != "crisp" or r["accuracy_loss"] is None or r["order"] != "widest_first":
            continue
        note = f"{tiers.split('/', 1)[1]} aux{r['aux_full_weight']:g} f{r['serving_policy']['dominant_floor']:g}"
        if r["serving_policy"].get("aux_narrower") == "narrow_only":
            note += " narrow-only"
        out.append({"family": "crisp weight-promoted residency-aware", "note": note,
                    "x": r["tokens_per_s"] / base, "loss": r["accuracy_loss"]})
    return out


def main() -> int:
    s10 = _s10()
    for budget, rows in (("10", s10.points(FILES["10"])),
                         ("25", s10.points(FILES_25) + product_points(W033_25, "256/64/32")),
                         ("50", s10.points(FILES["50"]))):
        print(f"{budget}% of the 4-bit expert bytes, 128 x 256 held-out windows: each uniform / skip-aux point "
              "against CRISP's (loss <= and tokens/s >=)")
        print("\n".join(s10.check(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
