"""CrispPlan: widths per policy, the leading-pair generalisation, tiers from counts, JSON."""

import itertools
import json

import pytest
import torch

from crisp_runtime.planning.pairs import CombinationKey
from crisp_runtime.planning.plan import (
    CrispPlan,
    LayerPlan,
    PlanError,
    PolicyKind,
    Tier,
    TierCutoffs,
    TierWidths,
    assign_tiers,
)

FULL = 96


def _crisp_plan(num_experts=8, top_k=2, num_dominant=1, unseen=Tier.WARM):
    tiers = {(0, 1): Tier.HOT, (2, 3): Tier.WARM, (1, 2): Tier.WARM, (4, 5): Tier.COLD, (0, 7): Tier.COLD}
    dominant = {(0, 1): 1, (2, 3): 3, (4, 5): 5, (0, 7): 7}  # (1, 2): no label, the heavier expert per token
    return CrispPlan.crisp(
        num_experts, top_k, FULL, {0: LayerPlan(tiers, dominant), 3: LayerPlan({}, {})}, TierWidths(FULL, 40, 0),
        unseen_tier=unseen, num_dominant=num_dominant,
    )


def _lead_plan(top_k=6, num_dominant=3, unseen=Tier.COLD):
    """A plan keyed on the leading expert: one-expert combinations, no dominant labels."""
    tiers = {(0,): Tier.HOT, (2,): Tier.WARM, (5,): Tier.COLD, (7,): Tier.COLD}
    return CrispPlan.crisp(8, top_k, FULL, {0: LayerPlan(tiers, {}), 3: LayerPlan({}, {})}, TierWidths(FULL, 40, 0),
                           unseen_tier=unseen, num_dominant=num_dominant,
                           combination_key=CombinationKey.LEADING_EXPERT)


def _widths_by_hand(plan: CrispPlan, index, weights):
    """A direct, per-token re-statement of the plan's rules (the module docstring), for comparison."""
    out = []
    for idx_row, w_row in zip(index.tolist(), weights.tolist(), strict=True):
        valid = [(w, -pos, e, pos) for pos, (e, w) in enumerate(zip(idx_row, w_row, strict=True))
                 if 0 <= e < plan.num_experts]
        by_weight = [item[3] for item in sorted(valid, reverse=True)]  # positions, heaviest first, stable
        widths = [0] * len(idx_row)
        if plan.policy is PolicyKind.FULL:
            for pos in by_weight:
                widths[pos] = FULL
            out.append(widths)
            continue
        ranks = {pos: r for r, pos in enumerate(by_weight)}
        if plan.policy is PolicyKind.CRISP and len(by_weight) >= 2:
            a, b = idx_row[by_weight[0]], idx_row[by_weight[1]]
            key = (min(a, b), max(a, b)) if plan.combination_key is CombinationKey.LEADING_PAIR else (a,)
            lp = plan.layers.get(0)
            tier = lp.tiers.get(key, plan.unseen_tier)
            dom = lp.dominant.get(key, a)
            if dom == b and a != b:
                ranks[by_weight[0]], ranks[by_weight[1]] = 1, 0
            aux = plan.tier_widths.for_tier(tier)
        elif plan.policy is PolicyKind.CRISP:
            aux = FULL
        cap = FULL if plan.width_cap is None else plan.width_cap  # a capped CRISP plan: nothing wider
        for pos in by_weight:
            if ranks[pos] < plan.num_dominant:
                widths[pos] = min(FULL, cap)
            elif plan.policy is PolicyKind.SKIP_AUX:
                thr = plan.skip_threshold
                widths[pos] = FULL if thr is not None and w_row[pos] >= thr else 0
            elif plan.aux_skip_weight is not None and w_row[pos] < plan._weight_thresholds[2]:
                widths[pos] = 0  # a light auxiliary: skipped whatever its tier
            elif plan.aux_full_weight is not None and w_row[pos] >= plan._weight_thresholds[1]:
                widths[pos] = min(FULL, cap)  # a heavy auxiliary: the dominant's width whatever its tier
            else:
                widths[pos] = min(aux, cap)
        out.append(widths)
    return torch.tensor(out, dtype=torch.int64)


