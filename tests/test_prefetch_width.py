"""The prefetch width option (crisp_runtime.scheduling.prefetch.PrefetchWidth): the widths each option asks, its
validation, and that evaluated accuracy is attached only to a simulation at the same prefetch width."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from crisp_bench.sim_policies import accuracy_for, configurations, knobs, read_accuracy, with_prefetch_widths
from crisp_bench.traces import plan_from_trace, policy_plans, synthetic_trace

from crisp_runtime.planning.serving import SERVING_POLICIES, AuxMissing
from crisp_runtime.scheduling.prefetch import PrefetchPolicy, PrefetchWidth, slot_widths

INTER = 16
SKIP_AUX = replace(SERVING_POLICIES["resident-floor75"], name="floor75-skip", aux_missing=AuxMissing.SKIP)


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(num_layers=2, num_tokens=64, intermediate_size=INTER, seed=7)


@pytest.mark.parametrize("width", list(PrefetchWidth))
@pytest.mark.parametrize("serving", [SERVING_POLICIES["plan"], SERVING_POLICIES["resident"],
                                     SERVING_POLICIES["resident-floor75"], SKIP_AUX], ids=lambda s: s.name)
def test_slot_widths_follow_the_option(trace, width, serving):
    """Per slot, from the plan's wanted width w and role: PLAN w; AUX_NONE w for a dominant, 0 for an
    auxiliary; SERVING min(w, ceil(floor x I)) for a dominant, w for an auxiliary (0 if skipped)."""
    plan = plan_from_trace(trace)
    layer = trace.layer_ids[1]
    index = torch.from_numpy(trace.index[1]).to(torch.int64)
    weights = torch.from_numpy(trace.weights[1])
    wanted, dominant = plan.token_widths_and_roles(layer, index, weights, roles=True)
    got = slot_widths(PrefetchPolicy(width=width), plan, serving, layer, index, weights)
    assert got.shape == wanted.shape and got.dtype == torch.int64
    floor = math.ceil(serving.dominant_floor * INTER)
    for w, d, g in zip(wanted.reshape(-1).tolist(), dominant.reshape(-1).tolist(), got.reshape(-1).tolist(),
                       strict=True):
        if width is PrefetchWidth.PLAN:
            expected = w
        elif width is PrefetchWidth.AUX_NONE:
            expected = w if d else 0
        elif d:
            expected = min(w, floor)
        else:
            expected = w if serving.aux_missing is AuxMissing.LOAD else 0
        assert g == expected
    # the trace has both roles and wanted widths above the 75% floor: the options differ where they should
    assert dominant.any() and (~dominant & (wanted > 0)).any() and (wanted[dominant] > math.ceil(0.75 * INTER)).any()


def test_prefetch_policy_validates_and_records_its_width():
    assert PrefetchPolicy().width is PrefetchWidth.PLAN
    assert PrefetchPolicy(width="serving").width is PrefetchWidth.SERVING
    assert PrefetchPolicy(width="aux-none").to_dict()["width"] == "aux-none"
    with pytest.raises(ValueError, match="width must be one of plan, serving, aux-none"):
        PrefetchPolicy(width="full")


def test_accuracy_attached_only_at_the_evaluated_prefetch_width(trace, tmp_path):
    plans = policy_plans(trace, plan_from_trace(trace))
    serving = {"name": "resident-floor0.75", "hit_width": "resident", "aux_narrower": "resident",
               "aux_missing": "load", "dominant_floor": 0.75, "exact": False}
    path = tmp_path / "serving.json"
    path.write_text(json.dumps({"format": "crisp-eval-serving", "model": "models/synthetic", "records": [
        {"policy": "a", "plan": "crisp", "budget_fraction": 0.25, "serving": serving, "plan_detail": {},
         "prefetch": {"extra_experts": 0}, "accuracy_loss": 0.0196},  # written before the option: plan widths
        {"policy": "b", "plan": "crisp", "budget_fraction": 0.25, "serving": serving, "plan_detail": {},
         "prefetch": PrefetchPolicy(width="aux-none").to_dict(), "accuracy_loss": 0.017}]}))
    evaluated, _ = read_accuracy([path], "models/synthetic")
    configs = with_prefetch_widths(configurations(plans, "residency", prefetch=[False, True]),
                                   ["plan", "serving", "aux-none"])
    got = {}
    for c in configs:
        record = {"policy": c.name, "serving": c.serving.name, "budget_fraction": 0.25, "eviction": c.eviction,
                  "prefetch": c.prefetch, "prefetch_width": c.prefetch_width.value if c.prefetch else None,
                  **knobs(c)}
        got[c.label] = accuracy_for(record, evaluated)[0]
    assert got["crisp/resident-floor75/lru+prefetch"] == 0.0196
    assert got["crisp/resident-floor75/lru+prefetch-aux-none"] == 0.017
    assert got["crisp/resident-floor75/lru+prefetch-serving"] is None  # not evaluated
    assert got["crisp/resident-floor75/lru"] is None
    # every prefetching configuration once per width, the others once
    assert len(configs) == len(configurations(plans, "residency", prefetch=[False, True])) + 2 * sum(
        c.prefetch for c in configurations(plans, "residency", prefetch=[False, True]))


def test_simulate_cli_runs_each_prefetch_width(trace, tmp_path, capsys):
    from crisp_bench import traces as tr
    from crisp_bench.cli import main

    predicted = np.full((trace.num_layers, trace.num_tokens, 2), -1, dtype=np.int64)
    predicted[:-1] = trace.index[1:]  # a perfect prediction of the next layer
    tr.Trace(trace.index, trace.weights, trace.layer_ids, {**trace.meta, "model": "synthetic"},
             predicted=predicted).save(tmp_path / "t.npz")
    (tmp_path / "none.json").write_text(json.dumps({"records": []}))
    common = ["simulate", "--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--target", "native", "--warmup", "8",
              "--policies", "full,crisp", "--serving", "resident-floor75", "--orders", "widest_first",
              "--prefetch", "trace", "--accuracy", str(tmp_path / "none.json")]
    assert main([*common, "--prefetch-width", "plan,serving,aux-none", "--json", str(tmp_path / "a.json")]) == 0
    records = json.loads((tmp_path / "a.json").read_text())["records"]
    widths = {r["label"]: r["prefetch_width"] for r in records if r["policy"] == "crisp"}
    assert widths == {"crisp/resident-floor75/lru+prefetch": "plan",
                      "crisp/resident-floor75/lru+prefetch-serving": "serving",
                      "crisp/resident-floor75/lru+prefetch-aux-none": "aux-none"}
    by = {r["label"]: r for r in records}
    assert (by["crisp/resident-floor75/lru+prefetch-serving"]["prefetch_bytes_per_token"]
            < by["crisp/resident-floor75/lru+prefetch"]["prefetch_bytes_per_token"])  # floor-width dominants
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # argparse: usage error, exit status 2
        main([*common, "--prefetch-width", "full"])
    assert exc.value.code == 2
    assert "--prefetch-width" in capsys.readouterr().err
    assert main([*common, "--prefetch-width", "serving", "--matrix", "frontier"]) == 2
    assert "frontier" in capsys.readouterr().err


@pytest.mark.parametrize("eviction", ["lru", "next_use"])
def test_serving_case_eviction_is_recorded_for_the_accuracy_match(trace, eviction):
    """An evaluation's record names a non-default eviction, so that the simulator attaches its accuracy
    to that eviction only (an unnamed one ran the runtime's default, LRU)."""
    from crisp_tools.calibration import TokenScores
    from crisp_tools.serving_eval import ServingCase, record

    case = ServingCase("c", "crisp", "resident-floor75", PrefetchPolicy(width="serving"), eviction=eviction)
    scores = TokenScores(torch.full((2, 5), 0.7), torch.tensor([[True] * 4 + [False]] * 2))
    rec = record(case, 0.25, 100, scores, {"tokens": 10}, scores, plan_from_trace(trace), 1.0)
    assert rec.get("eviction") == (None if eviction == "lru" else eviction)
    ev = read_accuracy_rows([{**rec, "accuracy_loss": 0.03}])
    assert ev["eviction"] == eviction and ev["prefetch"] == "serving"
    with pytest.raises(ValueError, match="eviction must be one of"):
        ServingCase("c", eviction="fifo")


def read_accuracy_rows(records):
    from crisp_bench.sim_policies import _evaluated

    (row,) = [_evaluated(r) for r in records]
    return row
