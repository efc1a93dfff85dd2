"""Which configurations a simulate run compares, how evaluated accuracy is attached, the Pareto frontier."""

from __future__ import annotations

import json

import pytest
from crisp_bench.sim_policies import (
    PROMOTE_WEIGHTS,
    PROMOTED_FLOORS,
    accuracy_for,
    configurations,
    knobs,
    pareto,
    read_accuracy,
)
from crisp_bench.traces import plan_from_trace, policy_plans, synthetic_trace


@pytest.fixture(scope="module")
def plans():
    trace = synthetic_trace(num_layers=2, num_tokens=64, intermediate_size=16)
    return policy_plans(trace, plan_from_trace(trace))


@pytest.mark.parametrize("prefetch", [False, True])
def test_residency_matrix(plans, prefetch):
    labels = [c.label for c in configurations(plans, "residency", prefetch=[False, True] if prefetch else [False])]
    expected = ["full/plan/lru", "full/plan/belady", "crisp/plan/lru", "crisp/resident/next_use",
                "crisp/resident-floor75/next_use"]
    if prefetch:
        expected += ["crisp/resident/next_use+prefetch", "crisp/resident-floor75/next_use+prefetch",
                     "crisp/resident/lru", "crisp/resident-floor75/lru", "crisp/resident/lru+prefetch",
                     "crisp/resident-floor75/lru+prefetch",
                     "crisp/resident-floor75/belady+prefetch", "uniform/resident/next_use",
                     "uniform/resident/next_use+prefetch", "skip_aux/resident/next_use",
                     "skip_aux/resident/next_use+prefetch"]
    else:
        expected += ["crisp/resident/lru", "crisp/resident-floor75/lru", "crisp/resident-floor75/belady",
                     "uniform/resident/next_use", "skip_aux/resident/next_use"]
    assert labels == expected


def test_product_matrix_always_has_the_full_lru_baseline(plans):
    configs = configurations({"crisp": plans["crisp"], "full": plans["full"]}, "product", serving=["resident"],
                             evictions=["next_use"], prefetch=[True])
    assert [c.label for c in configs] == ["full/plan/lru", "crisp/resident/next_use+prefetch",
                                          "full/resident/next_use+prefetch"]
    with pytest.raises(ValueError, match="matrix"):
        configurations(plans, "everything")


def test_product_matrix_takes_floor_policy_names(plans):
    configs = configurations({"crisp": plans["crisp"], "full": plans["full"]}, "product",
                             serving=["resident-floor87.5-narrow-aux"], prefetch=[True])
    crisp = [c for c in configs if c.name == "crisp"]
    assert [c.serving.dominant_floor for c in crisp] == [0.875]
    assert crisp[0].serving.aux_narrower.value == "narrow_only"
    assert crisp[0].label.startswith("crisp/resident-floor87.5")
    with pytest.raises(ValueError, match="unknown policy"):
        configurations(plans, "product", serving=["resident-floor0"])


def test_frontier_sweeps_each_family_knob(plans):
    configs = configurations(plans, "frontier", prefetch=[False, True])
    floors = sorted(c.serving.dominant_floor for c in configs if c.name == "crisp" and c.serving.name != "plan"
                    and c.plan.width_cap is None and c.plan.aux_full_weight is None)
    assert floors == [0.5, 0.625, 0.75, 0.875, 1.0] and all(c.prefetch for c in configs[1:])
    assert all(c.serving.name == "plan" for c in configs if c.name in ("uniform", "skip_aux"))
    assert len({c.label for c in configs}) == len(configs)  # one record per configuration
    assert len({c.plan.uniform_width for c in configs if c.name == "uniform"}) >= 4
    assert None in {c.plan.skip_threshold for c in configs if c.name == "skip_aux"}  # "always skip" is a point
    caps = [c.plan.width_cap for c in configs if c.name == "crisp" and c.plan.width_cap is not None]
    inter = plans["crisp"].intermediate_size
    exact_caps = [c.plan.width_cap for c in configs if c.plan.width_cap is not None and c.serving.name == "plan"]
    assert exact_caps == [round(0.75 * inter), round(0.875 * inter)]  # the capped CRISP plans at the plan's widths
    assert len(caps) == 2 * 7  # ... and residency-aware at each of the 6 floors
    promoted = [(c.plan.aux_full_weight, c.serving.name) for c in configs if c.plan.aux_full_weight is not None]
    assert [w for w, s in promoted if s == "plan"] == list(PROMOTE_WEIGHTS)  # weight-promoted at the plan's widths
    assert len(promoted) == len(PROMOTE_WEIGHTS) * (1 + 2 * len(PROMOTED_FLOORS))  # ... residency-aware per floor, x2
    assert all(c.plan.width_cap is None for c in configs if c.plan.aux_full_weight is not None)