def test_crisp_widths_follow_tiers_and_dominance():
    plan = _crisp_plan()
    index = torch.tensor([[0, 1], [3, 2], [1, 2], [5, 4], [6, 7], [7, 0], [2, 3], [2, 1]])
    weights = torch.tensor([[.6, .4], [.7, .3], [.5, .5], [.9, .1], [.8, .2], [.55, .45], [.8, .2], [.4, .6]])
    widths = plan.token_widths(0, index, weights)
    expected = torch.tensor([
        [FULL, FULL],  # hot: both full
        [FULL, 40],  # warm, 3 dominant
        [FULL, 40],  # warm, no label: tied weights keep router order, 1 dominant
        [FULL, 0],  # cold: 5 dominant, 4 skipped
        [FULL, 40],  # unseen pair -> unseen tier (warm), heavier expert 6 dominant
        [FULL, 0],  # cold, 7 dominant
        [40, FULL],  # warm (2,3): the measured dominant 3 wins over the heavier 2
        [40, FULL],  # warm (1,2), no label: the heavier 1 is dominant for this token
    ])
    assert torch.equal(widths, expected)


@pytest.mark.parametrize("policy", ["full", "uniform", "skip", "skip_thr", "crisp", "crisp_top4", "crisp_cap33",
                                    "crisp_cap1", "crisp_cap_full", "crisp_top4_cap64", "crisp_aux0.3",
                                    "crisp_aux0", "crisp_aux1", "crisp_top4_aux0.15_cap64",
                                    "crisp_skip0.2_aux0.4", "crisp_skip0.3", "crisp_top4_skip0.1_aux0.3_cap64",
                                    "crisp_skip1", "lead_top6", "lead_top2", "lead_top6_skip0.1_aux0.2_cap64"])
