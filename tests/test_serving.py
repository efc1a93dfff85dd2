"""Serving policies: the rules against a brute force, the runtime's outputs against a reference at the widths
it served, the dominant floor, the budget with prefetch on, and the default policy's independence of the budget."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_helpers import random_layers

from crisp_kernels import dequantize_expert
from crisp_runtime import CrispPlan, RuntimeConfig, Tier, TierWidths
from crisp_runtime.execution.runtime import CrispRuntime, min_budget_bytes
from crisp_runtime.planning.plan import LayerPlan
from crisp_runtime.planning.serving import (
    SERVING_POLICIES,
    AuxMissing,
    AuxNarrower,
    AuxSkipped,
    DominantWiden,
    HitWidth,
    ServingPolicy,
    ahead_width,
    make_serving,
    miss_width,
    serve_slots,
)

E, INTER, TOP_K = 6, 16, 2
LAYER_IDS = (1, 2)
LAYERS = random_layers(layer_ids=LAYER_IDS, num_experts=E, inter=INTER, seed=3)
NB = LAYERS[1].fmt.neuron_nbytes(LAYERS[1].hidden_size)
DEQ = {i: [dequantize_expert(layer.expert(e), dtype=torch.float64) for e in range(E)] for i, layer in LAYERS.items()}

policies = st.builds(ServingPolicy, st.just("p"), st.sampled_from(list(HitWidth)), st.sampled_from(list(AuxNarrower)),
                     st.sampled_from(list(AuxMissing)), st.sampled_from([1.0, 0.75, 0.5, 0.0625]),
                     dominant_widen=st.sampled_from(list(DominantWiden)), aux_skipped=st.sampled_from(list(AuxSkipped)))


def reference(layer_id, x, index, weights, widths):
    """out[t] = sum_s weights[t, s] * expert_{index[t, s]}(x[t]) over its first widths[t, s] neurons, float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(index.shape[1]):
            e, w = int(index[t, s]), int(widths[t, s])
            if w == 0:
                continue
            gate, up, down = DEQ[layer_id][e]
            xt = x[t].double()
            out[t] += float(weights[t, s]) * (down[:, :w] @ (torch.nn.functional.silu(gate[:w] @ xt) * (up[:w] @ xt)))
    return out


def brute_serve(policy, index, wanted, dominant, resident, full, whole=None):
    """The module docstring's table, written out slot by slot with no shared code (``whole``: the plan's
    dominant width, default ``full``)."""
    whole = full if whole is None else whole
    slots = [(int(e), int(w), bool(d)) for e, w, d in zip(index.reshape(-1), wanted.reshape(-1),
                                                          dominant.reshape(-1), strict=True)]
    need = []
    for e, w, d in slots:
        r = resident.get(e, 0)
        if w == 0:
            need.append(0)
        elif r >= w or d and r > 0 and policy.dominant_widen is DominantWiden.HIT:  # a hit, or widened on demand
            need.append(w)
        elif d:  # NEVER and AHEAD: no demand copy beyond the floor
            need.append(max(r, min(w, math.ceil(policy.dominant_floor * full))))
        elif r > 0:  # NARROW_ONLY: narrower than resident only where the plan wants it narrower than whole
            narrow = policy.aux_narrower is AuxNarrower.RESIDENT or (
                policy.aux_narrower is AuxNarrower.NARROW_ONLY and w < whole)
            need.append(r if narrow else w)
        else:
            need.append(w if policy.aux_missing is AuxMissing.LOAD else 0)
    available = {}
    for (e, _, _), n in zip(slots, need, strict=True):
        available[e] = max(available.get(e, resident.get(e, 0)), n)
    served = []
    for e, w, d in slots:
        a = available[e]
        if w == 0:  # the plan skips it: an auxiliary runs at what its expert holds under AuxSkipped.RESIDENT
            served.append(a if policy.aux_skipped is AuxSkipped.RESIDENT and not d else 0)
        else:
            served.append(a if policy.hit_width is HitWidth.RESIDENT else min(w, a))
    return torch.tensor(served).reshape(wanted.shape)