def test_frontier_of_a_three_band_plan_promotes_only_at_or_above_its_skip_weight(plans):
    banded = {**plans, "crisp": plans["crisp"].skipping(0.3)}
    configs = configurations(banded, "frontier", prefetch=[True])  # promoted(0.25) would be refused: not built
    weights = sorted({c.plan.aux_full_weight for c in configs if c.plan.aux_full_weight is not None})
    assert weights == [w for w in PROMOTE_WEIGHTS if w >= 0.3]
    assert all(c.plan.aux_skip_weight == 0.3 for c in configs if c.name == "crisp")


def test_a_weight_promoted_plan_takes_only_its_own_weight_s_accuracy(plans, tmp_path):
    batch = tmp_path / "eval.json"
    batch.write_text(json.dumps({"model": "models/synthetic", "records": [
        {"policy": "crisp", "relative_accuracy_loss_vs_full": 0.013},
        {"policy": "crisp", "aux_full_weight": 0.3, "relative_accuracy_loss_vs_full": 0.008}]}))
    serving = tmp_path / "serving.json"
    serving.write_text(json.dumps({"format": "crisp-eval-serving", "model": "models/synthetic", "records": [
        {"policy": "crisp-resident+prefetch", "plan": "crisp", "budget_fraction": 0.25,
         "serving": {"name": "resident", "hit_width": "resident", "aux_narrower": "resident",
                     "aux_missing": "load", "dominant_floor": 1.0, "exact": False},
         "prefetch": {"extra_experts": 0}, "plan_detail": {"aux_full_weight": 0.35}, "accuracy_loss": 0.007}]}))
    evaluated, _ = read_accuracy([batch, serving], "models/synthetic")
    configs = {c.label: c for c in configurations(plans, "frontier", prefetch=[True])}
    got = {label: accuracy_for(_record(c), evaluated)[0] for label, c in configs.items() if c.name == "crisp"}
    assert got["crisp/plan/lru+prefetch"] == 0.013 and got["crisp@aux0.3/plan/lru+prefetch"] == 0.008
    assert got["crisp@aux0.35/plan/lru+prefetch"] is None  # no batch evaluation of that weight
    assert got["crisp@aux0.35/resident/lru+prefetch"] == 0.007  # the decode of that weight and serving
    assert got["crisp/resident/lru+prefetch"] is None and got["crisp@aux0.3/resident/lru+prefetch"] is None


