"""crisp-profile on a tiny random Mixtral: pack + plan, the permutation, tiers, resume, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from crisp_tools import profiler as prof  # noqa: E402
from crisp_tools.calibration import load_model  # noqa: E402
from profile_helpers import PROFILE_ARGS, make_tiny_mixtral, reorder_changes_nothing, write_text  # noqa: E402

from crisp_kernels.format import dequantize_layer, pack_layer  # noqa: E402
from crisp_runtime.planning.pairs import CombinationKey  # noqa: E402
from crisp_runtime.planning.plan import PolicyKind, Tier  # noqa: E402
from crisp_runtime.storage.pack import load_pack  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = make_tiny_mixtral(root / "model")
    text = write_text(root / "calib.txt")
    return root, model, text


@pytest.fixture(scope="module")
def profiled(tiny):
    root, model, text = tiny
    out = root / "pack"
    rc = prof.main(["--model", str(model), "--data", str(text), "--out", str(out), *PROFILE_ARGS])
    assert rc == 0
    return out


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_a_profile_without_a_budget_says_that_the_default_rule_serves_it(tiny, tmp_path, capsys):
    _, model, text = tiny
    args = [a for a in PROFILE_ARGS if a != "--quiet"]
    assert prof.main(["--model", str(model), "--data", str(text), "--out", str(tmp_path / "pack"), *args]) == 0
    err = capsys.readouterr().err
    assert "no serving choice stored: apply(model, pack, gpu_budget=B) runs the default rule" in err
    assert "serving" not in load_pack(tmp_path / "pack").info


def test_profile_writes_pack_and_plan(tiny, profiled):
    root, model_dir, _ = tiny
    pack = load_pack(profiled)
    assert pack.plan is not None and pack.plan.policy is PolicyKind.CRISP
    assert sorted(pack.layers) == [0, 1]
    assert pack.info["model"]["weights_sha256"]
    assert pack.info["search"]["chosen"]["bytes_fraction"] <= 0.55 + 1e-9
    assert 0.0 <= pack.info["dominance_proxy_agreement"] <= 1.0
    assert "fall back to the routing-weight proxy" in pack.plan.description
    # the work folder and temporary folders are gone
    assert _leftovers(root) == []
    model, _ = load_model(model_dir)
    pack.check_model(model)


def test_permutation_preserves_the_unquantized_function(tiny, profiled):
    """Reordering gate/up rows and down columns by the pack's neuron order changes nothing."""
    _, model_dir, text = tiny
    ids = torch.tensor(list(text.read_bytes()[:96]), dtype=torch.long).view(3, 32)
    assert reorder_changes_nothing(model_dir, load_pack(profiled), ids) <= 1e-12


def test_quantization_does_not_depend_on_the_order(tiny, profiled):
    """Groups run along H, so the reordered pack dequantizes to the unreordered one, bit for bit."""
    _, model_dir, _ = tiny
    _, layers = load_model(model_dir)
    pack = load_pack(profiled)
    for ref in layers:
        packed = pack.layers[ref.layer_id]
        plain = pack_layer(ref.module.gate_up_proj.detach(), ref.module.down_proj.detach(), packed.fmt)
        for a, b in zip(dequantize_layer(packed), dequantize_layer(plain), strict=True):
            assert torch.equal(a, b)


def test_tiers_partition_the_seen_combinations(profiled):
    pack = load_pack(profiled)
    info = json.loads((profiled / "pack.json").read_text())
    total_tokens = 24 * 32
    for layer_id, lp in pack.plan.layers.items():
        rows = info["combinations"][str(layer_id)]
        seen = {tuple(r["experts"]) for r in rows}
        assert set(lp.tiers) == seen  # every seen pair has exactly one tier (a dict: no pair twice)
        assert sum(r["count"] for r in rows) == total_tokens
        assert set(lp.tiers.values()) <= set(Tier)
        for pair, dom in lp.dominant.items():
            assert dom in pair
        # Hot pairs are at least as frequent as Warm, Warm at least as frequent as Cold
        count = {tuple(r["experts"]): r["count"] for r in rows}
        rank = {Tier.HOT: 0, Tier.WARM: 1, Tier.COLD: 2}
        for p in seen:
            for q in seen:
                if rank[lp.tiers[p]] < rank[lp.tiers[q]]:
                    assert count[p] >= count[q]
        # measured pairs use the measured damage
        for r in rows:
            if r["measured"]:
                da, db = r["mask_damage"]
                assert r["dominant"] == (r["experts"][0] if da >= db else r["experts"][1])