def test_widths_match_a_per_token_restatement(policy):
    gen = torch.Generator().manual_seed(7)
    # the top-4 plans get top-4 routing (num_dominant 2: two auxiliaries), the top-6 ones top-6 (3 auxiliaries)
    top_k = 4 if "top4" in policy else 6 if "top6" in policy else 2
    plans = {
        "full": CrispPlan.full(8, top_k, FULL, [0]),
        "uniform": CrispPlan.uniform(8, top_k, FULL, [0], 33),
        "skip": CrispPlan.skip_aux(8, top_k, FULL, [0]),
        "skip_thr": CrispPlan.skip_aux(8, top_k, FULL, [0], threshold=0.3),
        "crisp": _crisp_plan(),
        "crisp_top4": _crisp_plan(top_k=4, num_dominant=2, unseen=Tier.COLD),
        # caps below the Warm width (40), at 1, at the full width (= uncapped), and between Warm and full
        "crisp_cap33": _crisp_plan().capped(33),
        "crisp_cap1": _crisp_plan().capped(1),
        "crisp_cap_full": _crisp_plan().capped(FULL),
        "crisp_top4_cap64": _crisp_plan(top_k=4, num_dominant=2, unseen=Tier.COLD).capped(64),
        # heavy auxiliaries at the dominant width: from weight 0.3, every one (0), only a weight of 1 (none here),
        # and under a cap with top-4 routing
        "crisp_aux0.3": _crisp_plan().promoted(0.3),
        "crisp_aux0": _crisp_plan().promoted(0.0),
        "crisp_aux1": _crisp_plan().promoted(1.0),
        "crisp_top4_aux0.15_cap64": _crisp_plan(top_k=4, num_dominant=2, unseen=Tier.COLD).capped(64).promoted(0.15),
        # three bands by routing weight (light skipped, middle at the tiers, heavy whole), a skip band alone,
        # the same under top-4 routing and a cap, and every auxiliary skipped (weight 1: the dominant only)
        "crisp_skip0.2_aux0.4": _crisp_plan().promoted(0.4).skipping(0.2),
        "crisp_skip0.3": _crisp_plan().skipping(0.3),
        "crisp_top4_skip0.1_aux0.3_cap64": _crisp_plan(top_k=4, num_dominant=2, unseen=Tier.COLD).capped(64)
        .promoted(0.3).skipping(0.1),
        "crisp_skip1": _crisp_plan().skipping(1.0),
        # keyed on the leading expert: top-6 with 3 dominants, top-2 (the key is then one member of the pair), and
        # with the bands and a cap
        "lead_top6": _lead_plan(),
        "lead_top2": _lead_plan(top_k=2, num_dominant=1, unseen=Tier.WARM),
        "lead_top6_skip0.1_aux0.2_cap64": _lead_plan().capped(64).promoted(0.2).skipping(0.1),
    }
    plan = plans[policy]
    index = torch.stack([torch.randperm(8, generator=gen)[:top_k] for _ in range(200)])
    index[5, 0] = 8  # a padding sentinel outside [0, E) gets width 0
    weights = torch.rand(200, top_k, generator=gen)
    weights = weights / weights.sum(1, keepdim=True)
    got = plan.token_widths(0, index, weights)  # 200 tokens: the vectorized path
    small = torch.cat([plan.token_widths(0, index[i:i + 8], weights[i:i + 8]) for i in range(0, 200, 8)])
    assert torch.equal(got, small)  # 8 tokens at a time: the plain-Python decode path
    if plan.policy is PolicyKind.UNIFORM:
        expected = torch.where(index < 8, 33, 0)
    else:
        expected = _widths_by_hand(plan, index, weights)
    assert torch.equal(got, expected)
    assert got[5, 0] == 0
    assert torch.equal(plan.device_token_widths(0, index, weights), expected)  # the compiled path's rules
    if plan.width_cap is not None:  # a cap clips the uncapped plan's widths and changes nothing else
        uncapped = plan.capped(None).token_widths(0, index, weights)
        assert torch.equal(got, uncapped.clamp(max=plan.width_cap))
        assert int(got.max()) == min(plan.width_cap, FULL)
    if plan.aux_full_weight is not None:  # a promotion only widens: each slot is its unpromoted width or the dominant's
        tiers_only = plan.promoted(None).token_widths(0, index, weights)
        assert bool(((got == tiers_only) | (got == plan.dominant_width)).all()) and bool((got >= tiers_only).all())
        heavy = (weights >= plan.aux_full_weight) & (index < 8)
        assert bool((got[heavy] == plan.dominant_width).all())
        if plan.aux_full_weight == 0.0:  # every routed slot at the dominant width
            assert torch.equal(got, torch.where(index < 8, plan.dominant_width, 0))
        changed = int((got != tiers_only).sum())
        assert changed > 0 if plan.aux_full_weight < 1.0 else changed == 0  # the test's weights move some slots
    if plan.aux_skip_weight is not None:  # a skip band only zeroes: each slot is its unskipped width or 0
        unskipped = plan.skipping(None).token_widths(0, index, weights)
        assert bool(((got == unskipped) | (got == 0)).all())
        light = (weights < plan.aux_skip_weight) & (index < 8) & (got != plan.dominant_width)
        assert bool((got[light] == 0).all())
        assert int(((got == 0) & (unskipped > 0)).sum()) > 0  # the test's weights skip some slots
        if plan.aux_skip_weight == 1.0:  # every auxiliary skipped: num_dominant slots per token run
            assert torch.equal((got > 0).sum(1), torch.clamp((index < 8).sum(1), max=plan.num_dominant))


def test_width_cap_json_storage_rows_and_refusals(tmp_path):
    plan = _crisp_plan().capped(48)
    path = tmp_path / "capped.json"
    plan.save(path)
    assert CrispPlan.load(path) == plan and json.loads(path.read_text())["width_cap"] == 48
    assert "width_cap" not in _crisp_plan().to_dict()  # uncapped plans, and their digests, are unchanged
    assert plan.widths_digest() != _crisp_plan().widths_digest()
    assert plan.capped(None) == _crisp_plan()
    # a 2-bit tail from neuron 24: neurons 24..47 are 12 rows, so the cap is rows 24 + 12 = 36
    rows = plan.in_storage_rows(24)
    assert rows.width_cap == 36 and rows.dominant_width == 36
    for bad, match in ((0, r"width_cap must lie in \[1, 96\]"), (FULL + 1, "width_cap must lie"),
                       (True, "width_cap must be an integer"), (40.5, "width_cap must be an integer")):
        with pytest.raises(PlanError, match=match):
            _crisp_plan().capped(bad)
    with pytest.raises(PlanError, match="CRISP plans only"):
        CrispPlan.uniform(8, 2, FULL, [0], 7).capped(8)
    with pytest.raises(PlanError, match="CRISP plans only"):
        CrispPlan(PolicyKind.FULL, 8, 2, FULL, (0,), width_cap=8)
    data = plan.to_dict()
    for bad in (0, "48", 48.0, FULL + 1):
        data["width_cap"] = bad
        with pytest.raises(PlanError, match="width_cap"):
            CrispPlan.from_dict(data)
    data = CrispPlan.uniform(8, 2, FULL, [0], 7).to_dict()
    data["width_cap"] = 8
    with pytest.raises(PlanError, match="unknown field"):
        CrispPlan.from_dict(data)


