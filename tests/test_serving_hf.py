"""Serving policies through the transformers drop-in: apply(serving=...) on a tiny Mixtral."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_dropin import logits, make_model  # noqa: E402

from crisp_runtime import CrispPlan, RuntimeConfig, ServingPolicy, apply  # noqa: E402
from crisp_runtime.execution.runtime import min_budget_bytes


def test_default_serving_logits_do_not_depend_on_the_budget():
    model = make_model("mixtral")
    with apply(model, cpu="off") as handle:  # every expert resident: the device path, as the budgets' below
        layers, top_k = handle.layers, handle.plan.top_k
        resident = logits(model)
    tight = min_budget_bytes(layers, top_k)
    for budget in (tight, 3 * tight):
        with apply(model, gpu_budget=budget, serving="plan") as handle:
            torch.testing.assert_close(logits(model), resident, rtol=1e-5, atol=1e-5)
            assert handle.stats()["fallbacks"] == 0 and handle.stats()["served_wider"] == 0


@pytest.mark.parametrize("serving", ["resident", "resident-floor75",
                                     ServingPolicy("aux-skip", "wanted", "resident", "skip", 0.5)])
def test_residency_aware_serving_through_apply(serving):
    model = make_model("mixtral")
    with apply(model) as handle:
        layers = handle.layers
    uniform = CrispPlan.uniform(4, 2, 32, sorted(layers), 20)  # dominants want 20 of 32 neurons
    budget = min_budget_bytes(layers, 2)
    with apply(model, plan=uniform, gpu_budget=budget, serving=serving) as handle:
        runtime = handle.runtime
        policy = runtime.serving
        assert runtime.config.serving is policy and policy == RuntimeConfig(serving=serving).serving
        out = logits(model)
        assert torch.isfinite(out).all()
        floor = min(20, math.ceil(policy.dominant_floor * 32))
        for served in runtime.last_served.values():
            dom = served.dominant & (served.wanted > 0)
            assert bool((served.widths[dom] >= floor).all())
        stats = handle.stats()
        assert stats["served_dominant_slots"] + stats["served_aux_slots"] == stats["tokens"] * 2 * len(layers) - (
            stats["serving_skips"])
        assert runtime.cache.peak <= budget


def test_bad_serving_is_refused_before_anything_happens():
    model = make_model("mixtral")
    with pytest.raises(ValueError, match="serving"):
        apply(model, serving="fastest")
    assert model.get_experts_implementation() != "crisp"


def test_any_floor_name_runs_through_apply_and_stats_name_it():
    model = make_model("mixtral")
    with apply(model, gpu_budget="512KiB", serving="resident-floor50", cpu="off") as handle:
        logits(model)
        assert handle.runtime.config.serving.dominant_floor == 0.5
        assert handle.stats()["serving"]["running"]["serving"] == "resident-floor50"


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(serving={"name": "plan", "hit_width": "resident", "aux_narrower": "resident", "aux_missing": "skip",
                   "dominant_floor": 0.5}), "differs from the built-in 'plan'"),
    (dict(serving="paper", config=RuntimeConfig(eviction="next_use")), "serving='paper' runs"),
    (dict(serving="plan", config=RuntimeConfig(serving="resident-floor75")), "disagree"),
])
def test_serving_that_would_misreport_what_runs_is_refused_before_anything_happens(kwargs, match):
    model = make_model("mixtral")
    with pytest.raises(ValueError, match=match):
        apply(model, gpu_budget="512KiB", cpu="off", **kwargs)
    assert model.get_experts_implementation() != "crisp"