def test_resume_after_interruption_equals_uninterrupted(tiny, profiled, tmp_path):
    _, model_dir, text = tiny
    out = tmp_path / "resumed"
    work = tmp_path / "work"
    argv = ["--model", str(model_dir), "--data", str(text), "--out", str(out), "--work-dir", str(work), *PROFILE_ARGS]
    with pytest.raises(prof.ProfileInterrupted):
        prof.main(argv, interrupt_after=1)
    assert not out.exists()  # nothing half-written
    assert len(list(work.glob(f"run-*/{prof.STATS_FILE}"))) == 1  # one run-keyed checkpoint folder
    assert prof.main(argv) == 0
    assert not work.exists()
    a, b = load_pack(profiled), load_pack(out)
    assert (profiled / "plan.json").read_text() == (out / "plan.json").read_text()
    for lid in a.layers:
        for name, t in a.layers[lid].tensors().items():
            assert torch.equal(t, b.layers[lid].tensors()[name]), name
    strip = ("elapsed_s",)
    assert {k: v for k, v in a.info.items() if k not in strip} == {k: v for k, v in b.info.items() if k not in strip}


def test_rerun_replaces_the_same_models_pack(tiny, profiled, tmp_path):
    _, model_dir, text = tiny
    out = tmp_path / "again"
    shutil.copytree(profiled, out)
    argv = ["--model", str(model_dir), "--data", str(text), "--out", str(out), *PROFILE_ARGS]
    assert prof.main(argv) == 0
    assert (out / "plan.json").read_text() == (profiled / "plan.json").read_text()


def _bad_cases(tiny, profiled, tmp):
    root, model_dir, text = tiny
    empty = tmp / "empty.txt"
    empty.write_text("")
    short = tmp / "short.txt"
    short.write_text("def f(): pass\n")
    other = tmp / "other_pack"
    shutil.copytree(profiled, other)
    info = json.loads((other / "pack.json").read_text())
    info["model"]["weights_sha256"] = "0" * 64
    (other / "pack.json").write_text(json.dumps(info))
    junk = tmp / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    m, d = str(model_dir), str(text)
    return {
        "missing model": (["--model", str(tmp / "nope"), "--data", d], "not a directory", None),
        "missing data": (["--model", m, "--data", str(tmp / "nope.txt")], "no such file", None),
        "empty text": (["--model", m, "--data", str(empty)], "empty", None),
        "too short text": (["--model", m, "--data", str(short)], "fewer than --seq-len", None),
        "too many samples": (["--model", m, "--data", str(short), "--seq-len", "8", "--samples", "500"],
                             "too little text", None),
        "seq-len beyond the model": (["--model", m, "--data", d, "--seq-len", "65"], "max_position_embeddings", None),
        "another model's pack": (["--model", m, "--data", d], "different model", other),
        "a folder that is not a pack": (["--model", m, "--data", d], "holds no CRISP pack", junk),
    }


@pytest.mark.parametrize("case", ["missing model", "missing data", "empty text", "too short text", "too many samples",
                                  "seq-len beyond the model", "another model's pack", "a folder that is not a pack"])