def test_aux_full_weight_json_thresholds_and_refusals(tmp_path):
    plan = _crisp_plan().promoted(0.25)
    path = tmp_path / "promoted.json"
    plan.save(path)
    assert CrispPlan.load(path) == plan and json.loads(path.read_text())["aux_full_weight"] == 0.25
    assert "aux_full_weight" not in _crisp_plan().to_dict()  # plans without it, and their digests, are unchanged
    assert plan.widths_digest() != _crisp_plan().widths_digest()
    assert plan.promoted(None) == _crisp_plan() and plan.in_storage_rows(24).aux_full_weight == 0.25
    assert plan.with_tiers(TierWidths(FULL, 8, 0)).aux_full_weight == 0.25  # searches keep it
    for bad, match in ((-0.1, r"aux_full_weight must lie in \[0, 1\]"), (1.5, "must lie in"),
                       (True, "aux_full_weight must be a number"), ("0.3", "must be a number"),
                       (float("nan"), "must be a number")):
        with pytest.raises(PlanError, match=match):
            _crisp_plan().promoted(bad)
    with pytest.raises(PlanError, match="CRISP plans only"):
        CrispPlan.skip_aux(8, 2, FULL, [0], threshold=0.3).promoted(0.3)
    data = plan.to_dict()
    for bad in (-1, "0.3", True, 2.0, [0.3]):
        data["aux_full_weight"] = bad
        with pytest.raises(PlanError, match="aux_full_weight"):
            CrispPlan.from_dict(data)
    data["aux_full_weight"] = None  # null: tiers only
    assert CrispPlan.from_dict(data) == _crisp_plan()
    data = CrispPlan.skip_aux(8, 2, FULL, [0], threshold=0.3).to_dict()
    data["aux_full_weight"] = 0.3
    with pytest.raises(PlanError, match="unknown field"):
        CrispPlan.from_dict(data)


@pytest.mark.parametrize("make", [lambda t: _crisp_plan().promoted(t),
                                  lambda t: CrispPlan.skip_aux(8, 2, FULL, [0], threshold=t),
                                  lambda t: _crisp_plan().skipping(t)],
                         ids=["crisp_aux_full_weight", "skip_threshold", "crisp_aux_skip_weight"])
@pytest.mark.parametrize("threshold", [0.239, 0.3, 0.1])  # float32(t) below t, above t, above t
def test_weight_thresholds_agree_on_both_paths_at_the_float32_boundary(make, threshold):
    # A float32 weight equal to the float32 rounding of the threshold: the vectorized rules compare in float32
    # (a float32 tensor against a Python number), so the decode path must compare with the same rounded value.
    plan = make(threshold)
    w32 = torch.tensor(threshold, dtype=torch.float32)
    assert w32.item() != threshold  # the boundary case exists for these thresholds
    index = torch.tensor([[2, 3]] * 40)  # a Warm pair of the CRISP plan (3 dominant by its label)
    weights = torch.stack([1 - w32, w32]).expand(40, 2).contiguous()  # (40, 2) float32; expert 3 the lighter
    if plan.policy is PolicyKind.CRISP:
        weights = weights.flip(1)  # expert 2 the lighter, an auxiliary (3 is the labelled dominant)
    big = plan.token_widths(0, index, weights)  # 40 x 2 = 80 slots: the vectorized path
    small = plan.token_widths(0, index[:4], weights[:4])  # the plain-Python path
    assert torch.equal(big[:4], small)
    assert torch.equal(plan.device_token_widths(0, index, weights), big)
    # the weight equals the threshold as compared: at or above it, so run full (not skipped: the Warm width)
    assert int(big.min()) == (40 if plan.aux_skip_weight is not None else FULL)


