"""Plan for throughput (crisp_tools.profiler.throughput) and the serving choice stored in pack.json
(crisp_runtime.storage.serving_record): the fastest candidate within the accuracy bound is chosen, candidates are
evaluated fastest first and no further, the record round-trips through a pack and is parsed strictly."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from crisp_tools.calibration import TokenScores, contiguous_windows, load_model, load_pack_dir
from crisp_tools.profiler import throughput as tp
from crisp_tools.text import read_texts

from crisp_kernels import PackFormatError
from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.planning.serving import SERVING_POLICIES, DominantWiden, serving_by_name
from crisp_runtime.scheduling.prefetch import PrefetchPolicy, PrefetchWidth
from crisp_runtime.storage.pack import load_pack, save_pack
from crisp_runtime.storage.serving_record import ServingRecord, serving_record

ROOT = Path(__file__).resolve().parents[1]
MODEL, PACK, TEXT = ROOT / "models/tiny-mixtral", ROOT / "models/tiny-mixtral-crisp", ROOT / "data/stdlib-heldout.txt"


def test_candidates_are_the_stated_space():
    cands = tp.candidates()
    per_weight = 2 + 4 * (len(tp.SEARCH_FLOORS) - 1)  # floor 1: without / with plan prefetch; below: 4 each
    assert len(cands) == per_weight * len(tp.SEARCH_AUX_WEIGHTS) and len({c.label for c in cands}) == len(cands)
    assert {c.dominant_floor for c in cands} == set(tp.SEARCH_FLOORS)
    assert {c.aux_full_weight for c in cands} == set(tp.SEARCH_AUX_WEIGHTS) and None in tp.SEARCH_AUX_WEIGHTS
    assert len(tp.candidates(aux_full_weights=(None,))) == per_weight
    assert not any(c.exact for c in cands)  # no neurons given: no plan knobs, no exact candidates
    # AHEAD only with serving-width prefetch (its second phase needs it), never at full width
    for c in cands:
        if c.widen is DominantWiden.AHEAD:
            assert c.prefetch is PrefetchWidth.SERVING and c.dominant_floor < 1.0
    assert tp.Candidate(0.75).serving().dominant_floor == 0.75
    # a candidate's policy is named as the runtime names it (the floor in percent), and reads back by that name
    for c in cands:
        if not c.exact:
            base = c.serving().name.removesuffix("-ahead").removesuffix("-widen")
            assert serving_by_name(base) == dataclasses.replace(c.serving(), name=base,
                                                                dominant_widen=DominantWiden.NEVER), c.label
    assert tp.Candidate(0.875, DominantWiden.AHEAD).serving().name == "resident-floor87.5-ahead"
    assert tp.Candidate(0.75, DominantWiden.HIT).serving() == SERVING_POLICIES["resident-floor75-widen"]
    assert tp.Candidate(1.0).serving() == SERVING_POLICIES["resident"]
    _, plan, _ = load_pack_dir(PACK)
    assert tp.Candidate(0.75).plan_for(plan) is plan
    assert tp.Candidate(0.75, aux_full_weight=0.3).plan_for(plan) == plan.promoted(0.3)
    assert tp.Candidate(0.75, aux_full_weight=0.3).label == "floor0.75-aux0.3"
    # at the plan's widths: every band x cap, plan-width prefetch, the plan's own serving
    full = tp.candidates(intermediate_size=256)
    exact = [c for c in full if c.exact]
    assert len(exact) == len(tp.SEARCH_EXACT_BANDS) * len(tp.SEARCH_CAPS) and len({c.label for c in full}) == len(full)
    assert {c.width_cap for c in exact} == {None, 224, 192}
    assert {(c.aux_skip_weight, c.aux_full_weight) for c in exact} == set(tp.SEARCH_EXACT_BANDS)
    for c in exact:
        assert c.prefetch is PrefetchWidth.PLAN and c.serving() == SERVING_POLICIES["plan"] and c.dominant_floor == 1.0
        assert c.plan_for(plan).aux_skip_weight == c.aux_skip_weight and c.plan_for(plan).width_cap == c.width_cap
    band = tp.Candidate(prefetch=PrefetchWidth.PLAN, aux_full_weight=0.4, aux_skip_weight=0.25, width_cap=192,
                        kind=tp.CandidateServing.PLAN)
    assert band.label == "plan-aux0.4-skip0.25-cap192+prefetch-plan"
    assert band.plan_for(plan) == plan.promoted(0.4).skipping(0.25).capped(192)
    # the search owns the knobs: a pack plan's own skip weight (over the candidate's W) is replaced, not kept
    three_band = plan.promoted(0.45).skipping(0.35)
    assert band.plan_for(three_band) == band.plan_for(plan)
    assert tp.Candidate(0.75).plan_for(three_band) == plan
    for bad in ({"dominant_floor": 0.75}, {"widen": DominantWiden.AHEAD}, {"prefetch": PrefetchWidth.SERVING}):
        with pytest.raises(ValueError, match="plan's widths"):
            tp.Candidate(kind=tp.CandidateServing.PLAN, **bad)


def test_the_search_scores_windows_of_crisp_eval_s_length_by_default():
    """The search bounds the loss that crisp-eval then reports, and the loss depends on the window length (a
    tail pack's full width lost ~1.5x as much at positions 0-126 as at 127-254: calibration.EVAL_SEQ_LEN), so
    crisp-profile's and plan_throughput's windows default to crisp-eval's length."""
    from crisp_tools.calibration import EVAL_SEQ_LEN
    from crisp_tools.evaluate import build_parser as eval_parser
    from crisp_tools.plan_throughput import build_parser as plan_parser
    from crisp_tools.profiler.cli import build_parser as profile_parser
    from crisp_tools.profiler.config import ProfileConfig

    assert eval_parser().get_default("seq_len") == EVAL_SEQ_LEN
    assert plan_parser().get_default("throughput_seq_len") == EVAL_SEQ_LEN
    assert profile_parser().get_default("throughput_seq_len") == EVAL_SEQ_LEN
    assert ProfileConfig(model="m", data=["d"], out="o").throughput_seq_len == EVAL_SEQ_LEN


def test_other_tier_widths_repeat_the_whole_space_once_each():
    from crisp_runtime.planning.plan import TierWidths

    _, plan, _ = load_pack_dir(PACK)
    own, wide = plan.tier_widths, TierWidths(256, 128, 64)
    with_baselines = tp.default_candidates(plan)
    base = [c for c in with_baselines if c.baseline is None]
    # the baselines once, last (they replace the plan: no tier widths)
    assert [c.baseline for c in with_baselines[len(base):]] == list(tp.SEARCH_BASELINES)
    cands = tp.default_candidates(plan, [wide, own, wide])  # the plan's own and a repeat are searched once
    assert cands[-2:] == with_baselines[-2:]
    cands = cands[:-2]
    assert len(cands) == 2 * len(base) and len({c.label for c in cands}) == len(cands)
    assert cands[: len(base)] == base and {c.tier_widths for c in cands[len(base):]} == {wide}
    for c, b in zip(cands[len(base):], base, strict=True):  # the same knobs at the other widths
        assert c == tp.dataclasses.replace(b, tier_widths=wide) and c.label.count("-tiers256.128.64") == 1
        served = c.plan_for(plan)
        assert served.tier_widths == wide and served.layers == plan.layers and served.width_cap == c.width_cap
        assert served == tp.dataclasses.replace(b.plan_for(plan), tier_widths=wide)
    assert tp.default_candidates(plan, [own]) == with_baselines
    band = tp.Candidate(prefetch=PrefetchWidth.PLAN, aux_full_weight=0.4, kind=tp.CandidateServing.PLAN,
                        tier_widths=TierWidths(256, 96, 48))
    assert band.label == "plan-tiers256.96.48-aux0.4+prefetch-plan"
    described = tp._described(band, plan)
    assert described.tier_widths == TierWidths(256, 96, 48) and "256 / 96 / 48 neurons" in described.description
    with pytest.raises(ValueError, match=r"--search-tier-widths 256,257,0: .*\[0, 256\]"):
        tp.default_candidates(plan, [TierWidths(256, 257, 0)])
    with pytest.raises(ValueError, match="CRISP plans only"):
        tp.default_candidates(tp.full_plan(plan), [wide])
    with pytest.raises(ValueError, match="CRISP plans only"):
        tp.Candidate(tier_widths=wide).plan_for(tp.full_plan(plan))


def _lead_tiers(plan):
    """``plan``'s tiers over the leading expert (odd experts Warm, even ones Cold), its widths and knobs kept."""
    from crisp_runtime.planning.pairs import CombinationKey
    from crisp_runtime.planning.plan import LayerPlan, Tier

    layers = {lid: LayerPlan({(e,): Tier.WARM if e % 2 else Tier.COLD for e in range(plan.num_experts)}, {})
              for lid in plan.layer_ids}
    return plan.with_tiers(layers=layers, combination_key=CombinationKey.LEADING_EXPERT)


def test_the_plan_s_tiers_over_another_key_repeat_the_space_once():
    """With the plan's tiers over another combination key, every plan-serving candidate is searched again on them
    (the same knobs, the other key's tiers); the baselines stay once, last."""
    from crisp_runtime.planning.pairs import CombinationKey

    _, plan, _ = load_pack_dir(PACK)
    lead = _lead_tiers(plan)
    plain = tp.default_candidates(plan)
    base = [c for c in plain if c.baseline is None]
    cands = tp.default_candidates(plan, rekeyed=[lead])
    assert cands[: len(base)] == base and cands[-2:] == plain[-2:]
    keyed = cands[len(base):-2]
    assert len(keyed) == len(base) and len({c.label for c in cands}) == len(cands)
    for c, b in zip(keyed, base, strict=True):
        assert c.combination_key is CombinationKey.LEADING_EXPERT and c.label.count("-key-leading-expert") == 1
        served = c.plan_for(plan)
        assert served.combination_key is CombinationKey.LEADING_EXPERT and served.layers == lead.layers
        assert served == tp.dataclasses.replace(b.plan_for(plan), layers=lead.layers,
                                                combination_key=CombinationKey.LEADING_EXPERT)
    assert tp._described(keyed[0], plan).layers == lead.layers
    with pytest.raises(ValueError, match="needs the plan's tiers over it"):
        tp.Candidate(combination_key=CombinationKey.LEADING_EXPERT)
    with pytest.raises(ValueError, match="without plan knobs"):
        tp.Candidate(kind=tp.CandidateServing.PLAN, baseline=tp.SEARCH_BASELINES[0],
                     combination_key=CombinationKey.LEADING_EXPERT, rekeyed=lead)
    with pytest.raises(ValueError, match="CRISP plans only"):
        tp.default_candidates(tp.full_plan(plan), rekeyed=[lead])
    with pytest.raises(ValueError, match="the plan's own key"):
        tp.default_candidates(plan, rekeyed=[plan])
    other = tp.dataclasses.replace(lead, tier_widths=tp.TierWidths(256, 1, 0))
    with pytest.raises(ValueError, match="not of this plan"):
        tp.Candidate(combination_key=CombinationKey.LEADING_EXPERT, rekeyed=other).plan_for(plan)


@pytest.mark.parametrize("kwargs, match", [
    ({"budget": 0.0}, "budget"), ({"budget": 1.5}, "budget"), ({"budget": True}, "budget"),
    ({"budget": 0.25, "max_accuracy_loss": -0.1}, "max_accuracy_loss"),
    ({"budget": 0.25, "eviction": "random"}, "eviction"), ({"budget": 0.25, "target": "gpt-5"}, "target"),
    ({"budget": 0.25, "profile": "abacus"}, "abacus"),
    ({"budget": 0.25, "confidence": 0.4}, "confidence"), ({"budget": 0.25, "confidence": 1.0}, "confidence"),
])
def test_goal_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tp.ThroughputGoal(**kwargs)


@pytest.fixture(scope="module")
def tiny():
    layers, plan, _ = load_pack_dir(PACK)
    model, _ = load_model(MODEL)
    windows = contiguous_windows(read_texts([TEXT]), 2, 20)
    return model, layers, plan, windows


@pytest.mark.parametrize("bound", [1.0, 0.1])
def test_search_picks_the_fastest_candidate_within_the_bound(tiny, monkeypatch, bound):
    """Scripted accuracies (the decode itself is crisp-eval's, tested there): the fastest candidate loses
    8 of 38 predictions (21%), the slowest 2 (5.3%). The search evaluates fastest first and stops at the
    first within the bound."""
    model, layers, plan, windows = tiny
    evaluated, windows_used = [], []

    def fake_run_case(model, pack, plan, windows, budget_bytes, case, *, stop=None, progress=None):
        evaluated.append(case.name)
        for i in range(windows.shape[0]):
            progress(i + 1, windows.shape[0])
        if case.prefetch is not None:  # decoded as the simulated copy engine delivers, not every prefetch whole
            windows_used.append(case.prefetch.window)
        n = windows.shape[1] - 1
        correct = torch.ones(windows.shape[0], n, dtype=torch.bool)
        if case.plan != "full":
            lose = 2 if case.name in slow else 8
            correct.view(-1)[:lose] = False
        return TokenScores(torch.zeros(windows.shape[0], n), correct), {}

    cands = [tp.Candidate(0.5, prefetch=PrefetchWidth.SERVING), tp.Candidate(1.0)]
    slow = {"crisp-floor1"}  # full-width dominants: slower on every budget below one token's working set
    monkeypatch.setattr(tp, "run_case", fake_run_case)
    goal = tp.ThroughputGoal(0.25, max_accuracy_loss=bound, confidence=0.5)  # the point estimate decides
    lines = []
    record, chosen_plan = tp.search_throughput(model, layers, plan, windows, goal, cands=cands, log=lines.append)
    assert chosen_plan is plan  # no candidate here changes the plan
    assert [ln.split(" ")[2] for ln in lines if "simulated" in ln] == ["1/2", "2/2"]  # progress per simulation
    decoded = [ln for ln in lines if "decoded 2/2 windows" in ln]  # and per look of each decode (here: its end)
    assert decoded[0] == "throughput: the 4-bit full width (reference): decoded 2/2 windows"
    assert len(decoded) == len(evaluated) and not any("decoded 1/2" in ln for ln in lines)  # looks of 2 windows
    sims = record.search["candidates"]
    speed = {r["candidate"]: r["tokens_per_s"] for r in sims}
    assert speed["floor0.5+prefetch-serving"] > speed["floor1"]
    fastest_first = sorted(speed, key=lambda k: -speed[k])
    want = fastest_first[0] if bound >= 8 / 38 else "floor1"
    assert record.search["chosen"]["candidate"] == want
    assert record.search["chosen"]["accuracy_loss"] <= bound
    assert evaluated[0] == "full-exact"
    assert evaluated[1:] == [f"crisp-{k}" for k in fastest_first[:fastest_first.index(want) + 1]]
    assert record.gpu_budget_fraction == 0.25 and record.eviction == "next_use"
    assert record.search["accuracy_text"] == "held-out calibration windows"
    assert record.search["accuracy_prefetch_window"].startswith(f"{goal.profile}/")
    assert windows_used and all(w is not None and w.name == record.search["accuracy_prefetch_window"]
                                for w in windows_used)
    assert record.prefetch is None or record.prefetch.window is None  # the stored policy serves real copies
    goal0 = tp.ThroughputGoal(0.25, max_accuracy_loss=0.0, confidence=0.5)
    with pytest.raises(ValueError, match="no candidate"):
        tp.search_throughput(model, layers, plan, windows, goal0, cands=cands)


def test_search_decodes_and_stores_the_chosen_auxiliary_weight(tiny, monkeypatch):
    """A candidate with an auxiliary weight is simulated and decoded with the promoted plan, and the search
    returns that plan (what the pack stores). Scripted accuracies: only the weight-0.3 candidate is within."""
    model, layers, plan, windows = tiny
    decoded_plans = {}

    def fake_run_case(model, pack, plan, windows, budget_bytes, case, *, stop=None, progress=None):
        decoded_plans[case.name] = plan
        n = windows.shape[1] - 1
        correct = torch.ones(windows.shape[0], n, dtype=torch.bool)
        if case.plan != "full" and "aux0.3" not in case.name:
            correct.view(-1)[:8] = False
        return TokenScores(torch.zeros(windows.shape[0], n), correct), {}

    monkeypatch.setattr(tp, "run_case", fake_run_case)
    cands = [tp.Candidate(0.5), tp.Candidate(0.5, aux_full_weight=0.3)]
    record, chosen_plan = tp.search_throughput(model, layers, plan, windows,
                                               tp.ThroughputGoal(0.25, 0.1, confidence=0.5), cands=cands)
    assert record.search["chosen"]["candidate"] == "floor0.5-aux0.3"
    assert chosen_plan.aux_full_weight == 0.3 and chosen_plan.promoted(None).tier_widths == plan.tier_widths
    assert "routing weight >= 0.3" in chosen_plan.description
    assert decoded_plans["crisp-floor0.5-aux0.3"] == plan.promoted(0.3)
    speed = {r["candidate"]: r["bytes_per_token"] for r in record.search["candidates"]}
    assert speed["floor0.5-aux0.3"] > speed["floor0.5"]  # the promoted plan was the one simulated


@pytest.mark.parametrize("within", [{"crisp"}, {"skip_aux"}, {"uniform"}, {"crisp", "skip_aux", "uniform"}])
def test_the_baselines_at_the_plan_s_bytes_are_candidates(tiny, monkeypatch, within):
    """Skip-aux and uniform at the plan's bytes per token (at or below, on the traced routing) are served in place of
    the plan; scripted accuracies put only the kinds in ``within`` inside the bound. The fastest of those is chosen
    whichever kind it is, the plan returned (what the pack stores) is that baseline when one wins, the record says
    which kind won and holds every baseline's speed and loss."""
    from crisp_bench.traces import record_trace, routing

    from crisp_runtime.planning.baselines import equal_bytes_plans, neurons_per_token

    model, layers, plan, windows = tiny
    scored_plans = []

    def fake_score_plan(model, pack, served, windows):
        scored_plans.append(served)
        n = windows.shape[1] - 1
        correct = torch.ones(windows.shape[0], n, dtype=torch.bool)
        if served.policy.value not in within | {"full"}:
            correct.view(-1)[:8] = False  # 8 of 38: 21%, over the 10% bound
        return TokenScores(torch.zeros(windows.shape[0], n), correct)

    monkeypatch.setattr(tp, "score_plan", fake_score_plan)
    cands = [tp.Candidate(prefetch=PrefetchWidth.PLAN, kind=tp.CandidateServing.PLAN),
             tp.Candidate(prefetch=PrefetchWidth.PLAN, aux_full_weight=0.3, kind=tp.CandidateServing.PLAN),
             *(tp.Candidate(prefetch=PrefetchWidth.PLAN, kind=tp.CandidateServing.PLAN, baseline=b)
               for b in tp.SEARCH_BASELINES)]
    lines = []
    goal = tp.ThroughputGoal(0.25, 0.1, confidence=0.5)
    record, chosen_plan = tp.search_throughput(model, layers, plan, windows, goal, cands=cands, log=lines.append)
    search = record.search
    route = routing(record_trace(model, windows))
    matched = equal_bytes_plans(plan, route, at_most=True)
    by_kind = {b["kind"]: b for b in search["baselines"]}
    assert sorted(by_kind) == ["skip_aux", "uniform"]
    assert by_kind["uniform"]["uniform_width"] == matched["uniform"].uniform_width
    assert by_kind["skip_aux"]["skip_threshold"] == matched["skip_aux"].skip_threshold
    assert by_kind["skip_aux"]["num_dominant"] == plan.num_dominant
    for kind in by_kind:  # at the plan's bytes or fewer, on the routing the speed is simulated on
        assert neurons_per_token(matched[kind], route) <= neurons_per_token(plan, route) + 1e-9
        assert "accuracy_loss" in by_kind[kind]  # scored even when slower than the choice
    speed = {r["candidate"]: r["tokens_per_s"] for r in search["candidates"]}
    kind_of = {r["candidate"]: r.get("kind", "crisp") for r in search["candidates"]}
    want = max((c for c in speed if kind_of[c] in within), key=lambda c: speed[c])
    assert search["chosen"]["candidate"] == want and search["chosen_kind"] == kind_of[want]
    assert all(speed[want] >= speed[c] for c in speed if kind_of[c] in within)  # never slower than one within
    assert chosen_plan.policy.value == kind_of[want]
    if kind_of[want] != "crisp":
        assert chosen_plan.widths_digest() == matched[kind_of[want]].widths_digest()
        assert "baseline" in chosen_plan.description
    assert sum(f"throughput: chose {kind_of[want]} (" in ln for ln in lines) == 1


def _scripted_decode(losses: list[list[int]], decoded: list[tuple[str, int]]):
    """A run_case that decodes window by window as the real one does (``stop`` asked after each window but the
    last). The full-width reference loses nothing; the i-th candidate decoded loses ``losses[i][n]`` of the
    predictions of window n. ``decoded`` gets (case name, windows decoded) per candidate."""

    def run_case(model, pack, plan, windows, budget_bytes, case, *, stop=None, progress=None):
        n_windows, n = windows.shape[0], windows.shape[1] - 1
        correct = torch.ones(n_windows, n, dtype=torch.bool)
        lost = losses[len(decoded)] if case.plan != "full" else [0] * n_windows
        for w in range(n_windows):
            correct[w, : lost[w]] = False
            if stop is not None and w + 1 < n_windows and stop(TokenScores(torch.zeros(w + 1, n), correct[: w + 1])):
                break
        if case.plan != "full":
            decoded.append((case.name, w + 1))
        return TokenScores(torch.zeros(w + 1, n), correct[: w + 1]), {}

    return run_case


def test_search_accepts_only_a_loss_within_the_bound_at_its_confidence(tiny, monkeypatch):
    """Three candidates, 8 accuracy windows of 19 predictions, looks of 2 windows (the traced ones), bound 10%,
    confidence 95% (z = 1.645). Fastest first:
    - loses 10 in every window (52.6%, no spread): over the bound at the first look, stopped after 2 windows;
    - loses 0 / 3 alternately: 7.9% point loss, within, but 7.9% + 1.645 x 3.0% = 12.8%: unresolved, not taken;
    - loses 3 in the first window only: 2.0% + 1.645 x 2.0% = 5.2%: accepted after all 8 windows."""
    model, layers, plan, _ = tiny
    windows = contiguous_windows(read_texts([TEXT]), 8, 20)
    cands = [tp.Candidate(0.5, prefetch=PrefetchWidth.SERVING), tp.Candidate(0.5), tp.Candidate(1.0)]
    decoded = []
    monkeypatch.setattr(tp, "run_case", _scripted_decode([[10] * 8, [0, 3] * 4, [3] + [0] * 7], decoded))
    goal = tp.ThroughputGoal(0.25, max_accuracy_loss=0.1)
    record, _ = tp.search_throughput(model, layers, plan, windows[:2], goal, accuracy_windows=windows, cands=cands)
    by = {r["candidate"]: r for r in record.search["candidates"]}
    order = sorted(by, key=lambda k: -by[k]["tokens_per_s"])
    assert [name for name, _ in decoded] == [f"crisp-{k}" for k in order]  # fastest first
    assert [n for _, n in decoded] == [2, 8, 8]
    first, second, third = (by[k] for k in order)
    assert first["accuracy_decision"] == "over" and first["accuracy_windows"] == 2
    assert first["accuracy_loss"] == pytest.approx(10 / 19) and first["accuracy_loss_se"] == 0.0
    assert second["accuracy_decision"] == "unresolved" and second["accuracy_loss"] == pytest.approx(12 / 152)
    assert third["accuracy_decision"] == "within" and third["accuracy_windows"] == 8
    # the cluster standard error by hand: d = (3, 0 x 7) lost, a = 19 right per window, R = 3 / 152
    r = 3 / 152
    se = (((3 - r * 19) ** 2 + 7 * (r * 19) ** 2) * 8 / 7) ** 0.5 / 152
    assert third["accuracy_loss"] == pytest.approx(r) and third["accuracy_loss_se"] == pytest.approx(se)
    assert third["accuracy_loss_upper"] == pytest.approx(r + 1.6448536 * se)
    assert record.search["chosen"]["candidate"] == order[2]
    assert record.search["accuracy_windows"] == [8, 20] and record.search["windows"] == [2, 20]
    assert record.search["confidence"] == 0.95


def test_a_point_estimate_within_the_bound_is_not_enough(tiny, monkeypatch):
    """One candidate, 2.6% point loss, all of it in one of 4 windows: 2.6% + 1.645 x 2.6% is over 3%, so a search
    bounded at 3% finds nothing; at confidence 0.5 (the point estimate) it is accepted."""
    model, layers, plan, _ = tiny
    windows = contiguous_windows(read_texts([TEXT]), 4, 20)
    cands = [tp.Candidate(1.0)]
    monkeypatch.setattr(tp, "run_case", _scripted_decode([[2, 0, 0, 0]], []))  # 2 of 76: 2.6%
    with pytest.raises(ValueError, match="confidence"):
        tp.search_throughput(model, layers, plan, windows, tp.ThroughputGoal(0.25, 0.03), cands=cands)
    monkeypatch.setattr(tp, "run_case", _scripted_decode([[2, 0, 0, 0]], []))
    record, _ = tp.search_throughput(model, layers, plan, windows, tp.ThroughputGoal(0.25, 0.03, confidence=0.5),
                                     cands=cands)
    assert record.search["chosen"]["accuracy_loss"] == pytest.approx(2 / 76)


def test_serving_record_round_trips_through_a_pack(tmp_path):
    layers, plan, _ = load_pack_dir(PACK)
    record = ServingRecord(SERVING_POLICIES["resident-floor75-ahead"], PrefetchPolicy(width="serving"), "next_use",
                           0.25, {"profile": "rtx4090-pcie4", "tokens_per_s": 7.1})
    out = save_pack(tmp_path / "p", layers, plan=plan, info={"serving": record.to_dict()})
    back = serving_record(load_pack(out).info)
    assert back == record and back.search == record.search
    config = back.runtime_config()
    assert config.serving.dominant_widen is DominantWiden.AHEAD and config.prefetch.width is PrefetchWidth.SERVING
    total = sum(x.num_experts * x.intermediate_size * x.fmt.neuron_nbytes(x.hidden_size) for x in layers.values())
    assert back.budget_bytes(layers) == int(0.25 * total)
    assert serving_record(load_pack(save_pack(tmp_path / "q", layers, plan=plan)).info) is None  # optional


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(version=2), "version"),
    (lambda d: d.update(colour="red"), "unknown keys"),
    (lambda d: d.pop("eviction"), "lacks"),
    (lambda d: d.update(eviction="fifo"), "eviction"),
    (lambda d: d.update(gpu_budget_fraction=0), "gpu_budget_fraction"),
    (lambda d: d["policy"].update(dominant_widen="sometimes"), "dominant_widen"),
    (lambda d: d.update(prefetch={"width": "all"}), "width"),
    (lambda d: d.update(policy=[1]), "objects"),
])
def test_a_bad_serving_field_is_refused_at_load(tmp_path, change, match):
    layers, plan, _ = load_pack_dir(PACK)
    record = ServingRecord(SERVING_POLICIES["resident-floor75"], None, "lru", 0.5).to_dict()
    out = save_pack(tmp_path / "p", layers, plan=plan, info={"serving": record})
    info_path = out / "pack.json"
    info = json.loads(info_path.read_text())
    change(info["serving"])
    info_path.write_text(json.dumps(info))
    with pytest.raises(PackFormatError, match=match):
        load_pack(out)