@settings(max_examples=300, deadline=None)
@given(policies, st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_serve_slots_equals_brute_force(policy, tokens, k, seed):
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, 5, (tokens, k), generator=g)
    wanted = torch.randint(0, INTER + 1, (tokens, k), generator=g) * (torch.rand(tokens, k, generator=g) < 0.8)
    dominant = torch.rand(tokens, k, generator=g) < 0.4
    resident = {e: int(torch.randint(0, INTER + 1, (1,), generator=g)) for e in range(5)}
    whole = (INTER, 12)[seed % 2]  # the plan's dominant width: the full width, or a cap
    got = serve_slots(policy, index, wanted, dominant, num_experts=5, full_width=INTER,
                      resident_width=resident.__getitem__, whole_width=whole)
    want = brute_serve(policy, index, wanted, dominant, resident, INTER, whole)
    assert torch.equal(got.widths, want)
    active = wanted > 0
    assert got.fallbacks == int(((want < wanted) & (want > 0)).sum())
    assert got.skips == int((active & (want == 0)).sum())
    assert got.wider == int((want > wanted).sum())
    assert got.dominant_slots + got.aux_slots == int((want > 0).sum())
    assert got.dominant_neurons == int(want[dominant].sum()) and got.aux_neurons == int(want[~dominant].sum())
    floor = torch.clamp(wanted, max=math.ceil(policy.dominant_floor * INTER))
    assert bool((want[dominant & active] >= floor[dominant & active]).all())  # the dominant floor
    # widened on demand: dominants resident narrower than both the wanted width and the floor-served width
    res = torch.tensor([resident[int(e)] for e in index.reshape(-1)]).reshape(index.shape)
    never = torch.maximum(res, floor)
    if policy.dominant_widen is DominantWiden.HIT:
        assert got.widened == int((dominant & active & (res > 0) & (res < wanted) & (never < wanted)).sum())
        assert bool((want[dominant & active & (res > 0)] >= wanted[dominant & active & (res > 0)]).all())
    else:
        assert got.widened == 0


@pytest.mark.parametrize("whole", [INTER, 12])
def test_narrow_only_widens_the_auxiliaries_the_plan_wants_whole(whole):
    """AuxNarrower.NARROW_ONLY: an auxiliary wanted narrower than the plan's dominant width runs at its resident
    prefix (no copy), one wanted at the dominant width (heavy, or Hot) is widened to it; RESIDENT narrows both."""
    index = torch.tensor([[0, 1], [2, 3]])  # expert 1 and 3 auxiliaries, both resident at 4 neurons
    wanted = torch.tensor([[whole, 8], [whole, whole]])
    dominant = torch.tensor([[True, False], [True, False]])
    resident = {0: whole, 1: 4, 2: whole, 3: 4}
    narrow = serve_slots(SERVING_POLICIES["resident-narrow-aux"], index, wanted, dominant, num_experts=4,
                         full_width=INTER, resident_width=resident.__getitem__, whole_width=whole)
    assert narrow.widths.tolist() == [[whole, 4], [whole, whole]]
    plain = serve_slots(SERVING_POLICIES["resident"], index, wanted, dominant, num_experts=4, full_width=INTER,
                        resident_width=resident.__getitem__, whole_width=whole)
    assert plain.widths.tolist() == [[whole, 4], [whole, 4]]


@pytest.mark.parametrize("widen", list(DominantWiden))
@pytest.mark.parametrize("dominant", [True, False])
def test_ahead_width_is_what_the_first_use_needs(widen, dominant):
    """A prefetch at ahead_width leaves the slot's first use nothing to copy: served at most that width
    from a prefix of that width (HIT would widen a floor prefix on its first use: it asks the wanted width)."""
    policy = ServingPolicy("p", HitWidth.WANTED, AuxNarrower.RESIDENT, AuxMissing.LOAD, 0.5, dominant_widen=widen)
    for wanted in (1, 5, 8, 12, 16):
        ahead = ahead_width(policy, wanted, dominant, INTER)
        served = serve_slots(policy, torch.tensor([[0]]), torch.tensor([[wanted]]), torch.tensor([[dominant]]),
                             num_experts=1, full_width=INTER, resident_width=lambda e, a=ahead: a)
        assert int(served.widths) <= ahead
        assert ahead == (wanted if dominant and widen is DominantWiden.HIT else miss_width(policy, wanted, dominant,
                                                                                             INTER))