def test_aux_skip_weight_json_bands_and_refusals(tmp_path):
    plan = _crisp_plan().promoted(0.4).skipping(0.2)
    path = tmp_path / "banded.json"
    plan.save(path)
    assert CrispPlan.load(path) == plan and json.loads(path.read_text())["aux_skip_weight"] == 0.2
    assert "aux_skip_weight" not in _crisp_plan().to_dict()  # plans without it, and their digests, are unchanged
    assert plan.widths_digest() != plan.skipping(None).widths_digest()
    assert plan.in_storage_rows(24).aux_skip_weight == 0.2 and plan.capped(48).aux_skip_weight == 0.2
    assert plan.with_tiers(TierWidths(FULL, 8, 0)).aux_skip_weight == 0.2  # searches keep it
    for bad, match in ((-0.1, r"aux_skip_weight must lie in \[0, 1\]"), (1.5, "must lie in"),
                       (True, "aux_skip_weight must be a number"), ("0.3", "must be a number"),
                       (float("nan"), "must be a number")):
        with pytest.raises(PlanError, match=match):
            _crisp_plan().skipping(bad)
    with pytest.raises(PlanError, match="must not exceed aux_full_weight"):
        _crisp_plan().promoted(0.3).skipping(0.31)
    with pytest.raises(PlanError, match="CRISP plans only"):
        CrispPlan.skip_aux(8, 2, FULL, [0], threshold=0.3).skipping(0.3)
    data = plan.to_dict()
    for bad in (-1, "0.3", True, 2.0, [0.3]):
        data["aux_skip_weight"] = bad
        with pytest.raises(PlanError, match="aux_skip_weight"):
            CrispPlan.from_dict(data)
    data["aux_skip_weight"] = 0.5  # above aux_full_weight 0.4
    with pytest.raises(PlanError, match="must not exceed"):
        CrispPlan.from_dict(data)
    data["aux_skip_weight"] = None
    assert CrispPlan.from_dict(data) == plan.skipping(None)
    data = CrispPlan.uniform(8, 2, FULL, [0], 7).to_dict()
    data["aux_skip_weight"] = 0.3
    with pytest.raises(PlanError, match="unknown field"):
        CrispPlan.from_dict(data)


@pytest.mark.parametrize("threshold", [0.0, 0.239, 0.3, 1.0])
def test_equal_thresholds_make_skip_aux(threshold):
    """With no combination profiled (every pair unseen, the heavier expert dominant), a CRISP plan with
    aux_skip_weight = aux_full_weight = t gives every slot skip-auxiliary's width at threshold t."""
    crisp = CrispPlan.crisp(8, 2, FULL, {0: LayerPlan({}, {})}, TierWidths(FULL, 40, 8), aux_full_weight=threshold,
                            aux_skip_weight=threshold)
    skip = CrispPlan.skip_aux(8, 2, FULL, [0], threshold=threshold)
    gen = torch.Generator().manual_seed(3)
    index = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(300)])
    weights = torch.rand(300, 2, generator=gen)
    weights = weights / weights.sum(1, keepdim=True)
    assert torch.equal(crisp.token_widths(0, index, weights), skip.token_widths(0, index, weights))
    assert torch.equal(crisp.token_widths(0, index[:8], weights[:8]), skip.token_widths(0, index[:8], weights[:8]))


def test_json_round_trip_and_validation(tmp_path):
    for plan in (_crisp_plan(), CrispPlan.full(8, 2, FULL, [0, 3]), CrispPlan.uniform(8, 2, FULL, [1], 7),
                 CrispPlan.skip_aux(8, 2, FULL, [0], threshold=0.25), _lead_plan(), _lead_plan().skipping(0.1)):
        path = tmp_path / f"{plan.policy.value}.json"
        plan.save(path)
        loaded = CrispPlan.load(path)
        assert loaded == plan
        assert json.loads(path.read_text())["version"] == 1
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d.update(format="other"), "not a CRISP plan"),
        (lambda d: d["tier_widths"].update(warm=FULL + 1), "tier 'warm'"),
        (lambda d: d["layers"]["0"][0].update(experts=[0, 8]), r"expert ids in \[0, 8\)"),
        (lambda d: d["layers"]["0"][0].update(dominant=5), "dominant 5"),
        (lambda d: d["layers"].update({"9": []}), r"layers \[9\]"),
        (lambda d: d["layers"]["0"][0].update(tier="lukewarm"), "malformed"),
        (lambda d: d.pop("intermediate_size"), "malformed"),
    ],
)
def test_bad_plans_are_refused_with_the_reason(tmp_path, mutate, match):
    data = _crisp_plan().to_dict()
    mutate(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=match):
        CrispPlan.load(path)