# ---------------------------------------------------------------------------- crisp-profile --plan-for-throughput


def test_profile_stores_the_throughput_choice(tmp_path):
    from crisp_tools import profiler as prof
    from profile_helpers import PROFILE_ARGS, make_tiny_mixtral, write_text

    model = make_tiny_mixtral(tmp_path / "model")
    text = write_text(tmp_path / "calib.txt")
    out = tmp_path / "pack"
    rc = prof.main(["--model", str(model), "--data", str(text), "--out", str(out), *PROFILE_ARGS,
                    "--plan-for-throughput", "0.5", "--max-accuracy-loss", "1.0", "--throughput-windows", "2",
                    "--throughput-accuracy-windows", "3", "--throughput-seq-len", "12"])
    assert rc == 0
    pack = load_pack(out)
    record = serving_record(pack.info)
    assert record is not None and record.gpu_budget_fraction == 0.5
    search = record.search
    # a CRISP plan: its knobs searched too, and the baselines at its bytes
    space = tp.candidates(intermediate_size=pack.plan.intermediate_size, baselines=tp.SEARCH_BASELINES)
    assert len(search["candidates"]) == len(space) and search["windows"] == [2, 12]
    assert search["chosen_kind"] == pack.plan.policy.value
    assert sorted(b["kind"] for b in search["baselines"]) == ["skip_aux", "uniform"]
    assert all("accuracy_loss" in b for b in search["baselines"])  # scored beside the chosen one, even when slower
    assert search["accuracy_windows"] == [3, 12]
    assert "held-out calibration" in search["accuracy_text"]
    # a bound of 1.0 admits anything: the fastest simulated candidate is the one stored
    fastest = max(search["candidates"], key=lambda r: r["tokens_per_s"])
    assert search["chosen"]["candidate"] == fastest["candidate"]
    chosen = next(c for c in space if c.label == fastest["candidate"])
    assert record.policy == chosen.serving()
    # the pack's plan is the one the choice serves
    assert (pack.plan.aux_full_weight, pack.plan.aux_skip_weight, pack.plan.width_cap) == (
        chosen.aux_full_weight, chosen.aux_skip_weight, chosen.width_cap)
    assert search["chosen"]["accuracy_mode"] == ("batch" if chosen.exact else "decode")