def test_bad_input_exits_2_and_writes_nothing(tiny, profiled, tmp_path, capsys, case):
    argv, message, out = _bad_cases(tiny, profiled, tmp_path)[case]
    out = out or tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    snapshot = {p.name: p.read_bytes() for p in out.iterdir()} if out.exists() else None
    defaults = ["--samples", "4", "--seq-len", "32"] if "--seq-len" not in argv else []
    rc = prof.main([*argv, "--out", str(out), *defaults, "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "crisp-profile: error:" in err and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temp or work folders left behind
    if snapshot is not None:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == snapshot


def test_help_documents_every_option():
    text = prof.build_parser().format_help()
    for opt in ("--model", "--data", "--samples", "--seq-len", "--out", "--device", "--group-size", "--hot-mass",
                "--cold-mass", "--warm-width", "--search-target-bytes", "--work-dir"):
        assert opt in text


def test_search_over_cold_widths(tiny, profiled, tmp_path):
    """--search-cold-widths adds candidates whose Cold auxiliary keeps a prefix; every candidate stays within the
    bytes target, the chosen record is the plan written, and without the option the search is the paper's."""
    _, model, text = tiny
    out = tmp_path / "cold"
    rc = prof.main(["--model", str(model), "--data", str(text), "--out", str(out), *PROFILE_ARGS,
                    "--search-cold-widths", "0,0.0625"])
    assert rc == 0
    pack = load_pack(out)
    search = pack.info["search"]
    inter = pack.plan.intermediate_size
    widths = {c["cold_width"] for c in search["candidates"]}
    assert widths == {0, round(0.0625 * inter)}  # 2 of 32 neurons
    assert all(c["bytes_fraction"] <= 0.55 + 1e-9 for c in search["candidates"])
    assert all(c["warm_width"] >= c["cold_width"] for c in search["candidates"])
    chosen = search["chosen"]
    assert chosen == min(search["candidates"], key=lambda c: c["loss"])
    assert pack.plan.tier_widths.cold == chosen["cold_width"] and pack.plan.tier_widths.warm == chosen["warm_width"]
    assert f"cold={chosen['cold_width']} of {inter}" in pack.plan.description
    # the default run: Cold runs the dominant only, records without the key
    plain = load_pack(profiled)
    assert plain.plan.tier_widths.cold == 0 and "cold_width" not in plain.info["search"]["chosen"]
    # only a non-zero width: the plan written keeps it (no Cold tier at cold_mass 0, so those cut-offs drop out)
    only = tmp_path / "cold-only"
    assert prof.main(["--model", str(model), "--data", str(text), "--out", str(only), *PROFILE_ARGS,
                      "--search-cold-widths", "0.0625"]) == 0
    pack = load_pack(only)
    assert pack.plan.tier_widths.cold == 2 == pack.info["search"]["chosen"]["cold_width"]
    assert all(c["cold_mass"] > 0 for c in pack.info["search"]["candidates"])
    # the option needs the search
    assert prof.main(["--model", str(model), "--data", str(text), "--out", str(tmp_path / "x"), "--quiet",
                      "--search-cold-widths", "0,0.25"]) == 2


def _best(records, kind):
    return min(r["loss"] for r in records if r.get("kind", "crisp") == kind)


def test_search_scores_the_baselines_at_the_target(tiny, profiled):
    """Skip-aux and uniform are points of the byte search: each the closest to the target at or below it, scored on
    the same held-out windows; the plan written has the lowest loss of all and its kind is recorded."""
    pack = load_pack(profiled)
    search = pack.info["search"]
    inter = pack.plan.intermediate_size
    baselines = search["baselines"]
    assert sorted(b["kind"] for b in baselines) == ["skip_aux", "uniform"]  # top-2: one dominant count
    assert all(b["bytes_fraction"] <= 0.55 + 1e-9 for b in baselines)
    (uniform,) = (b for b in baselines if b["kind"] == "uniform")
    assert uniform["uniform_width"] == 17 and (uniform["uniform_width"] + 1) / inter > 0.55  # the widest that fits
    everything = search["candidates"] + baselines
    assert search["chosen"]["loss"] == min(r["loss"] for r in everything)
    assert all(search["chosen"]["loss"] <= b["loss"] for b in baselines)
    assert search["best_loss_by_kind"] == {k: _best(everything, k) for k in ("crisp", "skip_aux", "uniform")}
    assert search["chosen_kind"] == search["chosen"].get("kind", "crisp") == pack.plan.policy.value


@pytest.mark.parametrize("favoured, policy", [("crisp", PolicyKind.CRISP), ("skip_aux", PolicyKind.SKIP_AUX),
                                              ("uniform", PolicyKind.UNIFORM)])
def test_search_writes_the_kind_with_the_lowest_held_out_loss(tiny, tmp_path, monkeypatch, capsys, favoured, policy):
    """A scorer that makes every other kind worse by 1 nat: the search writes the favoured kind's best plan, a valid
    plan of that policy the pack and runtime load, says so in pack.json and in one log line, and its held-out loss
    is at most each baseline's."""
    import dataclasses

    from crisp_tools.profiler import search as ps

    real = ps.held_out_scores

    def scored(inputs, weights, plan):
        got = real(inputs, weights, plan)
        return got if plan.policy.value == favoured else dataclasses.replace(got, nll=got.nll + 1.0)

    monkeypatch.setattr(ps, "held_out_scores", scored)
    _, model, text = tiny
    out = tmp_path / "pack"
    args = [a for a in PROFILE_ARGS if a != "--quiet"]
    assert prof.main(["--model", str(model), "--data", str(text), "--out", str(out), *args]) == 0
    pack = load_pack(out)
    search = pack.info["search"]
    assert search["chosen_kind"] == favoured and pack.plan.policy is policy
    assert all(search["chosen"]["loss"] <= b["loss"] for b in search["baselines"])
    best = search["best_loss_by_kind"]
    assert search["chosen"]["loss"] == best[favoured] == min(best.values())
    assert search["chosen"]["bytes_fraction"] <= 0.55 + 1e-9
    if favoured == "crisp":
        assert search["chosen"] in search["candidates"] and "baseline" not in pack.plan.description
    else:
        assert search["chosen"] in search["baselines"] and search["chosen"]["kind"] == favoured
        assert pack.plan.description.startswith(("Skip-auxiliary baseline:", "Uniform-width baseline:"))
        expected = (pack.plan.uniform_width if policy is PolicyKind.UNIFORM else pack.plan.skip_threshold)
        assert expected == search["chosen"]["uniform_width" if policy is PolicyKind.UNIFORM else "skip_threshold"]
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if f"search: chose {favoured} (held-out" in line]) == 1
    # the runtime serves the plan written
    from crisp_runtime import apply

    loaded, _ = load_model(model)
    handle = apply(loaded, pack)
    with torch.no_grad():
        loaded(input_ids=torch.tensor(list(text.read_bytes()[:32])).view(1, 32))
    assert handle.stats()["tokens"] > 0