def _load_mutated(tmp_path, plan: CrispPlan, mutate) -> CrispPlan:
    data = plan.to_dict()
    mutate(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return CrispPlan.load(path)


@pytest.mark.parametrize(
    ("make", "mutate", "match"),
    [
        # lenient parsing would change the policy silently
        (lambda: CrispPlan.uniform(8, 2, FULL, [0], 7), lambda d: d.update(uniform_width=True),
         "field uniform_width: expected an integer, got bool True"),
        (lambda: _crisp_plan(), lambda d: d["tier_widths"].update(warm=40.9),
         "field tier_widths.warm: expected an integer, got float 40.9"),
        (lambda: _crisp_plan(), lambda d: d.update(layer_ids="03"), "field layer_ids: expected a list, got str"),
        (lambda: _crisp_plan(), lambda d: d.update(layer_ids=["0", 3]), r"field layer_ids\[0\]: expected an integer"),
        (lambda: _crisp_plan(), lambda d: d["layers"]["0"].append(dict(d["layers"]["0"][0], tier="cold")),
         r"layers.0\[5\].experts: combination \[0, 1\] is listed twice"),
        (lambda: _crisp_plan(), lambda d: d["layers"].pop("3"), r"field layers: no entry for layers \[3\]"),
        (lambda: _crisp_plan(), lambda d: d.update(unseen_tier="lukewarm"),
         r"field unseen_tier: 'lukewarm' is not one of \['hot', 'warm', 'cold'\]"),
        (lambda: _crisp_plan(), lambda d: d.update(policy="greedy"),
         r"field policy: 'greedy' is not one of \['full', 'uniform', 'skip_aux', 'crisp'\]"),
        (lambda: _crisp_plan(), lambda d: d.update(version=True), "plan version True is not supported"),
        (lambda: _crisp_plan(), lambda d: d.update(unseen_teir="cold"), r"unknown field\(s\) \['unseen_teir'\]"),
        (lambda: CrispPlan.skip_aux(8, 2, FULL, [0], threshold=0.2), lambda d: d.pop("skip_threshold"),
         "field skip_threshold: missing"),
        (lambda: CrispPlan.skip_aux(8, 2, FULL, [0], threshold=0.2), lambda d: d.update(skip_threshold="0.2"),
         "field skip_threshold: expected null or a number in"),
    ],
)  # fmt: skip
def test_strict_plan_parsing(tmp_path, make, mutate, match):
    with pytest.raises(PlanError, match=match):
        _load_mutated(tmp_path, make(), mutate)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: CrispPlan.uniform(8, 2, FULL, [0], True), "uniform_width must be an integer, got True"),
        (lambda: CrispPlan.uniform(8, 2, FULL, [0], 40.9), "uniform_width must be an integer, got 40.9"),
        (lambda: CrispPlan.full(8, 2, FULL, "03"), "layer_ids must be non-negative integers"),
        (lambda: CrispPlan.full(8, 2, FULL, [0, 0]), "layer_ids repeat a layer"),
        (lambda: CrispPlan.full(8.0, 2, FULL, [0]), "num_experts must be an integer"),
        (lambda: CrispPlan.crisp(8, 2, FULL, {0: LayerPlan({}, {})}, TierWidths(FULL, 40.5)),
         "width of tier 'warm' must be an integer, got 40.5"),
        (lambda: CrispPlan("full", 8, 2, FULL, (0,)), "policy must be a PolicyKind"),
        (lambda: CrispPlan.crisp(8, 2, FULL, {0: LayerPlan({(0.0, 1.0): Tier.HOT}, {})}, TierWidths(FULL, 4)),
         r"combination \(0.0, 1.0\) is not a pair of expert ids"),
        (lambda: CrispPlan.crisp(8, 2, FULL, {0: LayerPlan({(0, 1, 2): Tier.HOT}, {})}, TierWidths(FULL, 4)),
         "is not a pair of expert ids"),
        (lambda: CrispPlan.crisp(8, 2, FULL, {0: {}}, TierWidths(FULL, 4)), "layer 0 must be a LayerPlan"),
    ],
)
def test_constructor_refuses_non_integers(make, match):
    with pytest.raises(PlanError, match=match):
        make()