def test_profile_searches_the_other_key_for_throughput_at_top4(tmp_path):
    """At top-k > 2 the throughput search also serves the plan's tiers over the other combination key (at the plan's
    cut-offs); the pack's plan is keyed as the chosen candidate says."""
    from crisp_tools import profiler as prof
    from profile_helpers import PROFILE_ARGS, make_tiny_mixtral, write_text

    from crisp_runtime.planning.pairs import CombinationKey

    model = make_tiny_mixtral(tmp_path / "model", experts=8, top_k=4)
    text = write_text(tmp_path / "calib.txt")
    out = tmp_path / "pack"
    args = [a for i, a in enumerate(PROFILE_ARGS) if a != "--search-target-bytes" and (
        i == 0 or PROFILE_ARGS[i - 1] != "--search-target-bytes")]
    rc = prof.main(["--model", str(model), "--data", str(text), "--out", str(out), *args, "--num-dominant", "2",
                    "--plan-for-throughput", "0.5", "--max-accuracy-loss", "1.0", "--throughput-windows", "2",
                    "--throughput-accuracy-windows", "2", "--throughput-seq-len", "12"])
    assert rc == 0
    pack = load_pack(out)
    search = serving_record(pack.info).search
    labels = [r["candidate"] for r in search["candidates"]]
    space = tp.candidates(intermediate_size=pack.plan.intermediate_size, baselines=tp.SEARCH_BASELINES)
    keyed = [lab for lab in labels if "-key-leading-expert" in lab]
    assert len(labels) == 2 * len(space) - len(tp.SEARCH_BASELINES) and len(keyed) == len(space) - 2
    chosen = search["chosen"]["candidate"]
    if pack.plan.policy.value == "crisp":
        expected = CombinationKey.LEADING_EXPERT if "-key-" in chosen else CombinationKey.LEADING_PAIR
        assert pack.plan.combination_key is expected