def test_default_policy_serves_the_plan_whatever_is_resident():
    index = torch.tensor([[0, 1], [2, 1]])
    wanted = torch.tensor([[16, 8], [0, 4]])
    for resident in ({}, {0: 3, 1: 16, 2: 1}):
        got = serve_slots(ServingPolicy(), index, wanted, None, num_experts=E, full_width=INTER,
                          resident_width=lambda e, r=resident: r.get(e, 0))
        assert torch.equal(got.widths, wanted) and (got.fallbacks, got.skips, got.wider) == (0, 0, 0)


@pytest.mark.parametrize("kwargs, match", [
    ({"dominant_floor": 0.0}, "dominant_floor"), ({"dominant_floor": 1.5}, "dominant_floor"),
    ({"dominant_floor": True}, "dominant_floor"), ({"hit_width": "sometimes"}, "hit_width"),
    ({"aux_missing": "maybe"}, "aux_missing"), ({"name": ""}, "name"),
    ({"dominant_widen": "always"}, "dominant_widen"),
])
def test_policy_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServingPolicy(**kwargs)


def test_skipped_auxiliaries_run_at_what_is_resident_and_copy_nothing():
    """AuxSkipped.RESIDENT: an auxiliary the plan skips runs at its expert's resident prefix, or at what the step
    copies for another slot of the same expert; none resident: still skipped. The step's copies are unchanged."""
    index = torch.tensor([[0, 1], [2, 3], [4, 0], [3, 5]])  # expert 0 dominant in step 1, auxiliary in step 3
    wanted = torch.tensor([[INTER, 0], [INTER, 0], [INTER, 0], [8, 0]])
    dominant = torch.tensor([[True, False], [True, False], [True, False], [True, False]])
    resident = {0: 0, 1: 6, 2: INTER, 3: 0, 4: INTER, 5: 0}
    revive = SERVING_POLICIES["resident-narrow-aux-revive"]
    assert revive.aux_skipped is AuxSkipped.RESIDENT and not revive.follows_plan
    got = serve_slots(revive, index, wanted, dominant, num_experts=6, full_width=INTER,
                      resident_width=resident.__getitem__)
    # expert 1 resident at 6; expert 3 none resident (skipped, though the token of row 3 copies 3's first 8 rows as a
    # dominant: the slot of row 1 gets them too); expert 0 gets INTER from row 0's copy; expert 5 none
    assert got.widths.tolist() == [[INTER, 6], [INTER, 8], [INTER, INTER], [8, 0]]
    assert got.wider == 3 and got.skips == 0 and got.aux_slots == 3 and got.aux_neurons == 6 + 8 + INTER
    plain = serve_slots(SERVING_POLICIES["resident-narrow-aux"], index, wanted, dominant, num_experts=6,
                        full_width=INTER, resident_width=resident.__getitem__)
    assert plain.widths.tolist() == [[INTER, 0], [INTER, 0], [INTER, 0], [8, 0]]
    # the tasks copy the same bytes: reviving reads only rows already resident or copied for the step
    from crisp_runtime.scheduling.scheduler import plan_step
    steps = [plan_step(index, s.widths, num_experts=6, neuron_nbytes=NB, resident_width=resident.__getitem__)
             for s in (got, plain)]
    assert steps[0].bytes_missing == steps[1].bytes_missing and steps[0].bytes_read > steps[1].bytes_read
    assert ServingPolicy.from_dict(revive.to_dict()) == revive and revive.to_dict()["aux_skipped"] == "resident"
    assert "aux_skipped" not in SERVING_POLICIES["resident-narrow-aux"].to_dict()  # older dicts stay as they were


