"""What one ``crisp-bench simulate`` run compares, and the accuracy each configuration is known to lose.

A configuration (:class:`bench.simulate.SimPolicy`) is a width plan (full, uniform, skip_aux,
crisp), a serving policy (``crisp_runtime.planning.serving``), an eviction policy and prefetch on or off.
Three ways to choose them (``--matrix``):

- ``product``: every plan x serving x eviction x prefetch given on the command line;
- ``residency``: the residency-aware comparison at one GPU memory: full-width LRU
  (mixtral-offloading), full-width Belady, the paper's CRISP (plan widths, LRU), residency-aware
  CRISP (auxiliaries served from what is resident; a missed dominant at full width or at a 75%
  prefix) with next-use and with LRU eviction, with and without prefetch, the same under Belady (the bound),
  and uniform / skip-auxiliary given the same serving, eviction and prefetch;
- ``hybrid`` (a profile with a CPU): GPU-only full-width LRU (mixtral-offloading),
  ``static_hybrid`` (llama.cpp ``--n-cpu-moe`` style: the most used experts resident at full
  width, all others on the CPU at full width, nothing copied), ``cpu_only`` (every expert on the
  CPU at full width), CRISP on the GPU only (plan widths, LRU) and CRISP ``hybrid`` (plan widths,
  per step the GPU / CPU split of minimal makespan), and ``hybrid_split`` (the neuron split: an
  expert's prefix on the GPU, its other rows on the CPU) at full widths and at CRISP's; CRISP
  ``hybrid_split_transient`` (the split's copies in a per-step buffer, not admitted); with
  ``--prefetch trace`` also the split with next-layer prefetch (full widths; CRISP's, with and
  without the buffer, with a 62.5% dominant floor widened on the next use, and with an 87.5% floor);
- ``stored``: full-width LRU and the serving choice a throughput search stored in the CRISP pack
  (``crisp-profile --plan-for-throughput``: its serving policy, eviction and prefetch width, with the pack's
  plan; ``crisp_runtime.storage.serving_record``), e.g. to time it on another trace or hardware profile;
- ``frontier``: each family swept over its knob (CRISP's dominant floor, uniform's width,
  skip-auxiliary's threshold) with next-use eviction and prefetch, for the tokens/s-against-
  accuracy plot (uniform and skip-auxiliary served at their plan's widths there, whose accuracy
  does not depend on the cache).

Accuracy is never simulated: a record's ``accuracy_loss`` (relative next-token accuracy loss
against 4-bit full width, a fraction) comes from an evaluation file when one measured that exact
configuration, else it is None. Two kinds of file are read:

- ``crisp-eval --json`` (e.g. bench/results/eval-tiny-mixtral.json): policies full / crisp / uniform /
  skip_aux at the plan's widths. Their outputs do not depend on the cache, so the loss holds for
  the plan serving policy at every budget (uniform / skip_aux only at the evaluated width /
  threshold);
- the runtime-in-the-loop evaluation of serving policies (records with ``serving`` and
  ``budget_fraction``): a residency-aware loss holds only for that policy, serving, budget and
  prefetch setting.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from crisp_kernels.tail_layout import PLAIN
from crisp_runtime.cpu.knob import CpuMode, cpu_pays
from crisp_runtime.planning.defaults import ServingChoice, choose_serving, pack_facts
from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.planning.serving import (
    SERVING_POLICIES,
    AuxNarrower,
    DominantWiden,
    ServingPolicy,
    resident_policy,
    serving_by_name,
)
from crisp_runtime.scheduling.prefetch import PrefetchWidth
from crisp_runtime.scheduling.scheduler import Placement
from crisp_runtime.storage.serving_record import ServingRecord

from .simulate import SimPolicy

MATRICES = ("product", "residency", "frontier", "hybrid", "stored")
# The frontier's knobs. CRISP: the dominant floor (1.0 = a missed dominant loads at full width;
# PERF-BOUNDS: 0.75 was +29% tokens/s for ~0.8 point of loss, 0.625 passed 2% loss).
CRISP_FLOORS = (1.0, 0.875, 0.75, 0.625, 0.5)
UNIFORM_FRACTIONS = (0.375, 0.5, 0.625, 0.75)  # plus the width matched to CRISP's bytes
SKIP_THRESHOLDS = (0.2, 0.3, 0.4)  # plus the threshold matched to CRISP's bytes and "always"
# CRISP under a width cap (``CrispPlan.width_cap``), fractions of the neurons: at 50% of the 4-bit bytes a
# 2-bit tail pack at 3/4 of its neurons fits the whole cache (uniform at 192/256 copied nothing on the held-out trace)
CRISP_CAPS = (0.75, 0.875)
# residency-aware CRISP under a cap: a lower floor costs less there (every width is at most the cap; at
# 50%: cap 224/256 with floor 0.375 decoded 1.83% loss, uncapped floor 0.625 1.15%); 0.25 for the fast end of the
# 25% frontier (uniform at 96/256 neurons ran 4.70x full-width LRU at 9.7% loss, above every CRISP point)
CAPPED_FLOORS = (1.0, 0.75, 0.625, 0.5, 0.375, 0.25)
# CRISP whose auxiliaries of routing weight >= w run at the dominant width (``CrispPlan.aux_full_weight``): below 1%
# loss at 25% skip-auxiliary's weight threshold beat the pair tiers; with it, a heavy auxiliary runs whole
# and a light one keeps its tier's narrow width instead of being skipped (128 x 256 held-out windows,
# Warm 64 / Cold 32 tail pack at the plan's widths: weight 0.3 lost 0.78% at 48% of the bytes, skip-aux at 0.3 1.22%)
PROMOTE_WEIGHTS = (0.25, 0.3, 0.35, 0.4, 0.45)
# ... served from what is resident at these dominant floors
PROMOTED_FLOORS = (1.0, 0.875, 0.75)
RUNTIME_EVICTION = "lru"  # RuntimeConfig's default: what an evaluation that names no eviction ran
FRONTIER_EVICTION = "lru"  # what the runtime-in-the-loop evaluation measured residency-aware accuracy with


# The neuron split with residency-aware serving (docs/hybrid.md): a missed dominant served at a 62.5%
# prefix, widened to the plan's width on its next use while resident (DominantWiden.HIT); auxiliaries as the plan.
HYBRID_SPLIT_FLOOR_HIT = ServingPolicy("hybrid_split-floor62.5-hit", dominant_floor=0.625,
                                       dominant_widen=DominantWiden.HIT, placement=Placement.SPLIT)
# ... and a missed dominant served at an 87.5% prefix, never widened (its last 1/8 of neurons, the least important).
HYBRID_SPLIT_FLOOR875 = ServingPolicy("hybrid_split-floor87.5", dominant_floor=0.875, placement=Placement.SPLIT)


def configurations(plans: dict[str, CrispPlan], matrix: str, *, serving: Sequence[str] = ("plan",),
                   evictions: Sequence[str] = ("lru",), prefetch: Sequence[bool] = (False,),
                   stored: ServingRecord | None = None) -> list[SimPolicy]:
    """The configurations of one run (see the module docstring); the full-width LRU baseline first.
    ``stored``: the serving choice of the ``stored`` matrix (required there, refused elsewhere)."""
    if (matrix == "stored") != (stored is not None):
        raise ValueError("stored: a ServingRecord with matrix 'stored' and only there")
    if matrix == "stored":
        pf = stored.prefetch
        return [SimPolicy("full", plans["full"]),
                SimPolicy("crisp", plans["crisp"], stored.policy, stored.eviction, pf is not None,
                          pf.width if pf is not None else PrefetchWidth.PLAN)]
    if matrix == "product":
        out = [SimPolicy(name, plan, serving_by_name(s), e, p)
               for name, plan in plans.items() for s in serving for e in evictions for p in prefetch]
        base = SimPolicy("full", plans["full"]) if "full" in plans else None
        if base is not None and base.label not in {c.label for c in out}:
            out.insert(0, base)  # the mixtral-offloading-style baseline, whatever the others use
        return out
    pf = [False, True] if True in prefetch else [False]
    if matrix == "residency":
        out = [SimPolicy("full", plans["full"]), SimPolicy("full", plans["full"], eviction="belady")]
        if "crisp" in plans:
            crisp = plans["crisp"]
            out.append(SimPolicy("crisp", crisp))
            for p in pf:
                out += [SimPolicy("crisp", crisp, resident_policy(f), "next_use", p) for f in (1.0, 0.75)]
            for p in pf:  # the eviction the runtime-in-the-loop evaluation ran: these carry its accuracy
                out += [SimPolicy("crisp", crisp, resident_policy(f), RUNTIME_EVICTION, p) for f in (1.0, 0.75)]
            out.append(SimPolicy("crisp", crisp, resident_policy(0.75), "belady", pf[-1]))
        for name in ("uniform", "skip_aux"):
            if name in plans:
                out += [SimPolicy(name, plans[name], resident_policy(1.0), "next_use", p) for p in pf]
        return out
    if matrix == "frontier":
        return [SimPolicy("full", plans["full"])] + [c for c, _ in frontier(plans, pf[-1])]
    if matrix == "hybrid":
        full = plans["full"]
        split = SERVING_POLICIES["hybrid_split"]
        out = [SimPolicy("full", full), SimPolicy("full", full, SERVING_POLICIES["static_hybrid"]),
               SimPolicy("full", full, SERVING_POLICIES["cpu_only"]),
               SimPolicy("full", full, split)]  # full widths, neuron split
        if True in prefetch:  # full widths, neuron split, next-layer prefetch at the plan's widths (0 loss)
            out.append(SimPolicy("full", full, split, prefetch=True))
        if "crisp" in plans:
            crisp = plans["crisp"]
            out += [SimPolicy("crisp", crisp), SimPolicy("crisp", crisp, SERVING_POLICIES["hybrid"]),
                    SimPolicy("crisp", crisp, split),
                    SimPolicy("crisp", crisp, SERVING_POLICIES["hybrid_split_transient"])]
            if True in prefetch:  # the split with next-layer prefetch (docs/hybrid.md)
                out += [SimPolicy("crisp", crisp, split, prefetch=True),
                        SimPolicy("crisp", crisp, SERVING_POLICIES["hybrid_split_transient"], prefetch=True),
                        SimPolicy("crisp", crisp, HYBRID_SPLIT_FLOOR_HIT, prefetch=True),
                        SimPolicy("crisp", crisp, HYBRID_SPLIT_FLOOR875, prefetch=True)]
        return out
    raise ValueError(f"matrix {matrix!r}: choose one of {', '.join(MATRICES)}")


def with_prefetch_widths(configs: Sequence[SimPolicy], widths: Sequence[str]) -> list[SimPolicy]:
    """Each prefetching configuration once per prefetch width (``crisp_runtime.scheduling.prefetch.PrefetchWidth``
    values, in the order given); the others as they are."""
    return [replace(c, prefetch_width=w) if c.prefetch else c
            for c in configs for w in (widths if c.prefetch else [None])]


def frontier(plans: dict[str, CrispPlan], prefetch: bool) -> list[tuple[SimPolicy, dict]]:
    """(configuration, {"family", "knob", "knob_value"}) for each family's knob values.

    All with LRU eviction (what the runtime-in-the-loop evaluation ran, so that residency-aware
    points carry its accuracy) and (when the trace has predictions) prefetch. Residency-aware
    CRISP is swept over its dominant floor; CRISP at the plan's widths is one point; CRISP under each
    width cap of ``CRISP_CAPS`` at the plan's widths and residency-aware over ``CAPPED_FLOORS``; uniform and
    skip_aux are served at their plan's widths (their outputs do not depend on the cache, so the
    batch evaluation's accuracy holds) and swept over width and threshold.
    """
    out: list[tuple[SimPolicy, dict]] = []
    full = plans["full"]
    e, k, inter, ids = full.num_experts, full.top_k, full.intermediate_size, full.layer_ids
    exact = SERVING_POLICIES["plan"]
    if "crisp" in plans:
        for f in CRISP_FLOORS:
            out.append((SimPolicy("crisp", plans["crisp"], resident_policy(f), FRONTIER_EVICTION, prefetch),
                        {"family": "crisp residency-aware", "knob": "dominant_floor", "knob_value": f}))
        out.append((SimPolicy("crisp", plans["crisp"], exact, FRONTIER_EVICTION, prefetch),
                    {"family": "crisp plan widths", "knob": "plan", "knob_value": "plan"}))
        crisp = plans["crisp"]
        for cap in sorted({max(1, round(f * crisp.intermediate_size)) for f in CRISP_CAPS}):
            out.append((SimPolicy("crisp", crisp.capped(cap), exact, FRONTIER_EVICTION, prefetch, variant=f"cap{cap}"),
                        {"family": "crisp capped", "knob": "width_cap", "knob_value": cap}))
            # ... and served from what is resident under the cap
            for f in CAPPED_FLOORS:
                out.append((SimPolicy("crisp", crisp.capped(cap), resident_policy(f), FRONTIER_EVICTION, prefetch,
                                      variant=f"cap{cap}"),
                            {"family": "crisp capped residency-aware", "knob": "dominant_floor", "knob_value": f}))
        # a three-band plan (CrispPlan.aux_skip_weight S) is promoted only at weights >= S (below: refused)
        for weight in (w for w in PROMOTE_WEIGHTS if crisp.aux_skip_weight is None or w >= crisp.aux_skip_weight):
            promoted = crisp.promoted(weight)
            out.append((SimPolicy("crisp", promoted, exact, FRONTIER_EVICTION, prefetch, variant=f"aux{weight:g}"),
                        {"family": "crisp weight-promoted", "knob": "aux_full_weight", "knob_value": weight}))
            for f in PROMOTED_FLOORS:  # heavy auxiliaries widened (NARROW_ONLY), and served as resident
                for narrow in (AuxNarrower.NARROW_ONLY, AuxNarrower.RESIDENT):
                    out.append((SimPolicy("crisp", promoted, resident_policy(f, narrow), FRONTIER_EVICTION, prefetch,
                                          variant=f"aux{weight:g}"),
                                {"family": "crisp weight-promoted residency-aware", "knob": "aux_full_weight",
                                 "knob_value": weight}))
    widths = sorted({max(1, round(f * inter)) for f in UNIFORM_FRACTIONS}
                    | ({plans["uniform"].uniform_width} if "uniform" in plans else set()))
    for w in widths:
        out.append((SimPolicy("uniform", CrispPlan.uniform(e, k, inter, ids, w), exact, FRONTIER_EVICTION, prefetch,
                              variant=f"w{w}"),
                    {"family": "uniform", "knob": "uniform_width", "knob_value": w}))
    num_dominant = plans["crisp"].num_dominant if "crisp" in plans else 1
    thresholds: list[float | None] = list(SKIP_THRESHOLDS)
    if "skip_aux" in plans:
        thresholds.append(plans["skip_aux"].skip_threshold)
    thresholds.append(None)  # always skip
    for th in sorted(set(thresholds), key=lambda x: math.inf if x is None else x):
        plan = CrispPlan.skip_aux(e, k, inter, ids, threshold=th, num_dominant=num_dominant)
        out.append((SimPolicy("skip_aux", plan, exact, FRONTIER_EVICTION, prefetch,
                              variant="always" if th is None else f"t{th:.3g}"),
                    {"family": "skip_aux", "knob": "skip_threshold", "knob_value": th}))
    return out


def knobs(policy: SimPolicy) -> dict:
    """The plan's and serving policy's parameters a record carries (to match evaluations of the same)."""
    plan = policy.plan
    out: dict = {"dominant_floor": policy.serving.dominant_floor, "serving_policy": policy.serving.to_dict()}
    if plan.uniform_width is not None:
        out["uniform_width"] = plan.uniform_width
    if plan.width_cap is not None:
        out["width_cap"] = plan.width_cap
    if plan.aux_full_weight is not None:
        out["aux_full_weight"] = plan.aux_full_weight
    if plan.aux_skip_weight is not None:
        out["aux_skip_weight"] = plan.aux_skip_weight
    if policy.name == "skip_aux":
        out["skip_threshold"] = plan.skip_threshold
    return out


# ---------------------------------------------------------------------------- accuracy

_SERVING_KEYS = ("hit_width", "aux_narrower", "aux_missing", "dominant_floor", "dominant_widen", "aux_skipped")


def read_accuracy(paths: Iterable[str | Path], traced_model: str | None, crisp_plan: CrispPlan | None = None
                  ) -> tuple[list[dict], list[str]]:
    """Evaluation records usable for ``traced_model`` (a file of another model is skipped), and notes.

    A file that records the widths digest of the CRISP plan it evaluated (``plan_widths_sha256``) is used
    only when that is ``crisp_plan``'s: its CRISP rows are that plan's, and its uniform / skip-aux rows are
    matched to that plan's bytes.
    Each row carries the file's ``tail_layout`` (the pack's precision layout; absent = ``q4``).
    Reads ``crisp-eval --json`` (records: policy = full / crisp / uniform / skip_aux / skip_aux_all,
    relative_accuracy_loss_vs_full; exact serving) and ``crisp-eval --mode decode --json`` (format
    crisp-eval-serving: plan, serving {...}, prefetch, budget_fraction, accuracy_loss).
    """
    rows: list[dict] = []
    notes: list[str] = []
    for path in paths:
        from crisp_runtime.cli_args import read_json

        doc = read_json(Path(path), "--accuracy")  # a ValueError naming the file: folder, not UTF-8, too deep, ...
        records = doc.get("records") if isinstance(doc, dict) else None
        if not isinstance(records, list):
            raise ValueError(f"--accuracy {path}: expected a JSON object with a 'records' list")
        if doc.get("format") == "crisp-bench":  # a benchmark's or simulation's records hold no measured accuracy
            raise ValueError(f"--accuracy {path}: a crisp-bench {doc.get('command')} document; expected an "
                             "evaluation (crisp-eval --json)")
        model = doc.get("model")
        if traced_model is not None and model is not None and Path(str(model)).name != Path(traced_model).name:
            notes.append(f"accuracy: {path} is of {model}, the trace of {traced_model}: not used")
            continue
        layout = doc.get("tail_layout") or PLAIN.name  # evaluations written before layouts were of 4-bit packs
        if not isinstance(layout, str):
            raise ValueError(f"--accuracy {path}: tail_layout must be a layout name, got {layout!r}")
        digest = doc.get("plan_widths_sha256")  # absent: written before it was recorded (trusted)
        if digest is not None and not isinstance(digest, str):
            raise ValueError(f"--accuracy {path}: plan_widths_sha256 must be a string, got {digest!r}")
        # a weight-promoted plan's evaluations record its widths digest with or without the weight (crisp-eval
        # of a pack that stores it; a decode that promotes the pack's plan): the weight itself is matched per
        # record (match_accuracy), so either digest names this plan's widths
        if crisp_plan is not None and digest is not None and digest not in _digests(crisp_plan):
            notes.append(f"accuracy: {path} was evaluated with another CRISP plan than the one simulated "
                         f"(plan_widths_sha256 {digest[:12]}...): not used")
            continue
        used = stale = 0
        for r in records:
            if layout != PLAIN.name and isinstance(r, dict) and _rows_floor(r):
                stale += 1
                continue
            if layout != PLAIN.name and isinstance(r, dict):
                # crisp-eval on a tail layout: "full" is the 4-bit reference, "full_layout" the layout's full width
                # (batch records; "full-exact" / "full_layout-exact" in --mode decode, whose family is "plan")
                if r.get("policy") in ("full", "full-exact"):
                    continue
                if r.get("policy") == "full_layout":
                    r = {**r, "policy": "full"}
            row = _evaluated(r)
            if row is not None:
                _check_loss(path, r, row, layout)
                rows.append({**row, "source": str(path), "tail_layout": layout})
                used += 1
        notes.append(f"accuracy: {used} evaluated configurations from {path}")
        if stale:
            notes.append(f"accuracy: {stale} decodes in {path} ran a dominant floor below 1 on a tail layout "
                         "counted as a fraction of its storage rows (no floor_unit 'neurons'; a narrower floor than "
                         "the simulation's, which counts neurons): not attached")
    return rows, notes


def _check_loss(path, r: dict, row: dict, layout: str) -> None:
    """A relative accuracy loss is at most 1 (all of full's accuracy lost); below 0 a configuration beat full
    width (by a few tenths of a percent in the committed evaluations), and below -1 it would have doubled full's
    accuracy: a wrong field, not a measurement. Full width on a 4-bit pack is the reference itself: loss 0 (on a
    tail layout, the layout's full width carries its rounding's loss against the 4-bit reference)."""
    loss = row["accuracy_loss"]
    if not -1.0 <= loss <= 1.0:
        raise ValueError(f"--accuracy {path}: record of policy {r.get('policy')!r} has accuracy loss {loss!r}; "
                         "expected a relative loss in [-1, 1]")
    if row["family"] == "full" and layout == PLAIN.name and loss != 0:
        raise ValueError(f"--accuracy {path}: record of policy {r.get('policy')!r} (full width, the reference) has "
                         f"accuracy loss {loss!r}; expected 0")


def _rows_floor(r: dict) -> bool:
    """A decode record of a floor below 1 written before floors counted neurons on tail packs (no floor_unit)."""
    serving = r.get("serving")
    floor = serving.get("dominant_floor", 1.0) if isinstance(serving, dict) else 1.0
    return isinstance(floor, (int, float)) and floor < 1.0 and r.get("floor_unit") != "neurons"


def _digests(plan: CrispPlan) -> set[str]:
    # likewise a three-band plan's with or without its skip threshold
    plans = [plan, plan.promoted(None)]
    plans += [p.skipping(None) for p in plans if p.aux_skip_weight is not None]
    return {p.widths_digest() for p in plans}


def _evaluated(r) -> dict | None:
    loss = _loss(r)
    if loss is None or not isinstance(r.get("policy"), str):
        return None
    serving = r.get("serving")
    if isinstance(serving, dict):  # the runtime-in-the-loop evaluation
        detail = r.get("plan_detail") if isinstance(r.get("plan_detail"), dict) else {}
        exact = bool(serving.get("exact", False))
        return {"family": r.get("plan"), "exact": exact, "eviction": r.get("eviction", RUNTIME_EVICTION),
                "serving": None if exact else tuple(serving.get(k) for k in _SERVING_KEYS),
                "budget_fraction": r.get("budget_fraction"), "prefetch": _prefetch_width(r.get("prefetch")),
                "uniform_width": detail.get("uniform_width"), "skip_threshold": detail.get("skip_threshold"),
                "width_cap": detail.get("width_cap"), "aux_full_weight": detail.get("aux_full_weight"),
                "aux_skip_weight": detail.get("aux_skip_weight"), "accuracy_loss": loss}
    family = {"skip_aux_all": "skip_aux"}.get(r["policy"], r["policy"])  # batch evaluation: exact serving
    return {"family": family, "exact": True, "eviction": None, "serving": None, "budget_fraction": None,
            "prefetch": None,
            "uniform_width": r.get("uniform_width"), "skip_threshold": r.get("skip_threshold"),
            "width_cap": r.get("width_cap"), "aux_full_weight": r.get("aux_full_weight"),
            "aux_skip_weight": r.get("aux_skip_weight"), "accuracy_loss": loss}


def _prefetch_width(prefetch) -> str | None:
    """None (no prefetch) or the prefetch width's name (``PrefetchWidth`` value); records written before
    the width was an option prefetched at the plan's widths."""
    if prefetch is None or prefetch is False:
        return None
    width = prefetch.get("width") if isinstance(prefetch, dict) else prefetch
    return "plan" if width is None or width is True else str(width)


def _loss(r) -> float | None:
    if not isinstance(r, dict):
        return None
    for key in ("accuracy_loss", "relative_accuracy_loss_vs_full"):
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return None


def accuracy_for(record: dict, evaluated: Sequence[dict]) -> tuple[float | None, str | None]:
    """The evaluated loss of a simulated record's exact configuration, and its source; else (None, None).

    Only an evaluation of the record's tail layout (``tail_layout``, absent = ``q4``) applies.
    Exact serving (outputs independent of the cache): any budget, eviction and prefetch.
    Residency-aware serving: the same serving parameters, budget fraction, eviction policy (an
    evaluation that names none ran the runtime's default, LRU) and prefetch setting (none, or the same
    prefetch width).
    """
    sp = record["serving_policy"]
    # Exact: every slot at the plan's width (the "plan" policy, and the CPU placements, which change where an
    # expert runs but not its width).
    exact = record["serving"] == "plan" or ServingPolicy.from_dict(sp).follows_plan
    layout = record.get("tail_layout", PLAIN.name)
    for ev in evaluated:
        if ev["family"] != record["policy"] or ev["exact"] != exact or ev.get("tail_layout", PLAIN.name) != layout:
            continue
        if not exact:
            if sp.get("placement", "gpu") != "gpu":  # evaluated on the GPU's residency, not a CPU placement's
                continue
            b = ev["budget_fraction"]
            if (ev["serving"] != tuple(sp.get(k) for k in _SERVING_KEYS) or b is None
                    or abs(float(b) - record["budget_fraction"]) > 1e-9
                    or ev["prefetch"] != _prefetch_width(record.get("prefetch_width", "plan") if record["prefetch"]
                                                         else None)
                    or ev["eviction"] != record["eviction"]):
                continue
        if record["policy"] == "uniform" and ev["uniform_width"] != record.get("uniform_width"):
            continue
        if record["policy"] == "crisp" and ev.get("width_cap") != record.get("width_cap"):
            continue  # a capped CRISP plan's loss is not the uncapped plan's
        if record["policy"] == "crisp" and not _same_weight(ev.get("aux_full_weight"), record.get("aux_full_weight")):
            continue  # nor a weight-promoted plan's
        if record["policy"] == "crisp" and not _same_weight(ev.get("aux_skip_weight"), record.get("aux_skip_weight")):
            continue  # nor a three-band plan's
        if record["policy"] == "skip_aux" and not _same_weight(ev["skip_threshold"], record.get("skip_threshold")):
            continue
        return ev["accuracy_loss"], ev["source"]
    return None, None


def _same_weight(a, b) -> bool:
    """Two routing-weight thresholds (None = none) name the same configuration (JSON round trips to 1e-6)."""
    return (a is None) == (b is None) and (a is None or abs(a - b) <= 1e-6)


# ---------------------------------------------------------------------------- frontier plot


def pareto(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (lower loss, higher tokens/s), by loss."""
    best = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not best or y > best[-1][1]:
            best.append((x, y))
    return best


def plot_frontier(path, records: Sequence[dict], *, title: str, note: str) -> None:
    """Tokens/s against accuracy loss, one line per family over its knob, its Pareto frontier bold."""
    import matplotlib

    from .report import png_metadata, write_atomic

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.6), dpi=120)
    families: dict[str, list[dict]] = {}
    for r in records:
        if r.get("family") and r.get("accuracy_loss") is not None:
            families.setdefault(r["family"], []).append(r)
    for fam, rows in families.items():
        pts = sorted((100 * r["accuracy_loss"], r["tokens_per_s"]) for r in rows)
        line, = ax.plot(*zip(*pts, strict=True), marker="o", linestyle=":", alpha=0.6, label=f"{fam} (knob sweep)")
        front = pareto(pts)
        ax.plot(*zip(*front, strict=True), color=line.get_color(), linewidth=2.2)
        for r in rows:
            v = r["knob_value"]
            ax.annotate(f"{v:g}" if isinstance(v, (int, float)) else "always" if v is None else str(v),
                        (100 * r["accuracy_loss"], r["tokens_per_s"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    base = [r for r in records if r.get("label") == "full/plan/lru"]
    if base:
        ax.axhline(base[0]["tokens_per_s"], color="0.4", linestyle="--", linewidth=1, label="full-width LRU")
    missing = sorted({r["label"] for r in records if r.get("family") and r.get("accuracy_loss") is None})
    if missing:
        note = f"{note}; not drawn (accuracy not evaluated): {len(missing)} configurations"
    ax.set_xlabel("relative accuracy loss vs 4-bit full width (%)")
    ax.set_ylabel("simulated decode tokens/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, note, fontsize=6, color="0.35")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", metadata=png_metadata("crisp-bench")))
    plt.close(fig)


def plot_configurations(path, records: Sequence[dict], *, title: str, note: str) -> None:
    """One horizontal bar per configuration (widest-first order, the runtime's), tokens/s, annotated with
    the speed-up over full-width LRU (router order) and the evaluated accuracy loss."""
    import matplotlib

    from .report import png_metadata, write_atomic

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r["order"] == "widest_first"]
    base = next((r for r in records if r["label"] == "full/plan/lru" and r["order"] == "router"), None)
    fig, ax = plt.subplots(figsize=(8, 0.38 * len(rows) + 1.4), dpi=120)
    ys = range(len(rows))[::-1]
    colors = ["0.55" if r["eviction"] == "belady" else "tab:blue" if r["policy"] == "crisp" else "tab:orange"
              for r in rows]
    ax.barh(list(ys), [r["tokens_per_s"] for r in rows], color=colors)
    ax.set_yticks(list(ys), [r["label"] for r in rows], fontsize=7)
    for y, r in zip(ys, rows, strict=True):
        parts = [f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"] if base else []
        parts.append("loss n/a" if r.get("accuracy_loss") is None else f"loss {100 * r['accuracy_loss']:.2f}%")
        ax.text(r["tokens_per_s"], y, "  " + ", ".join(parts), va="center", fontsize=6)
    if base:
        ax.axvline(base["tokens_per_s"], color="0.3", linestyle="--", linewidth=1)
    ax.set_xlabel("simulated decode tokens/s (widest-first order; dashed: full-width LRU, router order)")
    ax.set_xlim(0, 1.3 * max(r["tokens_per_s"] for r in rows))
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    fig.text(0.01, 0.01, note + "; grey: Belady (offline bound)", fontsize=6, color="0.35")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", metadata=png_metadata("crisp-bench")))
    plt.close(fig)


# ---------------------------------------------------------------------------- the product's default

DEFAULT_POLICY = "crisp-default"  # the records of what crisp_runtime.apply runs by default (planning.defaults)


def default_configuration(plan: CrispPlan, info: Mapping, top_k: int, budget_fraction: float,
                          profile) -> tuple[SimPolicy, ServingChoice, bool]:
    """What ``crisp_runtime.apply(model, pack, gpu_budget=B)`` runs with no other argument, as a simulated
    configuration: ``planning.defaults.choose_serving`` on the pack's info at this budget, and ``cpu="auto"``'s
    rule (``crisp_runtime.cpu.knob.cpu_pays``) on the profile's CPU and copy bandwidths: (the configuration, the
    choice, whether the CPU is used). The runtime measures its bandwidths; the simulator takes the profile's."""
    choice = choose_serving(info, pack_facts(info, plan, top_k), budget_fraction)
    cpu = profile.cpu_bytes_per_s
    uses_cpu = (choice.cpu is not CpuMode.OFF and cpu is not None and choice.hybrid is not None
                and cpu_pays(cpu, profile.h2d_bytes_per_s))
    cfg = choice.hybrid if uses_cpu else choice.config
    pf = cfg.prefetch
    if pf is not None and pf.extra_experts:
        raise ValueError(f"{DEFAULT_POLICY}: the choice prefetches {pf.extra_experts} extra experts per token, which "
                         "the simulator does not model")
    eviction = cfg.eviction if isinstance(cfg.eviction, str) else getattr(cfg.eviction, "name", "")
    sim = SimPolicy(DEFAULT_POLICY, plan, cfg.serving, eviction, pf is not None,
                    PrefetchWidth.PLAN if pf is None else pf.width)
    return sim, choice, uses_cpu


def default_accuracy(record: dict, choice: ServingChoice, evaluated: Sequence[dict]) -> tuple[float | None, str | None]:
    """A ``crisp-default`` record's loss: the held-out loss the pack stores with its choice (measured when the
    pack was made: ``crisp-profile --gpu-budget``), else an evaluation of the same configuration
    (:func:`accuracy_for` as the ``crisp`` family), else (None, None)."""
    stored = choice.stored
    if stored is not None and record["serving_policy"].get("placement", "gpu") == "gpu":
        loss = stored.search.get("accuracy_loss_heldout")
        if loss is not None:
            how = stored.search.get("accuracy_heldout_source", "held-out decode")
            return float(loss), f"pack.json serving choice for {stored.gpu_budget_fraction:.0%}: {how}"
    return accuracy_for({**record, "policy": "crisp"}, evaluated)