def test_profile_refuses_a_bad_hardware_profile_before_any_work(tmp_path, capsys):
    from crisp_tools import profiler as prof
    from profile_helpers import PROFILE_ARGS

    out = tmp_path / "pack"
    rc = prof.main(["--model", str(MODEL), "--data", str(TEXT), "--out", str(out), *PROFILE_ARGS,
                    "--plan-for-throughput", "0.25", "--hardware-profile", "abacus"])
    err = capsys.readouterr().err
    assert rc == 2 and "--hardware-profile abacus: unknown profile 'abacus'; choose one of: " in err
    assert "--profile:" not in err and not out.exists()


@pytest.mark.parametrize("budget", [["--plan-for-throughput", "0.25"], ["--gpu-budget", "0.25"]])
def test_profile_refuses_throughput_windows_longer_than_the_model_takes_before_any_work(tmp_path, capsys, budget):
    from crisp_tools import profiler as prof
    from profile_helpers import PROFILE_ARGS

    out = tmp_path / "pack"
    rc = prof.main(["--model", str(MODEL), "--data", str(TEXT), "--out", str(out), *PROFILE_ARGS, *budget,
                    "--throughput-seq-len", "600"])  # tiny-mixtral: max_position_embeddings 512
    err = capsys.readouterr().err
    assert rc == 2 and "--throughput-seq-len 600 is beyond the model's max_position_embeddings (512)" in err
    assert not out.exists() and not (tmp_path / ".pack.crisp-work").exists()