@pytest.mark.parametrize(("name", "canonical", "floor", "narrow", "skipped"), [
    ("resident-floor87.5", "resident-floor87.5", 0.875, AuxNarrower.RESIDENT, AuxSkipped.SKIP),
    ("resident-floor100-narrow-aux", "resident-narrow-aux", 1.0, AuxNarrower.NARROW_ONLY, AuxSkipped.SKIP),
    ("resident-floor37.5-narrow-aux-revive", "resident-floor37.5-narrow-aux-revive", 0.375, AuxNarrower.NARROW_ONLY,
     AuxSkipped.RESIDENT),
    ("resident-floor75-revive", "resident-floor75-revive", 0.75, AuxNarrower.RESIDENT, AuxSkipped.RESIDENT),
    ("resident-floor87.50", "resident-floor87.5", 0.875, AuxNarrower.RESIDENT, AuxSkipped.SKIP),
])
def test_serving_by_name_builds_floor_policies(name, canonical, floor, narrow, skipped):
    from crisp_runtime.planning.serving import resident_policy, serving_by_name

    policy = serving_by_name(name)
    assert (policy.name, policy.dominant_floor, policy.aux_narrower, policy.aux_skipped) == (canonical, floor, narrow,
                                                                                             skipped)
    assert policy.hit_width is HitWidth.RESIDENT and policy.aux_missing is AuxMissing.LOAD
    assert policy == resident_policy(floor, narrow, skipped)  # the one constructor of floor policies
    assert serving_by_name(canonical) == policy  # its name names it
    # a floor the runtime names is that named policy itself (floor 1: "resident" / "resident-narrow-aux")
    assert serving_by_name("resident-floor75") is SERVING_POLICIES["resident-floor75"]
    assert serving_by_name("resident-floor100-narrow-aux") is SERVING_POLICIES["resident-narrow-aux"]
    with pytest.raises(ValueError, match="aux_narrower"):
        resident_policy(0.5, AuxNarrower.WIDEN)


@pytest.mark.parametrize("bad", ["resident-floor0", "resident-floor100.5", "resident-floor", "resident-floorx",
                                 "resident-floor-5", "resident-floor50-revive-narrow-aux", "resident-floornan",
                                 "floor50", "", "resident-floor1e2"])
def test_serving_by_name_refuses_nonsense(bad):
    from crisp_runtime.planning.serving import serving_by_name

    with pytest.raises(ValueError, match="unknown policy"):
        serving_by_name(bad)


@pytest.mark.parametrize(("name", "floor", "narrow"), [("resident-floor50", 0.5, False),
                                                     ("resident-floor87.5-narrow-aux", 0.875, True)])
def test_every_floor_name_works_through_make_serving_and_runtime_config(name, floor, narrow):
    from crisp_runtime.planning.serving import AuxNarrower, serving_by_name

    policy = make_serving(name)
    assert policy == serving_by_name(name) and policy.name == name and policy.dominant_floor == floor
    assert (policy.aux_narrower is AuxNarrower.NARROW_ONLY) is narrow
    assert RuntimeConfig(serving=name).serving == policy
    assert make_serving(policy.to_dict()) == policy  # its dict, with the built-in's fields, is accepted


@pytest.mark.parametrize("spec", [
    ServingPolicy("plan", "resident", "resident", "skip", 0.5),
    {"name": "plan", "hit_width": "resident", "aux_narrower": "resident", "aux_missing": "skip",
     "dominant_floor": 0.5},
    {**SERVING_POLICIES["resident"].to_dict(), "name": "resident-floor75"},
    ServingPolicy("cpu_only"),
])
def test_a_policy_with_a_built_in_name_and_other_fields_is_refused(spec):
    with pytest.raises(ValueError, match="differs from the built-in .*give it a name of its own"):
        make_serving(spec)
    with pytest.raises(ValueError, match="differs from the built-in"):
        RuntimeConfig(serving=spec)
    renamed = {**(spec.to_dict() if isinstance(spec, ServingPolicy) else spec), "name": "mine"}
    assert make_serving(renamed).name == "mine"


