"""crisp-eval end to end: profile -> pack -> plan -> apply -> evaluation, both engines, equal bytes."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from crisp_tools import evaluate as ev  # noqa: E402
from crisp_tools import profiler as prof  # noqa: E402
from crisp_tools.calibration import contiguous_windows, load_model, score_windows  # noqa: E402
from profile_helpers import PROFILE_ARGS, make_tiny_mixtral, write_text  # noqa: E402

from crisp_runtime import apply, load_pack  # noqa: E402
from crisp_runtime.hf.moe_layers import record_routing  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model = make_tiny_mixtral(root / "model")
    text = write_text(root / "calib.txt")
    held = write_text(root / "heldout.txt", 4000)
    out = root / "pack"
    assert prof.main(["--model", str(model), "--data", str(text), "--out", str(out), *PROFILE_ARGS]) == 0
    return root, model, held, out


def _run(setup, engine, tmp_path):
    _, model, held, out = setup
    path = tmp_path / f"{engine}.json"
    rc = ev.main(["--model", str(model), "--crisp", str(out), "--data", str(held), "--seq-len", "32",
                  "--samples", "24", "--engine", engine, "--json", str(path), "--quiet", "--threads", "1"])
    assert rc == 0
    return json.loads(path.read_text())


def test_eval_engines_agree_and_bytes_match(setup, tmp_path, capsys):
    runtime = _run(setup, "runtime", tmp_path)
    table = capsys.readouterr().out
    reference = _run(setup, "reference", tmp_path)
    by_rt = {r["policy"]: r for r in runtime["records"]}
    by_ref = {r["policy"]: r for r in reference["records"]}
    assert list(by_rt) == ["dense", "full", "crisp", "uniform", "skip_aux", "skip_aux_all"]
    for name in by_rt:
        for key in ("policy", "bytes_per_token", "perplexity", "accuracy"):
            assert key in by_rt[name]
        assert by_rt[name]["bytes_per_token"] == pytest.approx(by_ref[name]["bytes_per_token"], rel=1e-12)
        assert by_rt[name]["perplexity"] == pytest.approx(by_ref[name]["perplexity"], rel=1e-4)
    full_bpt = runtime["full_width_bytes_per_token"]
    assert by_rt["full"]["bytes_per_token"] == full_bpt
    assert by_rt["skip_aux_all"]["bytes_per_token"] == full_bpt / 2
    # baselines at equal bytes: uniform within half a neuron step, skip-aux close
    step = full_bpt / setup_intermediate(setup)
    assert abs(by_rt["uniform"]["bytes_per_token"] - by_rt["crisp"]["bytes_per_token"]) <= step / 2 + 1e-9
    assert abs(by_rt["skip_aux"]["bytes_fraction_of_full"] - by_rt["crisp"]["bytes_fraction_of_full"]) < 0.05
    assert "crisp" in table and "uniform" in table and "relative accuracy loss" in table
    # each equal-bytes row's relative loss carries its standard error, paired by window with the full width
    # (24 windows: finite); the advantages are differences of those losses
    for name in ("crisp", "uniform", "skip_aux", "skip_aux_all"):
        assert by_rt[name]["relative_accuracy_loss_vs_full_se"] >= 0.0
    assert "relative_accuracy_loss_vs_full_se" not in by_rt["full"]
    assert runtime["verdict"]["crisp_relative_accuracy_loss_se"] == by_rt["crisp"]["relative_accuracy_loss_vs_full_se"]
    crisp_bpt = by_rt["crisp"]["bytes_per_token"]
    for name in ("uniform", "skip_aux"):
        base = by_rt[name]
        assert by_rt["crisp"][f"advantage_vs_{name}_nearest"] == pytest.approx(
            base["relative_accuracy_loss_vs_full"] - by_rt["crisp"]["relative_accuracy_loss_vs_full"], abs=1e-12)
        # at exactly the plan's bytes: two runs of the family bracket them and are interpolated by bytes
        eq = base["equal_bytes"]
        assert by_rt["crisp"][f"advantage_vs_{name}"] == pytest.approx(
            base["equal_bytes_relative_accuracy_loss_vs_full"] - by_rt["crisp"]["relative_accuracy_loss_vs_full"],
            abs=1e-12)
        if eq["interpolated"]:
            lo, hi, w = eq["below"], eq["above"], eq["weight_below"]
            assert lo["bytes_per_token"] <= crisp_bpt <= hi["bytes_per_token"] and 0.0 <= w <= 1.0
            assert w * lo["bytes_per_token"] + (1 - w) * hi["bytes_per_token"] == pytest.approx(crisp_bpt)
            acc = {r["knob"]: r["accuracy"] for r in eq["runs"]}
            assert base["equal_bytes_accuracy"] == pytest.approx(
                w * acc[lo["knob"]] + (1 - w) * acc[hi["knob"]], abs=1e-12)
        else:  # no bracket: the nearest run, which is the matched row itself here
            assert eq["bytes_per_token"] == base["bytes_per_token"]


def setup_intermediate(setup):
    return load_pack(setup[3]).plan.intermediate_size


def test_profile_pack_plan_apply_evaluation(setup):
    """The pack's plan through crisp_runtime.apply: bytes per token = widths x neuron bytes of the plan."""
    _, model_dir, held, out = setup
    model, refs = load_model(model_dir)
    pack = load_pack(out)
    windows = contiguous_windows([held.read_text()], 8, 32)
    with apply(model, out) as handle, record_routing(model, refs) as trace:
        scores = score_windows(model, windows)
        stats = handle.stats()
    assert torch.isfinite(scores.nll).all()
    layer = next(iter(pack.layers.values()))
    nb = layer.fmt.neuron_nbytes(layer.hidden_size)
    expected = sum(int(pack.plan.token_widths(lid, *trace.layer(lid)).sum()) for lid in pack.layers) * nb
    assert stats["bytes_routed"] == expected
    assert stats["bytes_routed"] / stats["tokens"] <= 0.56 * 2 * 2 * layer.intermediate_size * nb  # k * L * I * nb