@pytest.mark.parametrize("target, num_dominant, expected", [
    (0.54, None, [("skip_aux", 1), ("uniform", None), ("skip_aux", 2), ("skip_aux", 3)]),  # top-6: 1, 2, 3 fit
    (0.30, None, [("skip_aux", 1), ("uniform", None)]),  # two dominants alone are 33%
    (0.54, 2, [("skip_aux", 2), ("uniform", None)]),  # --num-dominant 2
])
def test_baselines_of_a_top6_search(target, num_dominant, expected):
    """Top-6: one skip-aux per searched dominant count and one uniform width, each the most bytes at or below the
    target (on the routing the search measures every candidate's bytes on)."""
    from types import SimpleNamespace

    from crisp_tools.profiler.search import baseline_plans, bytes_fraction

    from crisp_runtime.planning.baselines import dominant_and_aux_weights
    from crisp_runtime.planning.plan import CrispPlan, TierWidths

    e, k, inter, layers, tokens = 16, 6, 32, (1, 2), 200
    g = torch.Generator().manual_seed(0)
    routing = {lid: (torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]),
                     torch.rand(tokens, k, generator=g).softmax(dim=1)) for lid in layers}
    plan = CrispPlan(PolicyKind.CRISP, e, k, inter, layers, tier_widths=TierWidths(inter, 4, 0))
    inputs = SimpleNamespace(cfg=SimpleNamespace(search_target_bytes=target, num_dominant=num_dominant), top_k=k)
    got = baseline_plans(inputs, plan, routing)
    assert [(r["kind"], r.get("num_dominant")) for r, _ in got] == expected
    for rec, base in got:
        assert rec["bytes_fraction"] == bytes_fraction(base, routing) <= target + 1e-9
        if rec["kind"] == "uniform":
            assert base.uniform_width == int(target * inter)  # the widest uniform width within the target
        else:
            assert base.num_dominant == rec["num_dominant"] and base.skip_threshold == rec["skip_threshold"]
            # one more auxiliary slot kept (the next lower weight) would exceed the target
            weights = dominant_and_aux_weights(routing, e, base.num_dominant)[1].tolist()
            below = base.skip_threshold if base.skip_threshold is not None else float("inf")
            aux = sorted(w for w in weights if w < below)
            if aux:
                wider = CrispPlan.skip_aux(e, k, inter, layers, threshold=aux[-1], num_dominant=base.num_dominant)
                assert bytes_fraction(wider, routing) > target