def test_a_three_band_plan_takes_only_its_own_thresholds_accuracy(plans, tmp_path):
    """CrispPlan.aux_skip_weight is matched per record like aux_full_weight, and AuxSkipped per serving policy."""
    from bench.sim_policies import SimPolicy
    from crisp_runtime.planning.serving import SERVING_POLICIES

    banded = plans["crisp"].promoted(0.4).skipping(0.2)
    batch = tmp_path / "eval.json"
    batch.write_text(json.dumps({"model": "models/synthetic", "records": [
        {"policy": "crisp", "aux_full_weight": 0.4, "relative_accuracy_loss_vs_full": 0.010},
        {"policy": "crisp", "aux_full_weight": 0.4, "aux_skip_weight": 0.2, "relative_accuracy_loss_vs_full": 0.011}]}))
    serving = tmp_path / "serving.json"
    revive = SERVING_POLICIES["resident-narrow-aux-revive"]
    serving.write_text(json.dumps({"format": "crisp-eval-serving", "model": "models/synthetic", "records": [
        {"policy": "crisp-revive+prefetch", "plan": "crisp", "budget_fraction": 0.25,
         "serving": {**revive.to_dict(), "exact": False}, "prefetch": {"extra_experts": 0},
         "plan_detail": {"aux_full_weight": 0.4, "aux_skip_weight": 0.2}, "accuracy_loss": 0.009}]}))
    evaluated, _ = read_accuracy([batch, serving], "models/synthetic")

    def loss(plan, serving_name, prefetch=True):
        sim = SimPolicy("crisp", plan, SERVING_POLICIES[serving_name], "lru", prefetch=prefetch)
        return accuracy_for(_record(sim), evaluated)[0]

    assert loss(banded, "plan") == 0.011 and loss(plans["crisp"].promoted(0.4), "plan") == 0.010
    assert loss(plans["crisp"].promoted(0.4).skipping(0.25), "plan") is None  # no evaluation of that threshold
    assert loss(banded, "resident-narrow-aux-revive") == 0.009
    assert loss(banded, "resident-narrow-aux") is None  # the decode revived skipped auxiliaries: not this policy


def test_a_capped_plan_takes_only_its_own_cap_s_accuracy(plans, tmp_path):
    cap = round(0.75 * plans["crisp"].intermediate_size)
    batch = tmp_path / "eval.json"
    batch.write_text(json.dumps({"model": "models/synthetic", "records": [
        {"policy": "crisp", "relative_accuracy_loss_vs_full": 0.013},
        {"policy": "crisp", "width_cap": cap, "relative_accuracy_loss_vs_full": 0.031}]}))
    evaluated, _ = read_accuracy([batch], "models/synthetic")
    configs = {c.label: c for c in configurations(plans, "frontier", prefetch=[True])}
    got = {label: accuracy_for(_record(c), evaluated)[0] for label, c in configs.items() if c.name == "crisp"}
    assert got["crisp/plan/lru+prefetch"] == 0.013
    assert got[f"crisp@cap{cap}/plan/lru+prefetch"] == 0.031
    assert got[f"crisp@cap{round(0.875 * plans['crisp'].intermediate_size)}/plan/lru+prefetch"] is None


def test_pareto_keeps_the_undominated_points():
    pts = [(1.0, 5.0), (0.5, 4.0), (2.0, 5.5), (1.5, 4.5), (0.5, 3.0), (3.0, 5.5)]
    assert pareto(pts) == [(0.5, 4.0), (1.0, 5.0), (2.0, 5.5)]


def _record(config, budget=0.25, **kw):
    return {"policy": config.name, "serving": config.serving.name, "budget_fraction": budget,
            "eviction": config.eviction, "prefetch": config.prefetch, **knobs(config), **kw}