def test_eval_bad_input(setup, tmp_path, capsys):
    _, model, held, out = setup
    assert ev.main(["--model", str(model), "--crisp", str(tmp_path / "none"), "--data", str(held)]) == 2
    assert "crisp-eval: error:" in capsys.readouterr().err
    assert ev.main(["--model", str(model), "--crisp", str(out), "--data", str(held), "--seq-len", "32",
                    "--samples", "100000"]) == 2
    assert "too little text" in capsys.readouterr().err


def test_decode_budget_below_one_tokens_experts_is_refused_before_the_model_loads(setup, tmp_path, capsys,
                                                                                    monkeypatch):
    _, model, held, out = setup
    monkeypatch.setattr(ev, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    path = tmp_path / "small.json"
    rc = ev.main(["--model", str(model), "--crisp", str(out), "--data", str(held), "--seq-len", "8", "--samples", "1",
                  "--mode", "decode", "--budgets", "0.5", "0.001", "--json", str(path), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("crisp-eval: error: --budgets 0.001: ") and err.count("\n") == 1, err
    assert "below one token's experts at full width" in err and "give at least" in err
    assert not path.exists()


def test_evidence_report_runs(setup, tmp_path, capsys):
    from crisp_tools import evidence

    _, model, held, out = setup
    path = tmp_path / "ev.json"
    rc = evidence.main(["--model", str(model), "--crisp", str(out), "--data", str(held), "--seq-len", "32",
                        "--samples", "12", "--top-pairs", "3", "--json", str(path), "--quiet", "--threads", "1"])
    assert rc == 0
    ev = json.loads(path.read_text())
    for layer in ev["skew"].values():
        assert 0.0 <= layer["bottom29_share"] <= layer["top25_share"] <= 1.0
    assert set(ev["uniform_50"]["all_layers"]) == {"hot", "medium", "cold"}
    assert len(ev["masking"]["combinations"]) <= 3
    assert "## 5. Dropping a whole expert" in capsys.readouterr().out


def test_bf16_checkpoint_profiles_in_its_dtype_and_evaluates_in_float32(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_mixtral(tmp_path / "fp32")
    bf16_dir = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(model_dir).to(torch.bfloat16).save_pretrained(bf16_dir)
    model, _ = load_model(bf16_dir, "cpu", "auto")
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16  # auto: the checkpoint's dtype
    text = write_text(tmp_path / "calib.txt")
    out = tmp_path / "pack"
    assert prof.main(["--model", str(bf16_dir), "--data", str(text), "--out", str(out), *PROFILE_ARGS]) == 0
    # The pack identifies the weights, not the dtype they were loaded in: bf16 -> float32 is exact.
    rc = ev.main(["--model", str(bf16_dir), "--crisp", str(out), "--data", str(text), "--seq-len", "32",
                  "--samples", "8", "--dtype", "float32", "--quiet", "--threads", "1"])
    assert rc == 0
    with pytest.raises(ev.CliError, match="--dtype"):
        load_model(bf16_dir, "cpu", "float64")


# ---------------------------------------------------------------- runtime in the loop (teacher-forced decode)


def _decode_setup(setup, samples=3, seq_len=24):
    from crisp_tools.calibration import load_texts

    _, model_dir, held, out = setup
    model, _ = load_model(model_dir)
    pack = load_pack(out)
    windows = contiguous_windows(load_texts([held]), samples, seq_len)
    return model, pack, windows


def test_decode_through_runtime_equals_batch_evaluation(setup):
    """Exact serving (the default policy) at a tight budget: the decode mode gives the batch figures."""
    from crisp_tools.serving_eval import ServingCase, run_case, total_expert_bytes

    model, pack, windows = _decode_setup(setup)
    with apply(model, pack, cpu="off"), record_routing(model) as trace:  # the device path, as the decode's
        batch = score_windows(model, windows)
    layer = next(iter(pack.layers.values()))
    n, length = windows.shape
    batch_bytes = 0  # the positions the decode feeds: all but each window's last
    for lid in pack.layers:
        index, weights = (x.view(n, length, -1)[:, :-1].reshape(n * (length - 1), -1) for x in trace.layer(lid))
        batch_bytes += int(pack.plan.token_widths(lid, index, weights).sum()) * layer.fmt.neuron_nbytes(
            layer.hidden_size)
    budget = int(0.25 * total_expert_bytes(pack.layers))
    decoded, stats = run_case(model, pack, pack.plan, windows, budget, ServingCase("crisp-exact"))
    # fp tolerance: one position at a time through the KV cache vs whole windows (other matmul shapes);
    # float32 logits of O(10) differ by ~1e-6, so 1e-4 in nll is two decades above that noise.
    assert decoded.nll.shape == batch.nll.shape
    assert torch.allclose(decoded.nll, batch.nll, atol=1e-4, rtol=0)
    assert torch.equal(decoded.correct, batch.correct)
    assert stats["bytes_routed"] == batch_bytes  # the same widths for the same tokens
    assert stats["bytes_h2d"] > 0 and stats["cache"]["budget_bytes"] == budget  # it really streamed


def test_decode_exact_serving_is_independent_of_the_budget(setup):
    from crisp_tools.serving_eval import ServingCase, run_case, total_expert_bytes

    model, pack, windows = _decode_setup(setup, samples=2, seq_len=16)
    total = total_expert_bytes(pack.layers)
    # this pack has 8 experts in all: 30% holds two full experts, the least a top-2 token needs
    tight, st_tight = run_case(model, pack, pack.plan, windows, int(0.3 * total), ServingCase("crisp-exact"))
    loose, st_loose = run_case(model, pack, pack.plan, windows, None, ServingCase("crisp-exact"))
    assert torch.equal(tight.nll, loose.nll)
    assert st_tight["bytes_h2d"] > st_loose["bytes_h2d"] == 0


def test_a_capped_plan_is_served_under_its_cap_and_recorded_with_it(setup):
    """CrispPlan.width_cap through the runtime: the decode equals the batch run of the same capped plan, no
    slot is served wider than the cap, and the record carries the cap (what the simulator matches)."""
    from crisp_tools.serving_eval import ServingCase, record, run_case, total_expert_bytes

    model, pack, windows = _decode_setup(setup, samples=2, seq_len=16)
    cap = pack.plan.intermediate_size * 3 // 4
    capped = pack.plan.capped(cap)
    with apply(model, pack, plan=capped, cpu="off"):  # the device path, as the decode's
        batch = score_windows(model, windows)
    case = ServingCase("crisp-exact")
    decoded, stats = run_case(model, pack, capped, windows, int(0.3 * total_expert_bytes(pack.layers)), case)
    assert torch.allclose(decoded.nll, batch.nll, atol=1e-4, rtol=0)  # the fp tolerance of the test above
    uncapped, _ = run_case(model, pack, pack.plan, windows, None, case)
    assert not torch.allclose(uncapped.nll, decoded.nll, atol=1e-4, rtol=0)  # the cap changed what ran
    assert stats["served_dominant_neurons"] == cap * stats["served_dominant_slots"]  # every dominant at the cap
    rec = record(case, 0.3, 1, decoded, stats, uncapped, capped, 1.0)
    assert rec["plan_detail"]["width_cap"] == cap
    assert "width_cap" not in record(case, 0.3, 1, uncapped, stats, uncapped, pack.plan, 1.0)["plan_detail"]


@pytest.mark.parametrize("banded", [False, True], ids=["promoted", "three_band"])
def test_a_weight_promoted_plan_decodes_as_its_batch_run_and_is_recorded_with_it(setup, banded):
    """CrispPlan.aux_full_weight (and aux_skip_weight) through the runtime: the decode equals the batch run of the
    same plan, the heavy auxiliaries widen what is served (the light ones are skipped), and the record carries the
    thresholds (what the simulator matches)."""
    from crisp_tools.serving_eval import ServingCase, record, run_case, total_expert_bytes

    model, pack, windows = _decode_setup(setup, samples=2, seq_len=16)
    promoted = pack.plan.promoted(0.3)
    if banded:
        promoted = promoted.skipping(0.3)  # = skip-aux at 0.3: every auxiliary lighter than 0.3 skipped
    with apply(model, pack, plan=promoted, cpu="off"):  # the device path, as the decode's
        batch = score_windows(model, windows)
    case = ServingCase("crisp-exact")
    budget = int(0.3 * total_expert_bytes(pack.layers))
    decoded, stats = run_case(model, pack, promoted, windows, budget, case)
    assert torch.allclose(decoded.nll, batch.nll, atol=1e-4, rtol=0)  # the fp tolerance of the tests above
    plain, plain_stats = run_case(model, pack, pack.plan, windows, budget, case)
    if banded:  # light auxiliaries skipped, whatever their tier
        only_promoted, only_stats = run_case(model, pack, pack.plan.promoted(0.3), windows, budget, case)
        assert stats["skipped"] > only_stats["skipped"]
        assert not torch.equal(decoded.nll, only_promoted.nll)
    else:
        assert stats["bytes_routed"] > plain_stats["bytes_routed"]  # heavy auxiliaries ran wider than their tiers
    rec = record(case, 0.3, 1, decoded, stats, plain, promoted, 1.0)
    assert rec["plan_detail"]["aux_full_weight"] == 0.3
    assert rec["plan_detail"].get("aux_skip_weight") == (0.3 if banded else None)
    assert "aux_full_weight" not in record(case, 0.3, 1, plain, plain_stats, plain, pack.plan, 1.0)["plan_detail"]


def test_serving_sweep_records(setup, tmp_path):
    from crisp_tools.serving_eval import ServingCase, serving_sweep, write_serving_json

    model, pack, windows = _decode_setup(setup, samples=2, seq_len=16)
    cases = [ServingCase("crisp-exact"), ServingCase("uniform-exact", "uniform"),
             ServingCase("skip_aux-exact", "skip_aux")]
    records, meta = serving_sweep(model, pack, windows, [0.3, 0.5], cases)
    assert [(r["policy"], r["budget_fraction"]) for r in records] == [
        ("full-exact", 0.5), ("crisp-exact", 0.3), ("crisp-exact", 0.5), ("uniform-exact", 0.5),
        ("skip_aux-exact", 0.5)]
    by = {(r["policy"], r["budget_fraction"]): r for r in records}
    full_acc = by[("full-exact", 0.5)]["accuracy"]
    assert by[("full-exact", 0.5)]["accuracy_loss"] == (0.0 if full_acc else None)
    assert by[("crisp-exact", 0.3)]["accuracy"] == by[("crisp-exact", 0.5)]["accuracy"]
    assert by[("crisp-exact", 0.3)]["bytes_h2d_per_token"] >= by[("crisp-exact", 0.5)]["bytes_h2d_per_token"]
    crisp_bpt = by[("crisp-exact", 0.3)]["bytes_routed_per_token"]
    full_bpt = by[("full-exact", 0.5)]["bytes_routed_per_token"]
    assert crisp_bpt < full_bpt
    # uniform matched to CRISP's bytes on the same tokens: within half a width step (top_k x layers neurons)
    step = full_bpt / pack.plan.intermediate_size
    assert abs(by[("uniform-exact", 0.5)]["bytes_routed_per_token"] - crisp_bpt) <= step / 2 + 1e-6
    for r in records:
        assert r["tokens_evaluated"] == meta["tokens_evaluated"] == 2 * 15
        assert r["serving"]["exact"] is True
    path = tmp_path / "serving.json"
    write_serving_json(path, records, {"model": "m", **meta})
    doc = json.loads(path.read_text())
    assert doc["format"] == "crisp-eval-serving" and len(doc["records"]) == 5


def test_decode_mode_cli(setup, tmp_path, capsys):
    _, model, held, out = setup
    path = tmp_path / "serving.json"
    rc = ev.main(["--model", str(model), "--crisp", str(out), "--data", str(held), "--seq-len", "8", "--samples", "1",
                  "--mode", "decode", "--budgets", "0.5", "--json", str(path), "--quiet", "--threads", "1"])
    assert rc == 0
    doc = json.loads(path.read_text())
    assert doc["format"] == "crisp-eval-serving" and doc["windows"] == [1, 8]
    names = [r["policy"] for r in doc["records"]]
    assert names[:4] == ["full-exact", "crisp-exact", "uniform-exact", "skip_aux-exact"]
    resident = [r for r in doc["records"] if r["policy"].startswith("crisp-resident")]
    assert sorted({r["serving"]["dominant_floor"] for r in resident}) == [0.625, 0.75, 1.0]
    assert all(not r["serving"]["exact"] and r["budget_fraction"] == 0.5 for r in resident)
    assert sum(r["prefetch"] is not None for r in resident) == 3
    assert "crisp-resident-floor0.75+prefetch" in capsys.readouterr().out


def test_stored_serving_decodes_the_packs_choice_at_its_budget(setup, tmp_path, capsys):
    """--stored-serving: the serving choice a throughput search stored in pack.json (policy, prefetch, eviction,
    budget) is the one case decoded, with the pack's plan (here weight-promoted), and it equals run_case with that
    record; a pack storing none, batch mode and batch-mode --budgets are refused."""
    from crisp_tools.calibration import load_pack_dir, load_texts
    from crisp_tools.serving_eval import ServingCase, run_case, total_expert_bytes

    from crisp_runtime.planning.serving import SERVING_POLICIES
    from crisp_runtime.scheduling.prefetch import PrefetchPolicy
    from crisp_runtime.storage.pack import save_pack
    from crisp_runtime.storage.serving_record import ServingRecord

    root, model_dir, held, out = setup
    layers, plan, _ = load_pack_dir(out)
    stored = ServingRecord(SERVING_POLICIES["resident-floor75-ahead"], PrefetchPolicy(width="serving"), "next_use",
                           0.3, {"accuracy_prefetch_window": "rtx4090-pcie4/mixtral-8x7b"})
    packed = save_pack(tmp_path / "searched", layers, plan=plan.promoted(0.3), info={"serving": stored.to_dict()})
    base = ["--model", str(model_dir), "--crisp", str(packed), "--data", str(held), "--seq-len", "12",
            "--samples", "2", "--threads", "1"]
    path = tmp_path / "stored.json"
    assert ev.main([*base, "--mode", "decode", "--stored-serving", "--json", str(path)]) == 0
    assert "measured its accuracy with the prefetch window rtx4090-pcie4/mixtral-8x7b" in capsys.readouterr().err
    doc = json.loads(path.read_text())
    assert [r["policy"] for r in doc["records"]] == ["full-exact", "crisp-stored-resident-floor75-ahead+prefetch"]
    got = doc["records"][1]
    assert got["budget_fraction"] == 0.3 and got["eviction"] == "next_use"
    assert got["serving"]["dominant_widen"] == "ahead" and got["prefetch"]["width"] == "serving"
    assert got["plan_detail"]["aux_full_weight"] == 0.3
    model, _ = load_model(model_dir)
    pack = load_pack(packed)
    windows = contiguous_windows(load_texts([held]), 2, 12)
    case = ServingCase("direct", "crisp", stored.policy, stored.prefetch, eviction="next_use")
    scores, stats = run_case(model, pack, pack.plan, windows, int(0.3 * total_expert_bytes(pack.layers)), case)
    assert got["accuracy"] == pytest.approx(scores.accuracy, abs=0) and got["bytes_h2d_per_token"] == pytest.approx(
        stats["bytes_h2d"] / stats["tokens"])
    # --budgets overrides the stored budget
    path2 = tmp_path / "stored-05.json"
    assert ev.main([*base, "--mode", "decode", "--stored-serving", "--budgets", "0.5", "--json", str(path2),
                    "--quiet"]) == 0
    assert json.loads(path2.read_text())["records"][1]["budget_fraction"] == 0.5
    capsys.readouterr()
    assert ev.main([*base, "--stored-serving"]) == 2
    assert "--stored-serving: only with --mode decode" in capsys.readouterr().err
    assert ev.main([*base, "--budgets", "0.5"]) == 2
    assert "--budgets: only with --mode decode" in capsys.readouterr().err
    plain = [*base[:3], str(out), *base[4:]]
    assert ev.main([*plain, "--mode", "decode", "--stored-serving", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--stored-serving" in err and "stores no serving choice" in err and len(err.strip().splitlines()) == 1
    info = json.loads((packed / "pack.json").read_text())  # a hand-edited stored choice is refused, named
    info["serving"]["eviction"] = "fifo"
    (packed / "pack.json").write_text(json.dumps(info))
    assert ev.main([*base, "--mode", "decode", "--stored-serving", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--stored-serving" in err and "eviction" in err and len(err.strip().splitlines()) == 1


def test_default_serving_decodes_what_apply_runs_with_only_a_budget(setup, tmp_path, capsys):
    """--default-serving: one case per budget, the configuration crisp_runtime.planning.defaults chooses for the
    pack (here the default rule: no stored choice), equal to run_case with that configuration; a stored choice for
    a budget wins at it; refused in batch mode and beside --stored-serving."""
    from crisp_tools.calibration import load_pack_dir, load_texts
    from crisp_tools.serving_eval import ServingCase, run_case, total_expert_bytes

    from crisp_runtime.planning.defaults import ChoiceSource, choose_serving, pack_facts
    from crisp_runtime.planning.serving import SERVING_POLICIES
    from crisp_runtime.storage.pack import save_pack
    from crisp_runtime.storage.serving_record import ServingRecord

    root, model_dir, held, out = setup
    base = ["--model", str(model_dir), "--data", str(held), "--seq-len", "12", "--samples", "2", "--threads", "1"]
    path = tmp_path / "default.json"
    assert ev.main([*base, "--crisp", str(out), "--mode", "decode", "--default-serving", "--budgets", "0.3", "0.6",
                    "--json", str(path), "--quiet"]) == 0
    doc = json.loads(path.read_text())
    layers, plan, info = load_pack_dir(out)
    choice = choose_serving(info, pack_facts(info, plan, plan.top_k), 0.3)
    assert choice.source is ChoiceSource.DEFAULT_RULE
    want = f"crisp-default-{choice.config.serving.name}" + ("+prefetch" if choice.config.prefetch else "")
    got = [r for r in doc["records"] if r["policy"] == want]
    assert [r["budget_fraction"] for r in got] == [0.3, 0.6]
    pack = load_pack(out)
    windows = contiguous_windows(load_texts([held]), 2, 12)
    model, _ = load_model(model_dir)
    case = ServingCase("direct", "crisp", choice.config.serving, choice.config.prefetch,
                       eviction=choice.config.eviction)
    scores, _ = run_case(model, pack, pack.plan, windows, int(0.3 * total_expert_bytes(pack.layers)), case)
    assert got[0]["accuracy"] == pytest.approx(scores.accuracy, abs=0)
    # a pack storing a choice for 0.5: the default runs it from 0.5 up, the rule below
    stored = ServingRecord(SERVING_POLICIES["resident-floor75"], None, "lru", 0.5, {})
    packed = save_pack(tmp_path / "stored", layers, plan=plan, info={"serving": stored.to_dict()})
    path2 = tmp_path / "default-stored.json"
    assert ev.main([*base, "--crisp", str(packed), "--mode", "decode", "--default-serving", "--budgets", "0.3",
                    "0.6", "--json", str(path2), "--quiet"]) == 0
    names = {r["budget_fraction"]: r["policy"] for r in json.loads(path2.read_text())["records"]
             if r["policy"].startswith("crisp-default")}
    assert names == {0.3: want, 0.6: "crisp-default-resident-floor75"}
    capsys.readouterr()
    assert ev.main([*base, "--crisp", str(out), "--default-serving"]) == 2
    assert "--default-serving: only with --mode decode" in capsys.readouterr().err
    assert ev.main([*base, "--crisp", str(packed), "--mode", "decode", "--default-serving", "--stored-serving"]) == 2
    assert "--default-serving" in capsys.readouterr().err


def test_decode_mode_cli_with_prefetch_window(setup, tmp_path, capsys):
    """--prefetch-window: every prefetching case decodes with the window of the profile timing the target's rows
    (named "+window", the window in its record and the meta), the others as without it."""
    from crisp_bench.profiles import get_profile
    from crisp_bench.shapes import TARGETS

    _, model, held, out = setup
    path = tmp_path / "window.json"
    base = ["--model", str(model), "--crisp", str(out), "--data", str(held), "--seq-len", "8", "--samples", "1",
            "--quiet", "--threads", "1"]
    rc = ev.main([*base, "--mode", "decode", "--budgets", "0.5", "--json", str(path), "--prefetch-window",
                  "rtx4090-pcie4", "--target", "mixtral-8x7b"])
    assert rc == 0
    doc = json.loads(path.read_text())
    shape = TARGETS["mixtral-8x7b"]
    expected = get_profile("rtx4090-pcie4").prefetch_window(
        shape.neuron_nbytes * shape.intermediate_size // load_pack(out).plan.intermediate_size,
        "rtx4090-pcie4/mixtral-8x7b").to_dict()
    assert doc["prefetch_window"] == expected
    fetching = [r for r in doc["records"] if r["prefetch"] is not None]
    assert len(fetching) == 3 and all(r["policy"].endswith("+prefetch+window") for r in fetching)
    assert all(r["prefetch"]["window"] == expected and "prefetch_cut" in r["prefetch_stats"] for r in fetching)
    assert all("+window" not in r["policy"] for r in doc["records"] if r["prefetch"] is None)
    capsys.readouterr()
    # only with --mode decode; a profile file that is not there is named with the option
    assert ev.main([*base, "--prefetch-window", "rtx4090-pcie4"]) == 2
    assert "--prefetch-window: only with --mode decode" in capsys.readouterr().err
    assert ev.main([*base, "--mode", "decode", "--prefetch-window", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert "--prefetch-window" in err and "no such profile file" in err and len(err.strip().splitlines()) == 1


def test_verdict_is_unknown_not_met_when_full_width_scores_zero():
    from crisp_tools.evaluate import verdict

    def rec(policy, acc, frac, loss):
        return {"policy": policy, "accuracy": acc, "bytes_fraction_of_full": frac,
                "relative_accuracy_loss_vs_full": loss}

    records = [rec("full", 0.0, 1.0, None), rec("crisp", 0.0, 0.54, None), rec("uniform", 0.0, 0.54, None),
               rec("skip_aux", 0.0, 0.54, None)]
    v = verdict(records)
    assert v["accuracy_target_met"] is None and v["bytes_target_met"] is True
    records[1]["relative_accuracy_loss_vs_full"] = 0.05
    assert verdict(records)["accuracy_target_met"] is False


@pytest.mark.parametrize("kind", ["skip_aux", "uniform"])
def test_a_baseline_pack_plan_is_evaluated_as_the_pack_plan(setup, tmp_path, capsys, kind):
    """A profiler search may store a baseline as the pack's plan: crisp-eval evaluates it as the pack plan, says which
    kind it is, and its matched baseline of the same kind is the same width (uniform: paired difference 0) or a
    threshold matched on the full-width routing to the bytes the plan ran (skip-aux: within 1% of the full width's
    bytes and one paired standard error); the CRISP-only frontier rows (cap, promoted auxiliaries) are left out."""
    from crisp_runtime.planning.plan import CrispPlan
    _, model, held, out = setup
    pack = load_pack(out)
    p = pack.plan
    base = (CrispPlan.skip_aux(p.num_experts, p.top_k, p.intermediate_size, p.layer_ids, threshold=0.3)
            if kind == "skip_aux" else
            CrispPlan.uniform(p.num_experts, p.top_k, p.intermediate_size, p.layer_ids, p.intermediate_size // 2))
    folder = tmp_path / "baseline-pack"
    from crisp_runtime.storage.pack import FILES_KEY, save_pack

    reserved = ("format", "version", "quant", FILES_KEY)
    save_pack(folder, pack.layers, plan=base, info={k: v for k, v in pack.info.items() if k not in reserved})
    path = tmp_path / "eval.json"
    assert ev.main(["--model", str(model), "--crisp", str(folder), "--data", str(held), "--seq-len", "32",
                    "--samples", "24", "--json", str(path), "--frontier", "--threads", "1"]) == 0
    assert f"The pack plan ({kind}) ahead of {kind} at equal bytes:" in capsys.readouterr().out
    records = json.loads(path.read_text())["records"]
    (own,) = (r for r in records if r["policy"] == "crisp")
    assert own["label"] == f"{kind} (pack plan)"
    (matched,) = (r for r in records if r["policy"] == kind and "frontier" not in r["label"])
    if kind == "uniform":
        assert own["advantage_vs_uniform"] == 0.0 and matched["bytes_per_token"] == own["bytes_per_token"]
        assert matched["loss"] == own["loss"]
    else:
        assert abs(matched["bytes_fraction_of_full"] - own["bytes_fraction_of_full"]) < 0.01
        assert abs(own["advantage_vs_skip_aux"]) <= (own["advantage_vs_skip_aux_se"] or 0.0)
    assert not any("width_cap" in r or "aux_full_weight" in r for r in records)


class _FakeScores:
    """What equal_bytes_baseline reads of a run's TokenScores: per-position nll and hits."""

    def __init__(self, hits: float):
        self.nll = torch.full((2, 3), 1.0 - hits)
        self.correct = torch.full((2, 3), hits)
        self.accuracy = hits


def _bracket_case(kind, bytes_of, target_bpt, runs_allowed=3):
    """equal_bytes_baseline over a synthetic family: a plan's bytes per token come from ``bytes_of(knob)``
    (drift included), its accuracy is bytes / 1000; matching uses the real equal_bytes_plans."""
    from types import SimpleNamespace

    from crisp_runtime.planning.plan import CrispPlan

    plan = CrispPlan.full(4, 2, 10, (0,))
    # routing: 5 tokens, top-2 of 4 experts, auxiliary weights 0.1 .. 0.5 (distinct), one layer
    index = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]])
    weights = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])
    routing = {0: (index, weights)}
    made = []

    def run(p):
        knob = p.uniform_width if kind == "uniform" else p.skip_threshold
        made.append(knob)
        b = bytes_of(knob)
        return _FakeScores(b / 1000), b

    this = SimpleNamespace(plan=CrispPlan.skip_aux(4, 2, 10, (0,), threshold=0.3, num_dominant=1)
                           if kind == "skip_aux" else plan, neuron_bytes=1.0, full_bpt=20.0,
                           log=lambda *a: None, BRACKET_RUNS=runs_allowed)
    matched = ev.equal_bytes_plans(this.plan, routing, target=target_bpt)[kind]
    first = run(matched)
    scores, detail = ev.Evaluator.equal_bytes_baseline(this, run, kind, routing, matched, first, target_bpt)
    return scores, detail, made


@pytest.mark.parametrize("target", [11.0, 12.5, 14.9, 15.0, 17.2])
def test_equal_bytes_uniform_brackets_and_interpolates(target):
    """Uniform width w reads 2 w neurons per token (top-2): the two widths around the target are run and mixed so
    that the mixed bytes equal the target; the mixed accuracy is the same mix (linear in bytes here)."""
    scores, detail, made = _bracket_case("uniform", lambda w: 2.0 * w, target)
    assert detail["interpolated"]
    lo, hi = detail["below"]["bytes_per_token"], detail["above"]["bytes_per_token"]
    assert lo <= target <= hi and hi - lo <= 2.0
    assert float(scores.correct.double().mean()) == pytest.approx(target / 1000)
    assert len(made) == len(set(made))  # never the same width twice


def test_equal_bytes_skip_aux_corrects_drift():
    """Runs reading 6 neurons per token more than predicted on the full-width routing (routing moved downstream):
    the partner is aimed past the target by the drift, so one extra run brackets it (aimed without the drift
    correction it would land at 18 > 17, above again, and take a second)."""
    def measured(threshold):  # kept auxiliary slots of weights 0.1 .. 0.5 (10 neurons each), 1 dominant, + 6
        kept = sum(1 for w in (0.1, 0.2, 0.3, 0.4, 0.5) if threshold is not None and w >= threshold)
        return (5 * 10 + kept * 10) / 5 + 6.0

    target = 17.0
    scores, detail, made = _bracket_case("skip_aux", measured, target)
    assert detail["interpolated"] and len(made) == 2
    assert detail["below"]["bytes_per_token"] <= target <= detail["above"]["bytes_per_token"]
    w, lo, hi = detail["weight_below"], detail["below"]["bytes_per_token"], detail["above"]["bytes_per_token"]
    assert w * lo + (1 - w) * hi == pytest.approx(target)


def test_equal_bytes_without_a_bracket_reports_the_nearest():
    """A family that cannot reach the target (every width reads more) ends with the nearest run, said so."""
    scores, detail, made = _bracket_case("uniform", lambda w: 100.0 + w, 12.0, runs_allowed=2)
    assert not detail["interpolated"]
    assert detail["bytes_per_token"] == min(r["bytes_per_token"] for r in detail["runs"])
    assert len(made) <= 3