def test_numpy_integers_become_ints(tmp_path):
    import numpy as np

    plan = CrispPlan.uniform(np.int64(8), 2, FULL, np.arange(2), np.int64(7))
    assert type(plan.uniform_width) is int and plan.layer_ids == (0, 1)
    crisp = CrispPlan.crisp(8, 2, FULL, {np.int64(0): LayerPlan({(np.int64(0), 1): Tier.HOT}, {})},
                            TierWidths(np.int64(FULL), np.int64(5)))
    assert type(crisp.tier_widths.warm) is int and crisp.layer_ids == (0,)
    crisp.save(tmp_path / "c.json")
    assert CrispPlan.load(tmp_path / "c.json") == crisp
    plan.save(tmp_path / "p.json")
    assert CrispPlan.load(tmp_path / "p.json") == plan


@pytest.mark.parametrize("kind", ["directory", "dangling-symlink"])
def test_plan_path_must_be_a_file(tmp_path, kind):
    path = tmp_path / "plan.json"
    if kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(tmp_path / "gone.json")
    with pytest.raises(PlanError, match="plan.json: (not a regular file|a dangling symbolic link)"):
        CrispPlan.load(path)


def test_bad_constructor_arguments():
    with pytest.raises(PlanError, match="uniform_width"):
        CrispPlan.uniform(8, 2, FULL, [0], FULL + 1)
    with pytest.raises(PlanError, match="top_k"):
        CrispPlan.full(4, 5, FULL, [0])
    with pytest.raises(PlanError, match="num_dominant"):
        CrispPlan.skip_aux(8, 2, FULL, [0], num_dominant=3)
    with pytest.raises(PlanError, match="no layer 5"):
        CrispPlan.full(8, 2, FULL, [0]).token_widths(5, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2))


def test_check_compatible_names_every_mismatch():
    plan = _crisp_plan()
    plan.check_compatible(num_experts=8, top_k=2, intermediate_size=FULL, layer_ids=[0, 3])
    with pytest.raises(PlanError, match=r"num_experts 8 != 16.*no entry for layers \[5\].*unknown layers \[3\]"):
        plan.check_compatible(num_experts=16, top_k=2, intermediate_size=FULL, layer_ids=[0, 5])


@pytest.mark.parametrize(("hot", "cold"), [(0.5, 0.1), (0.0, 0.0), (1.0, 0.0), (0.3, 0.7), (0.6, 0.25)])
def test_tiers_partition_the_counted_combinations(hot, cold):
    gen = torch.Generator().manual_seed(1)
    pairs = list(itertools.combinations(range(8), 2))
    counts = {p: int(c) for p, c in zip(pairs, torch.randint(1, 1000, (len(pairs),), generator=gen), strict=True)}
    tiers = assign_tiers(counts, TierCutoffs(hot, cold))
    assert set(tiers) == set(counts)
    total = sum(counts.values())
    mass = {t: sum(counts[p] for p in tiers if tiers[p] is t) / total for t in Tier}
    # Hot is the smallest most-frequent prefix reaching hot_mass; cold the largest tail within cold_mass.
    assert mass[Tier.COLD] <= cold + 1e-12
    hot_pairs = [p for p in tiers if tiers[p] is Tier.HOT]
    assert mass[Tier.HOT] >= hot - 1e-12
    if hot_pairs:
        least_hot = min(counts[p] for p in hot_pairs)
        assert all(counts[p] <= least_hot for p in tiers if tiers[p] is not Tier.HOT)
        assert mass[Tier.HOT] - min(counts[p] for p in hot_pairs) / total < hot
    cold_pairs = [p for p in tiers if tiers[p] is Tier.COLD]
    if cold_pairs:
        assert max(counts[p] for p in cold_pairs) <= min(counts[p] for p in tiers if tiers[p] is not Tier.COLD)


def test_tier_cutoffs_refuse_impossible_masses():
    with pytest.raises(PlanError, match="<= 1"):
        TierCutoffs(0.8, 0.3)
    with pytest.raises(PlanError, match=r"\[0, 1\]"):
        TierCutoffs(-0.1, 0.0)