@pytest.fixture(scope="module")
def tiny_top4(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-top4")
    return make_tiny_mixtral(root / "model", experts=8, top_k=4), write_text(root / "calib.txt")


@pytest.mark.parametrize("favoured", list(CombinationKey))
def test_top4_search_scores_both_combination_keys(tiny_top4, tmp_path, monkeypatch, favoured):
    """At top-k > 2 the byte search scores every tier setting under both keys (leading pair, leading expert), each
    within the target with tiers over that key's counted combinations; with a scorer favouring one key's CRISP plans
    the pack's plan is keyed on it, its tiers are the chosen setting's, and the runtime serves it."""
    import dataclasses

    from crisp_tools.profiler import search as ps

    real = ps.held_out_scores

    def scored(inputs, weights, plan):
        got = real(inputs, weights, plan)
        keep = plan.policy is PolicyKind.CRISP and plan.combination_key is favoured
        return got if keep else dataclasses.replace(got, nll=got.nll + 1.0)

    monkeypatch.setattr(ps, "held_out_scores", scored)
    model, text = tiny_top4
    out = tmp_path / "pack"
    assert prof.main(["--model", str(model), "--data", str(text), "--out", str(out), *PROFILE_ARGS]) == 0
    pack = load_pack(out)
    search = pack.info["search"]
    keys = {c["combination_key"] for c in search["candidates"]}
    assert keys == {k.value for k in CombinationKey}
    assert all(c["bytes_fraction"] <= 0.55 + 1e-9 for c in search["candidates"])
    # a leading expert has no label to measure: its candidates use the routing-weight rule only
    assert {c["dominance"] for c in search["candidates"]
            if c["combination_key"] == CombinationKey.LEADING_EXPERT.value} == {"routing-weight"}
    best = search["best_crisp_loss_by_key"]
    assert best == {k: min(c["loss"] for c in search["candidates"] if c["combination_key"] == k) for k in keys}
    assert search["chosen_kind"] == "crisp" and search["chosen"]["combination_key"] == favoured.value
    plan = pack.plan
    assert plan.combination_key is favoured and favoured.value.split("-by-")[0].replace("-", " ") in plan.description
    for layer in plan.layers.values():  # combinations of the favoured key only
        assert layer.tiers and {len(c) for c in layer.tiers} == {favoured.size}
    from crisp_runtime import apply

    loaded, _ = load_model(model)
    handle = apply(loaded, pack)
    with torch.no_grad():
        loaded(input_ids=torch.tensor(list(text.read_bytes()[:32])).view(1, 32))
    assert handle.stats()["tokens"] > 0


@pytest.mark.parametrize("option, top_k, search, expected", [
    ("auto", 4, True, list(CombinationKey)),
    ("auto", 4, False, [CombinationKey.LEADING_PAIR]),
    ("auto", 2, True, [CombinationKey.LEADING_PAIR]),  # top-2: the pair is the whole combination
    ("leading-expert", 2, True, [CombinationKey.LEADING_EXPERT]),
    ("leading-pair", 6, True, [CombinationKey.LEADING_PAIR]),
])
def test_combination_key_option(option, top_k, search, expected):
    from crisp_tools.profiler.config import ProfileConfig

    cfg = ProfileConfig(model="m", data=["d"], out="o", combination_key=option,
                        search_target_bytes=0.5 if search else None)
    assert cfg.candidate_keys(top_k) == expected
    assert cfg.candidate_rules(CombinationKey.LEADING_EXPERT) == ["routing-weight"]