def test_profile_refuses_fewer_accuracy_windows_than_traced_before_any_work(tmp_path, capsys):
    from crisp_tools import profiler as prof
    from profile_helpers import PROFILE_ARGS

    out = tmp_path / "pack"
    rc = prof.main(["--model", str(MODEL), "--data", str(TEXT), "--out", str(out), *PROFILE_ARGS,
                    "--plan-for-throughput", "0.25", "--throughput-windows", "8", "--throughput-accuracy-windows", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "--throughput-accuracy-windows (4)" in err and "--throughput-windows (8)" in err
    assert not out.exists()


@pytest.mark.parametrize("extra, match", [
    (["--search-tier-widths", "256,128,64"], "only with --plan-for-throughput"),
    (["--plan-for-throughput", "0.25", "--search-tier-widths", "256,128,64", "256,300,0"],
     r"--search-tier-widths 256,300,0: .*\[0, 256\]"),
])
def test_profile_refuses_bad_searched_tier_widths_before_any_work(tmp_path, capsys, extra, match, monkeypatch):
    from crisp_tools import profiler as prof
    from crisp_tools.profiler import pipeline
    from profile_helpers import PROFILE_ARGS

    monkeypatch.setattr(pipeline, "resume_or_start", lambda *a, **k: pytest.fail("profiled"))
    out = tmp_path / "pack"
    rc = prof.main(["--model", str(MODEL), "--data", str(TEXT), "--out", str(out), *PROFILE_ARGS, *extra])
    assert rc == 2 and re.search(match, capsys.readouterr().err) and not out.exists()


# ---------------------------------------------------------------------------- the stored choice, simulated


def _searched_pack(tmp_path, record, aux_full_weight=0.4):
    layers, plan, _ = load_pack_dir(PACK)
    return save_pack(tmp_path / "searched", layers, plan=plan.promoted(aux_full_weight),
                     info={"serving": record.to_dict()}), plan.promoted(aux_full_weight)


def test_simulate_matrix_stored_times_the_choice_as_the_search_did(tmp_path, capsys):
    """crisp-bench simulate --matrix stored: the pack's stored serving choice (policy, eviction, prefetch width,
    budget) with its plan gives the tokens/s the throughput search's own simulation gives that candidate on the
    same trace (one implementation); options that would change the choice are refused."""
    from crisp_bench.cli import main as bench
    from crisp_bench.shapes import TARGETS
    from crisp_bench.traces import Trace

    record = ServingRecord(SERVING_POLICIES["resident-floor75-ahead"], PrefetchPolicy(width="serving"), "next_use",
                           0.3)
    packed, plan = _searched_pack(tmp_path, record)
    trace_path = ROOT / "bench/traces/heldout-predicted.npz"
    out = tmp_path / "sim.json"
    args = ["simulate", "--trace", str(trace_path), "--plan", str(packed), "--tokens", "40", "--warmup", "8"]
    assert bench([*args, "--matrix", "stored", "--orders", "router,widest_first", "--json", str(out)]) == 0
    assert "stored serving choice" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    got = {(r["label"], r["order"]): r for r in doc["records"]}
    crisp = got[("crisp/resident-floor75-ahead/next_use+prefetch-serving", "widest_first")]
    assert crisp["budget_fraction"] == 0.3 and crisp["aux_full_weight"] == 0.4
    trace = Trace.load(trace_path).head(40)
    cand = tp.Candidate(0.75, DominantWiden.AHEAD, PrefetchWidth.SERVING, aux_full_weight=0.4)
    base_tps, sims = tp.simulate_candidates(trace, plan.promoted(None), tp.ThroughputGoal(0.3, target="mixtral-8x7b"),
                                            TARGETS["mixtral-8x7b"], [cand], warmup=8)
    assert crisp["tokens_per_s"] == pytest.approx(sims[0]["tokens_per_s"], rel=1e-12)
    assert got[("full/plan/lru", "router")]["tokens_per_s"] == pytest.approx(base_tps, rel=1e-12)
    capsys.readouterr()
    for extra, match in ((["--serving", "resident"], "--serving"), (["--eviction", "lru,belady"], "--eviction"),
                         (["--prefetch-width", "plan"], None)):
        rc = bench([*args, "--matrix", "stored", *extra])
        if match is None:  # the default value is no change
            assert rc == 0
        else:
            assert rc == 2 and match in capsys.readouterr().err
    layers, plan, _ = load_pack_dir(PACK)
    plain = save_pack(tmp_path / "plain", layers, plan=plan)
    assert bench(["simulate", "--trace", str(trace_path), "--plan", str(plain), "--matrix", "stored"]) == 2
    assert "stores no serving choice" in capsys.readouterr().err
    assert bench(["simulate", "--trace", str(trace_path), "--plan", "auto", "--matrix", "stored"]) == 2
    assert "--plan PACK_FOLDER" in capsys.readouterr().err


# ---------------------------------------------------------------------------- plan knobs, exact scoring


def test_exact_candidates_are_scored_in_batch_and_resident_ones_decoded(tiny, monkeypatch):
    """Fastest first across both kinds: a candidate served at the plan's widths is scored by score_plan (its plan,
    paired with the full width's batch score), one served from what is resident by run_case (paired with the full
    width's decode); neither reference is computed before a candidate of its kind needs it. Scripted: everything
    but the slowest loses 8 of 38 predictions; the bound admits only 2."""
    model, layers, plan, windows = tiny
    exact = tp.Candidate(prefetch=PrefetchWidth.PLAN, aux_full_weight=0.4, aux_skip_weight=0.2, width_cap=192,
                         kind=tp.CandidateServing.PLAN)
    cands = [tp.Candidate(0.5, prefetch=PrefetchWidth.SERVING), exact, tp.Candidate(1.0, aux_full_weight=0.3)]
    calls = []

    def scores(windows, lose):
        n = windows.shape[1] - 1
        correct = torch.ones(windows.shape[0], n, dtype=torch.bool)
        correct.view(-1)[:lose] = False
        return TokenScores(torch.zeros(windows.shape[0], n), correct)

    def fake_score_plan(model, pack, p, windows, batch_size=16):
        full = p.policy.value == "full"
        calls.append(("batch", "full" if full else p))
        return scores(windows, 0 if full else lose[len([c for c in calls if c[1] != "full"]) - 1])

    def fake_run_case(model, pack, p, windows, budget_bytes, case, *, stop=None, progress=None):
        full = case.plan == "full"
        calls.append(("decode", "full" if full else case.name))
        return scores(windows, 0 if full else lose[len([c for c in calls if c[1] != "full"]) - 1]), {}

    monkeypatch.setattr(tp, "score_plan", fake_score_plan)
    monkeypatch.setattr(tp, "run_case", fake_run_case)
    goal = tp.ThroughputGoal(0.25, max_accuracy_loss=3 / 38, confidence=0.5)
    by_speed = None

    def run():
        nonlocal by_speed
        calls.clear()
        record, chosen = tp.search_throughput(model, layers, plan, windows, goal, cands=cands)
        by_speed = sorted(record.search["candidates"], key=lambda r: -r["tokens_per_s"])
        return record, chosen

    lose = [8, 8, 2]
    record, chosen = run()
    order = [r["candidate"] for r in by_speed]
    want = []
    for label in order:
        c = next(c for c in cands if c.label == label)
        kind = "batch" if c.exact else "decode"
        if (kind, "full") not in want:
            want.append((kind, "full"))
        want.append((kind, c.plan_for(plan) if c.exact else f"crisp-{label}"))
    assert calls == want  # each reference once, just before the first candidate of its kind
    assert record.search["chosen"]["candidate"] == order[2]
    modes = {r["candidate"]: r["accuracy_mode"] for r in by_speed}
    assert modes[exact.label] == "batch" and modes["floor0.5+prefetch-serving"] == "decode"
    # the exact candidate chosen: the stored serving is the plan's own, the stored plan carries its knobs
    lose = [2, 2, 2]
    monkeypatch.setattr(tp, "simulate_candidates", lambda *a, **k: (1.0, [
        {"candidate": c.label, "tokens_per_s": 3.0 - i, "x_full_lru": 3.0 - i, "bytes_per_token": 1.0, "hit_rate": 1.0}
        for i, c in enumerate([exact, *cands[:1], *cands[2:]])]))
    record, chosen = run()
    assert record.search["chosen"]["candidate"] == exact.label and record.policy == SERVING_POLICIES["plan"]
    assert record.prefetch.width is PrefetchWidth.PLAN
    assert (chosen.aux_full_weight, chosen.aux_skip_weight, chosen.width_cap) == (0.4, 0.2, 192)
    assert "skipped" in chosen.description and "192 neurons" in chosen.description
    assert calls == [("batch", "full"), ("batch", exact.plan_for(plan))]  # no decode at all


def test_rule_candidate_is_what_the_runtime_runs_without_a_stored_choice(tiny):
    from crisp_runtime.planning.defaults import default_family, pack_facts

    _, _, plan, _ = tiny
    goal = tp.ThroughputGoal(0.25)
    for p in (plan, CrispPlan.full(plan.num_experts, plan.top_k, plan.intermediate_size, plan.layer_ids)):
        gpu, _, _ = default_family(pack_facts({}, p, p.top_k))
        cand = tp.rule_candidate(p, goal)
        assert cand.serving() == gpu.serving and cand.prefetch_policy() == gpu.prefetch
        assert cand.exact == (p.policy.value == "full")
    assert tp.rule_candidate(plan, tp.ThroughputGoal(0.25, eviction="lru")) is None


@pytest.mark.parametrize(("speeds", "lose", "chosen"), [
    ((3.0, 2.0), 0, "exact"),  # the candidate is faster and within the bound: stored
    ((2.0, 3.0), 0, None),  # the rule is faster: nothing scored, nothing stored
    ((3.0, 2.0), 8, None),  # faster but over the bound: the rule runs, never a slower choice
])
def test_a_choice_slower_than_the_default_rule_is_never_stored(tiny, monkeypatch, speeds, lose, chosen):
    model, layers, plan, windows = tiny
    exact = tp.Candidate(prefetch=PrefetchWidth.PLAN, kind=tp.CandidateServing.PLAN)
    rule = tp.rule_candidate(plan, tp.ThroughputGoal(0.25))
    assert rule.label == "floor1+prefetch-plan"
    calls = []

    def fake_score_plan(model, pack, p, windows, batch_size=16):
        calls.append(p.policy.value)
        n = windows.shape[1] - 1
        correct = torch.ones(windows.shape[0], n, dtype=torch.bool)
        if p.policy.value != "full":
            correct.view(-1)[:lose] = False
        return TokenScores(torch.zeros(windows.shape[0], n), correct)

    def fake_simulate(trace, plan, goal, shape, cands, **kw):
        assert [c.label for c in cands] == [exact.label, rule.label]
        return 1.0, [{"candidate": c.label, "tokens_per_s": v, "x_full_lru": v, "bytes_per_token": 1.0,
                      "hit_rate": 1.0} for c, v in zip(cands, speeds, strict=True)]

    monkeypatch.setattr(tp, "score_plan", fake_score_plan)
    monkeypatch.setattr(tp, "simulate_candidates", fake_simulate)
    goal = tp.ThroughputGoal(0.25, max_accuracy_loss=3 / 38, confidence=0.5)
    if chosen is None:
        with pytest.raises(ValueError, match=r"no candidate faster than the default rule \(floor1\+prefetch-plan"):
            tp.search_throughput(model, layers, plan, windows, goal, cands=[exact], rule=rule)
        assert calls == ([] if speeds[1] > speeds[0] else ["full", plan.policy.value])
        return
    record, _ = tp.search_throughput(model, layers, plan, windows, goal, cands=[exact], rule=rule)
    assert record.search["chosen"]["candidate"] == exact.label and record.policy == SERVING_POLICIES["plan"]
    ruled = [r for r in record.search["candidates"] if r.get("default_rule")]
    assert [r["candidate"] for r in ruled] == [rule.label] and "accuracy_loss" not in ruled[0]


def test_score_plan_equals_the_decode_of_an_exact_candidate(tiny):
    """What makes batch scoring honest: at the plan's widths (a three-band capped plan, plan-width prefetch, a
    budget that evicts), the runtime's decode predicts exactly what one batch forward does."""
    from crisp_tools.serving_eval import ServingCase, run_case, score_plan, total_expert_bytes

    from crisp_runtime.storage.pack import CrispPack

    model, layers, plan, _ = tiny
    windows = contiguous_windows(read_texts([TEXT]), 3, 24)
    cand = tp.Candidate(prefetch=PrefetchWidth.PLAN, aux_full_weight=0.4, aux_skip_weight=0.2, width_cap=192,
                        kind=tp.CandidateServing.PLAN)
    p = cand.plan_for(plan)
    pack = CrispPack(layers, plan)
    batch = score_plan(model, pack, p, windows)
    case = ServingCase("exact", "crisp", cand.serving(), cand.prefetch_policy())
    decoded, stats = run_case(model, pack, p, windows, int(0.25 * total_expert_bytes(layers)), case)
    assert stats["evictions"] > 0  # the cache was under pressure, and the outputs did not care
    assert torch.equal(batch.correct, decoded.correct)
    assert torch.allclose(batch.nll, decoded.nll, atol=1e-4)


def test_the_budget_of_a_tail_pack_is_a_fraction_of_its_4bit_bytes(tmp_path):
    """Equal GPU memory: a stored budget fraction on a 2-bit tail pack is of its 4-bit source's bytes, as the
    simulator and crisp-eval count it (the tail pack's own bytes are 62.5% of them here)."""
    from crisp_tools import tail_pack

    from crisp_runtime.storage.serving_record import budget_base_bytes

    out = tmp_path / "t"
    assert tail_pack.main(["--model", str(MODEL), "--crisp", str(PACK), "--layout", "2g128@0.25", "--out", str(out),
                           "--quiet"]) == 0
    src, tail = load_pack(PACK).layers, load_pack(out).layers
    four_bit = sum(x.num_experts * x.intermediate_size * x.fmt.neuron_nbytes(x.hidden_size) for x in src.values())
    own = sum(x.num_experts * x.intermediate_size * x.fmt.neuron_nbytes(x.hidden_size) for x in tail.values())
    assert own == 0.625 * four_bit and budget_base_bytes(tail) == budget_base_bytes(src) == four_bit
    assert ServingRecord(SERVING_POLICIES["resident"], None, "lru", 0.25).budget_bytes(tail) == int(0.25 * four_bit)


def test_a_tail_pack_search_needs_its_4bit_reference_before_any_work(monkeypatch):
    from crisp_kernels.tail_layout import parse_tail_layout

    monkeypatch.setattr(tp, "record_trace", lambda *a, **k: pytest.fail("traced"))
    layers, plan, _ = load_pack_dir(PACK)
    with pytest.raises(ValueError, match="relative to the 4-bit full width: give reference_layers"):
        tp.search_throughput(None, layers, plan, torch.zeros(2, 8, dtype=torch.long), tp.ThroughputGoal(0.25),
                             layout=parse_tail_layout("2g128@0.25"))


def test_the_search_simulates_a_tail_pack_as_crisp_bench_simulate_does(tmp_path):
    """One implementation: a stored choice on a 2-bit tail pack, timed by `crisp-bench simulate --matrix stored
    --tail-layout`, gives the tokens/s and bytes the search's own simulation gave that candidate (its layout's
    bytes, the floor in neurons, the 4-bit full-width LRU as the baseline, the same budget in bytes)."""
    from crisp_bench.cli import main as bench
    from crisp_bench.shapes import TARGETS
    from crisp_bench.traces import Trace
    from crisp_tools import tail_pack

    from crisp_kernels.tail_layout import parse_tail_layout

    tail = tmp_path / "t"
    assert tail_pack.main(["--model", str(MODEL), "--crisp", str(PACK), "--layout", "2g128@0.25", "--out", str(tail),
                           "--tier-widths", "256,64,32", "--quiet"]) == 0
    layers, plan, info = load_pack_dir(tail)
    cand = tp.Candidate(0.875, DominantWiden.AHEAD, PrefetchWidth.SERVING, aux_full_weight=0.4)
    record = ServingRecord(cand.serving(), cand.prefetch_policy(), "next_use", 0.25)
    info = {k: v for k, v in info.items() if k not in ("format", "version", "quant", "files")}
    stored = save_pack(tmp_path / "stored", layers, plan=cand.plan_for(plan),
                       info={**info, "serving": record.to_dict()})
    trace_path = ROOT / "bench/traces/heldout-predicted.npz"
    out = tmp_path / "sim.json"
    assert bench(["simulate", "--trace", str(trace_path), "--plan", str(stored), "--tail-layout", "2g128@0.25",
                  "--matrix", "stored", "--tokens", "40", "--warmup", "8", "--json", str(out)]) == 0
    got = {(r["label"], r["order"]): r for r in json.loads(out.read_text())["records"]}
    crisp = got[("crisp/resident-floor87.5-ahead/next_use+prefetch-serving@2g128at0.25", "widest_first")]
    trace = Trace.load(trace_path).head(40)
    base_tps, sims = tp.simulate_candidates(trace, plan, tp.ThroughputGoal(0.25, target="mixtral-8x7b"),
                                            TARGETS["mixtral-8x7b"], [cand], warmup=8,
                                            layout=parse_tail_layout("2g128@0.25"))
    assert crisp["tokens_per_s"] == pytest.approx(sims[0]["tokens_per_s"], rel=1e-12)
    assert crisp["bytes_per_token"] == pytest.approx(sims[0]["bytes_per_token"], rel=1e-12)
    assert got[("full/plan/lru", "router")]["tokens_per_s"] == pytest.approx(base_tps, rel=1e-12)
    plain_tps, plain = tp.simulate_candidates(trace, plan, tp.ThroughputGoal(0.25, target="mixtral-8x7b"),
                                              TARGETS["mixtral-8x7b"], [cand], warmup=8)
    assert plain_tps == base_tps and plain[0]["bytes_per_token"] > sims[0]["bytes_per_token"]  # 2-bit rows: fewer


def test_simulating_in_worker_processes_gives_the_same_records():
    """workers > 1 spawns processes; each record is the one process's, in the candidates' order."""
    from crisp_bench.shapes import TARGETS
    from crisp_bench.traces import Trace

    _, plan, _ = load_pack_dir(PACK)
    trace = Trace.load(ROOT / "bench/traces/heldout-predicted.npz").head(24)
    cands = [tp.Candidate(0.75, prefetch=PrefetchWidth.SERVING), tp.Candidate(1.0, aux_full_weight=0.3),
             tp.Candidate(prefetch=PrefetchWidth.PLAN, aux_skip_weight=0.2, aux_full_weight=0.4,
                          kind=tp.CandidateServing.PLAN)]
    goal = tp.ThroughputGoal(0.25, target="mixtral-8x7b")
    lines = []
    serial = tp.simulate_candidates(trace, plan, goal, TARGETS["mixtral-8x7b"], cands, warmup=4)
    pooled = tp.simulate_candidates(trace, plan, goal, TARGETS["mixtral-8x7b"], cands, warmup=4, workers=2,
                                    log=lines.append)
    assert pooled == serial and [r["candidate"] for r in pooled[1]] == [c.label for c in cands]
    assert [ln.split(" ")[2] for ln in lines] == ["1/3", "2/3", "3/3"]
    with pytest.raises(ValueError, match="workers"):
        tp.simulate_candidates(trace, plan, goal, TARGETS["mixtral-8x7b"], cands, warmup=4, workers=0)