@pytest.mark.parametrize("make, key", [(_crisp_plan, "leading-pair-by-routing-weight"),
                                       (_lead_plan, "leading-expert-by-routing-weight")])
def test_combination_key_in_json(tmp_path, make, key):
    """plan.json names the key and lists its combinations ([a, b] or [e]); the key changes the widths digest."""
    plan = make()
    data = plan.to_dict()
    assert data["combination_key"] == key
    assert {len(entry["experts"]) for entry in data["layers"]["0"]} == {plan.combination_key.size}
    assert CrispPlan.from_dict(json.loads(json.dumps(data))) == plan
    other = CombinationKey.LEADING_EXPERT if plan.combination_key is CombinationKey.LEADING_PAIR else None
    if other is not None:  # the same tiers read as leading experts are another plan
        relabelled = plan.with_tiers(layers={0: LayerPlan({(0,): Tier.HOT}, {}), 3: LayerPlan({}, {})},
                                     combination_key=other)
        assert relabelled.widths_digest() != plan.with_tiers(layers={0: LayerPlan({(0, 0): Tier.HOT}, {}),
                                                                     3: LayerPlan({}, {})}).widths_digest()


def test_plan_without_combination_key_loads_as_leading_pair(tmp_path):
    """A plan.json written before the key was a choice (no combination_key) reads as the leading-pair key, and
    writes back with it named."""
    data = _crisp_plan().to_dict()
    del data["combination_key"]
    plan = CrispPlan.from_dict(data)
    assert plan.combination_key is CombinationKey.LEADING_PAIR and plan == _crisp_plan()
    assert plan.to_dict()["combination_key"] == "leading-pair-by-routing-weight"


@pytest.mark.parametrize("pack", ["models/tiny-mixtral-crisp", "models/tiny-deepseek-crisp"])
def test_committed_plans_write_back_byte_identical(pack):
    """The committed packs' plan.json (top-2 CRISP and top-6) parse and serialize to the same bytes: adding the key
    changed no existing plan or its digest."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / pack / "plan.json"
    text = path.read_text()
    plan = CrispPlan.from_dict(json.loads(text))
    assert json.dumps(plan.to_dict(), indent=1) == text
    if plan.policy is PolicyKind.CRISP and plan.top_k == 2:
        assert plan.combination_key is CombinationKey.LEADING_PAIR


@pytest.mark.parametrize(
    ("make", "mutate", "match"),
    [
        (_lead_plan, lambda d: d["layers"]["0"][0].update(experts=[0, 1]),
         r"layers.0\[0\].experts: expected one expert \[e\]"),
        (_crisp_plan, lambda d: d["layers"]["0"][0].update(experts=[0]),
         r"layers.0\[0\].experts: expected a pair \[a, b\]"),
        (_lead_plan, lambda d: d["layers"]["0"][0].update(dominant=0), "has no dominant label"),
        (_lead_plan, lambda d: d["layers"]["0"][0].update(experts=[8]), r"an expert id in \[0, 8\)"),
        (_crisp_plan, lambda d: d.update(combination_key="full-set"),
         "field combination_key: 'full-set' is not one of"),
        (_lead_plan, lambda d: d.update(combination_key=None), "field combination_key: None is not one of"),
    ],
)  # fmt: skip
def test_combination_key_refusals(tmp_path, make, mutate, match):
    with pytest.raises(PlanError, match=match):
        _load_mutated(tmp_path, make(), mutate)


def test_constructor_refuses_a_combination_of_the_other_key():
    with pytest.raises(PlanError, match=r"combination \(0, 1\) is not one expert id"):
        CrispPlan.crisp(8, 6, FULL, {0: LayerPlan({(0, 1): Tier.HOT}, {})}, TierWidths(FULL, 40, 0),
                        combination_key=CombinationKey.LEADING_EXPERT)
    with pytest.raises(PlanError, match="combination_key applies to CRISP plans only"):
        CrispPlan(PolicyKind.SKIP_AUX, 8, 6, FULL, (0,), combination_key=CombinationKey.LEADING_EXPERT)
    with pytest.raises(PlanError, match="combination_key must be a CombinationKey"):
        CrispPlan.crisp(8, 6, FULL, {0: LayerPlan({}, {})}, TierWidths(FULL, 40, 0),
                        combination_key="leading-expert-by-routing-weight")