def test_policy_names_and_dict_round_trip():
    assert ServingPolicy().follows_plan and not SERVING_POLICIES["resident"].follows_plan
    for name, policy in SERVING_POLICIES.items():
        assert make_serving(name) is policy and make_serving(policy.to_dict()) == policy
    assert ServingPolicy(hit_width="resident").hit_width is HitWidth.RESIDENT
    assert RuntimeConfig(serving="resident-floor75").serving.dominant_floor == 0.75
    with pytest.raises(ValueError, match="serving"):
        RuntimeConfig(serving="fastest")
    with pytest.raises(ValueError, match="unknown keys"):
        ServingPolicy.from_dict({"name": "x", "floor": 1})
    # a policy that does not widen keeps the dict it had before the knob existed
    assert "dominant_widen" not in SERVING_POLICIES["resident-floor75"].to_dict()
    assert SERVING_POLICIES["resident-floor75-ahead"].to_dict()["dominant_widen"] == "ahead"


# ---------------------------------------------------------------------------- through the runtime


@st.composite
def plans(draw):
    kind = draw(st.sampled_from(["full", "uniform", "skip_threshold", "crisp"]))
    if kind == "full":
        return CrispPlan.full(E, TOP_K, INTER, LAYER_IDS)
    if kind == "uniform":
        return CrispPlan.uniform(E, TOP_K, INTER, LAYER_IDS, draw(st.integers(1, INTER)))
    if kind == "skip_threshold":
        return CrispPlan.skip_aux(E, TOP_K, INTER, LAYER_IDS, threshold=draw(st.floats(0.0, 0.6)))
    layers = {}
    for layer_id in LAYER_IDS:
        pairs = draw(st.lists(st.tuples(st.integers(0, E - 1), st.integers(0, E - 1)).filter(lambda p: p[0] < p[1]),
                              max_size=8, unique=True))
        layers[layer_id] = LayerPlan({p: draw(st.sampled_from(list(Tier))) for p in pairs},
                                     {p: draw(st.sampled_from(p)) for p in pairs})
    widths = TierWidths(INTER, draw(st.integers(0, INTER)), draw(st.integers(0, INTER)))
    promote = draw(st.sampled_from([None, 0.35, 0.45]))
    skip = draw(st.sampled_from([None, 0.2, 0.35]))  # a light band skipped (aux_skip_weight <= aux_full_weight)
    return CrispPlan.crisp(E, TOP_K, INTER, layers, widths, unseen_tier=draw(st.sampled_from(list(Tier))),
                           aux_full_weight=promote, aux_skip_weight=skip)


@st.composite
def sequences(draw):
    """Layer steps, each followed by an optional prefetch batch for the other layer."""
    out = []
    for _ in range(draw(st.integers(1, 8))):
        layer_id = draw(st.sampled_from(LAYER_IDS))
        prefetch = draw(st.lists(st.tuples(st.integers(0, E - 1), st.integers(1, INTER)), max_size=3))
        out.append((layer_id, draw(st.integers(1, 12)), draw(st.integers(0, 2**31 - 1)), prefetch))
    return out


def make_step(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g) * 2, dim=-1)
    return x, index, weights


