"""crisp_tools.tail_pack end to end on the tiny trained Mixtral: a real 2-bit tail pack, what crisp-eval measures
on it (batch, --frontier, --mode decode against the 4-bit reference) and how the simulator reads that."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from crisp_bench.sim_policies import PROMOTE_WEIGHTS
from crisp_tools import evaluate
from crisp_tools import tail_pack as tp

from crisp_kernels.format import layer_neuron_rows, rows_for_neurons
from crisp_runtime.planning.plan import TierWidths
from crisp_runtime.storage.pack import load_pack

ROOT = Path(__file__).resolve().parents[1]
TINY, TINY_PACK = ROOT / "models" / "tiny-mixtral", ROOT / "models" / "tiny-mixtral-crisp"
HELDOUT = str(ROOT / "data" / "stdlib-heldout.txt")


@pytest.fixture(scope="module")
def tail(tmp_path_factory):
    out = tmp_path_factory.mktemp("tailpack") / "t"
    assert tp.main(["--model", str(TINY), "--crisp", str(TINY_PACK), "--layout", "2g128@0.25", "--out", str(out),
                    "--tier-widths", "256,64,32", "--quiet"]) == 0
    return out


def test_the_tail_pack_keeps_the_head_and_stores_the_tail_at_2_bits(tail):
    src, pack = load_pack(TINY_PACK), load_pack(tail)
    assert pack.info["tail_layout"]["segments"] == [[0.25, 2, 128]]
    assert pack.info["tail_pack"]["source_pack"] == str(TINY_PACK) and pack.info["tail_pack"]["tail_start_neuron"] == 64
    assert pack.plan.tier_widths == TierWidths(256, 64, 32) and pack.plan.intermediate_size == 256  # neurons
    for lid, layer in pack.layers.items():
        ref = src.layers[lid]
        assert layer.tail_start == 64 and layer.intermediate_size == rows_for_neurons(256, 64) == 160
        assert torch.equal(layer.qweight[:, :64], ref.qweight[:, :64])
        assert torch.equal(layer.neuron_order, ref.neuron_order)
        assert layer.nbytes() / ref.nbytes() == 0.625
        # the tail is close to the 4-bit values: a 2-bit grid of the same weights, not noise
        a, b = layer_neuron_rows(layer)[:, 64:], layer_neuron_rows(ref)[:, 64:]
        assert 0 < float((a - b).square().mean() / b.square().mean()) < 0.25
    assert pack.plan.description.endswith("Then --tier-widths 256,64,32 (crisp_tools.tail_pack / tail_emulation).")


def test_layouts_a_pack_cannot_store_are_refused(tail, tmp_path, capsys):
    base = ["--model", str(TINY), "--crisp", str(TINY_PACK), "--quiet"]
    for layout, message in (("m432", "simulated and emulated only"), ("2g64@0.25", "simulated and emulated only"),
                            ("q4", "the 4-bit pack itself")):
        assert tp.main([*base, "--layout", layout, "--out", str(tmp_path / layout)]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / layout).exists()
    before = sorted(p.name for p in tail.iterdir())
    assert tp.main([*base, "--layout", "2g128@0.5", "--out", str(tail)]) == 2
    assert "already exists" in capsys.readouterr().err and sorted(p.name for p in tail.iterdir()) == before
    assert tp.main(["--model", str(TINY), "--crisp", str(tail), "--layout", "2g128@0.5", "--out",
                    str(tmp_path / "twice"), "--quiet"]) == 2
    assert "already a tail layout" in capsys.readouterr().err
    assert tp.main([*base, "--layout", "2g128@0.5", "--out", str(tmp_path / "w"), "--tier-widths", "256,300,0"]) == 2
    assert "--tier-widths" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_layout_that_leaves_no_neuron_at_2_bits_is_refused(tmp_path, capsys):
    # I=256: 2g128@0.999 starts its 2-bit rows at round(255.7) = 256, so every neuron would stay 4-bit
    from crisp_tools.tail_emulation import layout_arg

    assert tp.storable_tail_start(layout_arg("2g128@0.99"), 64, 256) == 253
    assert tp.storable_tail_start(layout_arg("2g128@0"), 64, 256) == 0
    with pytest.raises(ValueError, match="no neuron of I=256 is left for the 2-bit tail at 0.999"):
        tp.storable_tail_start(layout_arg("2g128@0.999"), 64, 256)
    out = tmp_path / "t"
    assert tp.main(["--model", str(TINY), "--crisp", str(TINY_PACK), "--layout", "2g128@0.999", "--out", str(out),
                    "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tail-pack: error: --layout 2g128at0.999: ") and len(err.splitlines()) == 1
    assert "no neuron of I=256 is left for the 2-bit tail at 0.999" in err and not out.exists()


def _same_widths(plan, want) -> bool:
    """The same plan but for its description (a derived pack's says what replaced the source's widths)."""
    from dataclasses import replace

    return replace(plan, description=want.description) == want


def test_a_tail_pack_stores_a_plan_with_an_auxiliary_weight(tmp_path):
    out = tmp_path / "w"
    assert tp.main(["--model", str(TINY), "--crisp", str(TINY_PACK), "--layout", "2g128@0.25", "--out", str(out),
                    "--aux-full-weight", "0.3", "--quiet"]) == 0
    pack, src = load_pack(out), load_pack(TINY_PACK)
    assert _same_widths(pack.plan, src.plan.promoted(0.3)) and pack.info["tail_pack"]["aux_full_weight"] == 0.3
    assert "aux_skip_weight" not in pack.info["tail_pack"]
    assert pack.plan.description.endswith("Then --aux-full-weight 0.3 (crisp_tools.tail_pack / tail_emulation).")


def test_a_tail_pack_stores_a_three_band_plan_and_refuses_crossed_thresholds(tmp_path, capsys):
    base = ["--model", str(TINY), "--crisp", str(TINY_PACK), "--layout", "2g128@0.25", "--quiet"]
    out = tmp_path / "banded"
    assert tp.main([*base, "--out", str(out), "--aux-full-weight", "0.4", "--aux-skip-weight", "0.2"]) == 0
    pack, src = load_pack(out), load_pack(TINY_PACK)
    assert _same_widths(pack.plan, src.plan.promoted(0.4).skipping(0.2))
    assert pack.info["tail_pack"]["aux_skip_weight"] == 0.2
    # crisp-eval's row of the pack plan carries its thresholds (what a simulation of that plan is matched by)
    path = tmp_path / "banded.json"
    assert evaluate.main(["--model", str(TINY), "--crisp", str(out), "--data", HELDOUT, "--samples", "2",
                          "--seq-len", "24", "--quiet", "--threads", "1", "--reference-crisp", str(TINY_PACK),
                          "--json", str(path)]) == 0
    row = next(r for r in json.loads(path.read_text())["records"] if r["policy"] == "crisp")
    assert (row["aux_full_weight"], row["aux_skip_weight"], row.get("width_cap")) == (0.4, 0.2, None)
    crossed = tmp_path / "crossed"
    assert tp.main([*base, "--out", str(crossed), "--aux-full-weight", "0.3", "--aux-skip-weight", "0.35"]) == 2
    assert "--aux-skip-weight" in capsys.readouterr().err and not crossed.exists()


def test_an_interrupted_tail_pack_leaves_nothing(tmp_path, monkeypatch, capsys):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tp, "with_tail", interrupt)
    out = tmp_path / "out"
    assert tp.main(["--model", str(TINY), "--crisp", str(TINY_PACK), "--layout", "2g128@0.25", "--out", str(out),
                    "--quiet"]) == 130
    assert "interrupted" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_eval_of_a_tail_pack_batch_and_frontier(tail, tmp_path, capsys):
    base = ["--model", str(TINY), "--crisp", str(tail), "--data", HELDOUT, "--samples", "2", "--seq-len", "24",
            "--quiet", "--threads", "1"]
    assert evaluate.main([*base, "--engine", "reference", "--reference-crisp", str(TINY_PACK)]) == 2
    assert "--engine runtime" in capsys.readouterr().err
    assert evaluate.main([*base, "--frontier", "--mode", "decode", "--reference-crisp", str(TINY_PACK)]) == 2
    assert "--frontier: batch mode only" in capsys.readouterr().err
    path = tmp_path / "t.json"
    assert evaluate.main([*base, "--reference-crisp", str(TINY_PACK), "--frontier", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["tail_layout"] == "2g128at0.25"
    assert doc["plan_widths_sha256"] == load_pack(tail).plan.widths_digest()  # the plan in neurons
    recs = doc["records"]
    by = {}
    for r in recs:
        by.setdefault(r["policy"], r)
    full_4bit = by["full"]["bytes_per_token"]
    assert by["full_layout"]["bytes_per_token"] == 0.625 * full_4bit  # its own bytes
    assert "its own bytes" in by["full_layout"]["label"]
    uniforms = [r for r in recs if r["policy"] == "uniform"]
    skips = [r for r in recs if r["policy"] == "skip_aux"]
    # --frontier: the simulator's knob values (96, 128, 160, 192 neurons; thresholds 0.2, 0.3, 0.4) beside the
    # matched ones; widths in neurons, each even (whole storage rows), bytes = the layout's
    assert {96, 128, 160, 192} <= {r["uniform_width"] for r in uniforms}
    assert {0.2, 0.3, 0.4} <= {r["skip_threshold"] for r in skips}
    for r in uniforms:
        rows = rows_for_neurons(r["uniform_width"], 64)
        assert r["bytes_per_token"] == pytest.approx(full_4bit * rows / 256)
    assert by["uniform"] is uniforms[0] and "storage rows" in uniforms[0]["label"]  # the matched one first
    # capped CRISP (neurons recorded; the cap in rows clips the pack plan's widths, so never more bytes)
    capped = {r["width_cap"]: r for r in recs if r["policy"] == "crisp" and "width_cap" in r}
    assert sorted(capped) == [192, 224] and by["crisp"].get("width_cap") is None
    assert capped[192]["bytes_per_token"] <= capped[224]["bytes_per_token"] <= by["crisp"]["bytes_per_token"]
    assert capped[192]["bytes_per_token"] <= full_4bit * rows_for_neurons(192, 64) / 256
    # weight-promoted CRISP at the simulator's weights: a higher weight promotes fewer auxiliaries, never fewer
    # bytes than the tiers alone
    promoted = [r for r in recs if r["policy"] == "crisp" and "aux_full_weight" in r]
    assert [r["aux_full_weight"] for r in promoted] == list(PROMOTE_WEIGHTS)
    bpt = [r["bytes_per_token"] for r in promoted]
    assert bpt == sorted(bpt, reverse=True) and bpt[0] > by["crisp"]["bytes_per_token"]
    assert all(b >= by["crisp"]["bytes_per_token"] for b in bpt)


def test_decode_of_a_tail_pack_against_its_4bit_reference(tail, tmp_path):
    base = ["--model", str(TINY), "--crisp", str(tail), "--data", HELDOUT, "--samples", "1", "--seq-len", "12",
            "--quiet", "--threads", "1", "--mode", "decode", "--budgets", "0.25"]
    path = tmp_path / "d.json"
    assert evaluate.main([*base, "--reference-crisp", str(TINY_PACK), "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["tail_layout"] == "2g128at0.25" and doc["reference_crisp"] == str(TINY_PACK)
    src = load_pack(TINY_PACK)
    total_4bit = sum(layer.nbytes() for layer in src.layers.values())
    assert doc["total_expert_bytes"] == total_4bit  # budgets are fractions of the 4-bit bytes (equal memory)
    recs = {r["policy"]: r for r in doc["records"]}
    assert recs["full-exact"]["accuracy_loss"] == 0.0 and recs["full-exact"]["budget_bytes"] == int(0.25 * total_4bit)
    assert "full_layout-exact" in recs and recs["crisp-exact"]["budget_fraction"] == 0.25
    # the reference is the 4-bit pack: decoding the 4-bit pack itself gives the same full width
    plain = tmp_path / "p.json"
    assert evaluate.main([*base[:3], str(TINY_PACK), *base[4:], "--json", str(plain)]) == 0
    ref = {r["policy"]: r for r in json.loads(plain.read_text())["records"]}
    assert recs["full-exact"]["perplexity"] == pytest.approx(ref["full-exact"]["perplexity"], rel=1e-9)
    # the simulator reads the layout's own full width as "full", never the 4-bit reference
    from crisp_bench.sim_policies import read_accuracy

    rows, _ = read_accuracy([path], "tiny-mixtral")
    fulls = [r for r in rows if r["family"] == "full"]
    assert len(fulls) == 1 and fulls[0]["tail_layout"] == "2g128at0.25"
    assert fulls[0]["accuracy_loss"] == pytest.approx(recs["full_layout-exact"]["accuracy_loss"])


def test_the_window_of_a_tail_pack_counts_its_rows():
    from crisp_bench.profiles import get_profile
    from crisp_bench.shapes import TARGETS
    from crisp_bench.simulate import target_window
    from crisp_bench.tail_sim import mapped_target

    from crisp_kernels.tail_layout import parse_tail_layout

    shape = mapped_target(parse_tail_layout("2g128@0.25"), TARGETS["mixtral-8x7b"])
    assert shape.intermediate_size == rows_for_neurons(14336, 3584) == 8960
    window = target_window(get_profile("rtx4090-pcie4"), shape, 160)
    assert window.row_nbytes == 56 * TARGETS["mixtral-8x7b"].neuron_nbytes  # 8,960 / 160 target rows per row


def test_the_simulator_refuses_a_tail_pack_at_another_layout(tail, capsys):
    from crisp_bench import cli as bench_cli

    base = ["simulate", "--trace", str(ROOT / "bench" / "traces" / "heldout-predicted.npz"), "--plan", str(tail),
            "--policies", "full,crisp", "--tokens", "40", "--warmup", "4"]
    for layout in ([], ["--tail-layout", "2g128@0.5"], ["--tail-layout", "m432"]):
        assert bench_cli.main([*base, *layout]) == 2
        assert "simulate it with --tail-layout 2g128@0.25" in capsys.readouterr().err
    assert bench_cli.main([*base, "--tail-layout", "2g128@0.25"]) == 0


def test_load_model_serves_a_tail_pack_with_its_plan_in_neurons(tail):
    from crisp_runtime.hf.dropin import load_model

    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 8, 250]])
    logits = []
    for budget in (None, 200_000):  # all resident, and offloaded: the plan's widths either way (exact serving)
        model, handle = load_model(TINY, tail, gpu_budget=budget, serving="paper")  # the paper: exact serving
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
        assert handle.runtime.plan.intermediate_size == 160  # the pack's plan (256 neurons) in storage rows
        if budget is not None:
            stats = handle.stats()
            assert stats["bytes_h2d"] > 0 and stats["bytes_h2d"] % load_pack(tail).layers[0].neuron_nbytes == 0
        handle.runtime.close()  # load_model keeps no original experts to restore
    assert torch.isfinite(logits[0]).all()
    assert torch.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("floor", [0.875, 0.625, 0.375, 0.25, 0.1])
def test_a_dominant_floor_counts_neurons_on_a_tail_pack(tail, floor):
    """The floor is a fraction of the neurons on a tail pack too (the simulator's mapping): 87.5% of 256 neurons is
    224 = 64 4-bit rows + 80 rows of two 2-bit neurons, 144 of 160 rows (the runtime took 140 rows before
    the simulator's unit). A missed dominant loads exactly those rows."""
    import math

    from crisp_runtime.hf.dropin import load_model
    from crisp_runtime.planning.serving import resident_policy

    model, handle = load_model(TINY, tail, gpu_budget=200_000, serving=resident_policy(floor))
    runtime = handle.runtime
    try:
        want = rows_for_neurons(math.ceil(floor * 256), 64)
        assert runtime.serving.dominant_floor == floor  # reported as configured
        assert runtime.step_serving.floor_width(160, 160) == want
        served, _ = runtime.plan_served(0, torch.tensor([[3, 5]]), torch.tensor([[0.7, 0.3]]))
        assert served.slot_widths.values()[0] == want  # the dominant, missed: its floor in rows
    finally:
        runtime.close()