def test_accuracy_is_attached_only_to_the_evaluated_configuration(plans, tmp_path):
    batch = tmp_path / "eval.json"
    batch.write_text(json.dumps({"model": "models/synthetic", "records": [
        {"policy": "crisp", "relative_accuracy_loss_vs_full": 0.013},
        {"policy": "uniform", "uniform_width": plans["uniform"].uniform_width + 1,
         "relative_accuracy_loss_vs_full": 0.04}]}))
    serving = tmp_path / "serving.json"
    serving.write_text(json.dumps({"format": "crisp-eval-serving", "model": "models/synthetic", "records": [
        {"policy": "crisp-resident-floor0.75+prefetch", "plan": "crisp", "budget_fraction": 0.25,
         "serving": {"name": "resident-floor0.75", "hit_width": "resident", "aux_narrower": "resident",
                     "aux_missing": "load", "dominant_floor": 0.75, "exact": False},
         "prefetch": {"extra_experts": 0}, "plan_detail": {}, "accuracy_loss": 0.015}]}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": "models/other-model", "records": [{"policy": "full", "accuracy_loss": 0}]}))
    evaluated, notes = read_accuracy([batch, serving, other], "models/synthetic")
    assert any("not used" in n for n in notes)
    configs = {c.label: c for c in configurations(plans, "residency", prefetch=[False, True])}
    got = {label: accuracy_for(_record(c), evaluated)[0] for label, c in configs.items()}
    assert got["crisp/plan/lru"] == 0.013  # exact serving: any budget
    assert got["crisp/resident-floor75/lru+prefetch"] == 0.015  # the evaluation ran the runtime's LRU
    assert got["crisp/resident-floor75/next_use+prefetch"] is None  # another eviction: other served widths
    assert got["crisp/resident-floor75/lru"] is None  # evaluated with prefetch only
    assert got["uniform/resident/next_use"] is None and got["full/plan/lru"] is None
    c = configs["crisp/resident-floor75/lru+prefetch"]
    assert accuracy_for(_record(c, budget=0.1), evaluated) == (None, None)  # another budget


def test_from_json_reattaches_accuracy_without_simulating(tmp_path):
    from crisp_bench.cli import main

    trace = synthetic_trace(num_layers=2, num_tokens=48, intermediate_size=16)
    trace.save(tmp_path / "t.npz")
    common = ["simulate", "--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--target", "native", "--warmup", "8",
              "--policies", "full,crisp", "--orders", "widest_first"]
    assert main([*common, "--accuracy", str(tmp_path / "none.json"), "--json", str(tmp_path / "a.json")]) == 2
    (tmp_path / "none.json").write_text(json.dumps({"records": []}))
    assert main([*common, "--accuracy", str(tmp_path / "none.json"), "--json", str(tmp_path / "a.json")]) == 0
    first = json.loads((tmp_path / "a.json").read_text())["records"]
    assert all(r["accuracy_loss"] is None for r in first)
    (tmp_path / "eval.json").write_text(json.dumps({"model": "synthetic", "records": [
        {"policy": "crisp", "relative_accuracy_loss_vs_full": 0.01}]}))
    assert main([*common, "--accuracy", str(tmp_path / "eval.json"), "--from-json", str(tmp_path / "a.json"),
                 "--json", str(tmp_path / "b.json")]) == 0
    again = json.loads((tmp_path / "b.json").read_text())["records"]
    assert [r["tokens_per_s"] for r in again] == [r["tokens_per_s"] for r in first]
    assert {r["label"]: r["accuracy_loss"] for r in again} == {"full/plan/lru": None, "crisp/plan/lru": 0.01}


@pytest.mark.parametrize("layout, floor_unit, attached", [
    ("2g128at0.25", None, False),  # a tail pack's floor counted in storage rows: not attached
    ("2g128at0.25", "neurons", True),
    (None, None, True),  # a 4-bit pack: rows are neurons, every record is what it says
])
def test_a_tail_pack_floor_decoded_as_storage_rows_is_not_attached(plans, tmp_path, layout, floor_unit, attached):
    rec = {"policy": "crisp-resident-floor0.75+prefetch", "plan": "crisp", "budget_fraction": 0.25,
           "serving": {"name": "resident-floor0.75", "hit_width": "resident", "aux_narrower": "resident",
                       "aux_missing": "load", "dominant_floor": 0.75, "exact": False},
           "prefetch": {"extra_experts": 0}, "plan_detail": {}, "accuracy_loss": 0.015}
    exact = {**rec, "policy": "crisp-exact", "serving": {**rec["serving"], "dominant_floor": 1.0, "exact": True}}
    if floor_unit is not None:
        rec["floor_unit"] = floor_unit
    doc = {"format": "crisp-eval-serving", "model": "models/synthetic", "records": [rec, exact]}
    if layout is not None:
        doc["tail_layout"] = layout
    path = tmp_path / "serving.json"
    path.write_text(json.dumps(doc))
    evaluated, notes = read_accuracy([path], "models/synthetic")
    floors = [r for r in evaluated if r["serving"] is not None]
    assert len(floors) == int(attached) and len(evaluated) == 1 + int(attached)  # the floor-1 record always
    assert any("fraction of its storage rows" in n for n in notes) != attached