def close(out, ref):
    err = (out.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    return err < 1e-5 or ref.norm() == 0 and out.abs().max() == 0


@settings(max_examples=30, deadline=None)
@given(plans(), policies, sequences(), st.integers(0, 5 * INTER))
def test_residency_aware_runtime_matches_reference_at_served_widths(plan, policy, steps, extra_neurons):
    budget = min_budget_bytes(LAYERS, TOP_K) + extra_neurons * NB
    runtime = CrispRuntime(LAYERS, plan, device="cpu", gpu_budget=budget, config=RuntimeConfig(serving=policy))
    floor = math.ceil(policy.dominant_floor * INTER)
    prefetched = 0
    changed = [0, 0, 0]  # fallbacks, skips, wider: counted here from the served widths
    for layer_id, tokens, seed, prefetch in steps:
        x, index, weights = make_step(tokens, seed)
        before = [runtime.cache.resident_width(layer_id, e) for e in range(E)]
        out = runtime.forward(layer_id, x, index, weights)
        served = runtime.last_served[layer_id]
        w, s = served.wanted, served.widths
        changed[0] += int(((s < w) & (s > 0)).sum())
        changed[1] += int(((w > 0) & (s == 0)).sum())
        changed[2] += int((s > w).sum())
        assert close(out, reference(layer_id, x, index, weights, served.widths))
        wanted, dominant = plan.token_widths_and_roles(layer_id, index, weights)
        assert torch.equal(served.wanted, wanted)
        dom = dominant & (wanted > 0)
        assert bool((served.widths[dom] >= wanted[dom].clamp(max=floor)).all())  # the floor, never below
        if policy.dominant_widen is DominantWiden.HIT:  # a dominant resident before the step: widened to wanted
            was = torch.tensor([before[int(e)] for e in index.reshape(-1)]).reshape(index.shape) > 0
            assert bool((served.widths[dom & was] >= wanted[dom & was]).all())
        assert runtime.cache.used <= budget
        other = LAYER_IDS[1 - LAYER_IDS.index(layer_id)]
        step_keys = {(layer_id, t.expert): runtime.cache.resident_width(layer_id, t.expert)
                     for t in runtime.last_step[layer_id].tasks}
        prefetched += sum(d.copy_bytes for d in runtime.prefetch(other, prefetch))
        # a prefetch never evicts (nor narrows) what the step just planned uses
        assert all(runtime.cache.resident_width(*key) == w for key, w in step_keys.items())
        assert runtime.cache.used <= budget
    stats = runtime.stats.as_dict()
    assert runtime.cache.peak <= budget
    assert stats["prefetch_bytes"] == prefetched
    assert stats["prefetch_hits"] <= stats["prefetches"]
    assert (stats["fallbacks"], stats["serving_skips"], stats["served_wider"]) == tuple(changed)


@settings(max_examples=12, deadline=None)
@given(plans(), sequences(), st.integers(0, 5 * INTER))
def test_default_policy_outputs_do_not_depend_on_the_budget(plan, steps, extra_neurons):
    runtimes = [CrispRuntime(LAYERS, plan, device="cpu", gpu_budget=b)
                for b in (None, min_budget_bytes(LAYERS, TOP_K), min_budget_bytes(LAYERS, TOP_K) + extra_neurons * NB)]
    for layer_id, tokens, seed, prefetch in steps:
        x, index, weights = make_step(tokens, seed)
        outs = [rt.forward(layer_id, x, index, weights) for rt in runtimes]
        ref = reference(layer_id, x, index, weights, plan.token_widths(layer_id, index, weights))
        assert all(close(out, ref) for out in outs)
        for rt in runtimes[1:]:
            assert torch.equal(rt.last_served[layer_id].widths, runtimes[0].last_served[layer_id].widths)
            rt.prefetch(LAYER_IDS[1 - LAYER_IDS.index(layer_id)], prefetch)


def test_prefetch_counts_hits_and_respects_the_step():
    plan = CrispPlan.full(E, TOP_K, INTER, LAYER_IDS)
    budget = 3 * INTER * NB
    runtime = CrispRuntime(LAYERS, plan, device="cpu", gpu_budget=budget)
    x, _, _ = make_step(1, 0)
    index, weights = torch.tensor([[0, 1]]), torch.tensor([[0.7, 0.3]])
    runtime.forward(1, x, index, weights)
    # Room for one more full expert; the step's experts (1, 0) and (1, 1) are protected.
    got = runtime.prefetch(2, [(3, INTER), (4, INTER)])
    assert [d.key for d in got] == [(2, 3)]
    assert runtime.cache.resident_width(1, 0) == runtime.cache.resident_width(1, 1) == INTER
    runtime.forward(2, x, torch.tensor([[3, 5]]), weights)
    stats = runtime.stats.layers[2]
    assert (stats.prefetches, stats.prefetch_rejected, stats.prefetch_hits) == (1, 1, 1)
    assert stats.prefetch_bytes == INTER * NB
    assert runtime.prefetch(2, [(3, 4)]) == []  # already resident
    with pytest.raises(ValueError, match="width"):
        runtime.prefetch(2, [(3, INTER + 1)])
    with pytest.raises(KeyError, match="no layer 7"):
        runtime.prefetch(7, [(3, 1)])
    no_offload = CrispRuntime(LAYERS, plan, device="cpu", gpu_budget=None)
    assert no_offload.prefetch(1, [(0, INTER)]) == []


@pytest.mark.parametrize("kind", ["full", "uniform", "skip", "crisp"])
def test_roles_agree_between_small_and_tensor_paths(kind):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(100, E, generator=g)
    weights, index = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
    index[::7, 1] = E  # padding sentinels get no role
    plan = {"full": CrispPlan.full(E, TOP_K, INTER, LAYER_IDS),
            "uniform": CrispPlan.uniform(E, TOP_K, INTER, LAYER_IDS, 5),
            "skip": CrispPlan.skip_aux(E, TOP_K, INTER, LAYER_IDS),
            "crisp": CrispPlan.crisp(E, TOP_K, INTER, {1: LayerPlan({(0, 1): Tier.HOT, (2, 3): Tier.COLD},
                                                                    {(0, 1): 1, (2, 3): 3})},
                                     TierWidths(INTER, 8, 4), unseen_tier=Tier.WARM)}[kind]
    big_w, big_r = plan.token_widths_and_roles(1, index, weights)  # 200 slots: the tensor path
    parts = [plan.token_widths_and_roles(1, index[i:i + 4], weights[i:i + 4]) for i in range(0, 100, 4)]
    assert torch.equal(big_w, torch.cat([p[0] for p in parts])) and torch.equal(big_r, torch.cat([p[1] for p in parts]))
    assert torch.equal(big_w, plan.token_widths(1, index, weights))
    valid = index < E
    assert torch.equal(big_r.sum(1), valid.sum(1).clamp(max=plan.num_dominant))


@pytest.mark.gpu
def test_cuda_prefetch_and_serving_async_match_sync():
    """GPU-only: prefetches on the copy stream (a step waits on their events) give the synchronous path's
    served widths, outputs and statistics, under a budget that forces evictions."""
    device = torch.device("cuda")
    plan = CrispPlan.uniform(E, TOP_K, INTER, LAYER_IDS, 9)
    budget = min_budget_bytes(LAYERS, TOP_K) + 2 * INTER * NB
    runtimes = {mode: CrispRuntime(LAYERS, plan, device=device, gpu_budget=budget,
                                   config=RuntimeConfig(serving="resident-floor75", async_copies=mode == "async"))
                for mode in ("async", "sync")}
    for i in range(12):
        layer_id = LAYER_IDS[i % 2]
        x, index, weights = make_step(1 + i % 3, 200 + i)
        for rt in runtimes.values():
            out = rt.forward(layer_id, x.to(device), index.to(device), weights.to(device))
            ref = reference(layer_id, x, index, weights, rt.last_served[layer_id].widths)
            assert close(out.cpu(), ref) and rt.cache.used <= budget
            rt.prefetch(LAYER_IDS[(i + 1) % 2], [((3 * i) % E, INTER), ((3 * i + 1) % E, 6)])
        served = [rt.last_served[layer_id].widths for rt in runtimes.values()]
        assert torch.equal(served[0], served[1])
    torch.cuda.synchronize()
    s_async, s_sync = (runtimes[m].stats.as_dict() for m in ("async", "sync"))
    assert s_async == s_sync and s_async["prefetches"] > 0


@pytest.mark.parametrize("tail_start", [None, 0, 64, 100, 255])
@pytest.mark.parametrize("floor", [1.0, 0.999, 0.875, 0.5, 0.3, 1 / 256, 1e-6])
def test_floor_in_rows_restates_a_floor_of_neurons_exactly(floor, tail_start):
    """floor_width on storage rows == the rows holding ceil(floor * neurons) neurons, at every wanted width."""
    import math

    from crisp_kernels.format import rows_for_neurons
    from crisp_runtime.planning.serving import floor_in_rows, resident_policy

    neurons = 256
    rows = rows_for_neurons(neurons, tail_start)
    policy = resident_policy(floor)
    mapped = floor_in_rows(policy, neurons, rows, lambda n: rows_for_neurons(n, tail_start))
    want = max(1, rows_for_neurons(math.ceil(floor * neurons), tail_start))
    assert mapped.floor_width(rows, rows) == want
    for wanted in (1, want - 1, want, want + 1, rows):
        if 1 <= wanted <= rows:
            assert mapped.floor_width(wanted, rows) == min(wanted, want)
    assert mapped.name == policy.name and mapped.aux_narrower is policy.aux_narrower
    if rows == neurons or floor == 1.0:
        assert mapped is policy  # nothing to restate
