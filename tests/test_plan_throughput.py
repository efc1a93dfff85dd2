"""python -m crisp_tools.plan_throughput: the throughput search on an existing pack (a 4-bit pack or a 2-bit tail
pack), written as a new pack; what it refuses before any work; derived packs never inherit a stored choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from crisp_tools import plan_throughput as pt
from crisp_tools import tail_emulation, tail_pack
from crisp_tools.calibration import load_model, load_texts, split_texts
from crisp_tools.profiler import throughput as tp
from crisp_tools.serving_eval import score_plan

from crisp_runtime.planning.baselines import full_plan
from crisp_runtime.planning.plan import TierWidths
from crisp_runtime.planning.serving import SERVING_POLICIES
from crisp_runtime.scheduling.prefetch import PrefetchWidth
from crisp_runtime.storage.pack import load_pack
from crisp_runtime.storage.serving_record import serving_record

ROOT = Path(__file__).resolve().parents[1]
TINY, TINY_PACK = ROOT / "models" / "tiny-mixtral", ROOT / "models" / "tiny-mixtral-crisp"
CALIB = str(ROOT / "data" / "stdlib-calib.txt")
SMALL = ["--throughput-windows", "2", "--throughput-accuracy-windows", "3", "--throughput-seq-len", "12", "--quiet"]
# a small space (the default one, 84 candidates, is the profiler test's): one of each kind, with plan knobs
SPACE = [tp.Candidate(0.75, prefetch=PrefetchWidth.SERVING),
         tp.Candidate(prefetch=PrefetchWidth.PLAN, aux_full_weight=0.4, aux_skip_weight=0.2, width_cap=224,
                      kind=tp.CandidateServing.PLAN),
         tp.Candidate(1.0, aux_full_weight=0.3)]


@pytest.fixture(scope="module")
def tail(tmp_path_factory):
    out = tmp_path_factory.mktemp("plantp") / "t"
    assert tail_pack.main(["--model", str(TINY), "--crisp", str(TINY_PACK), "--layout", "2g128@0.25", "--out", str(out),
                           "--tier-widths", "256,64,32", "--quiet"]) == 0
    return out


def _run(src, out, *extra, reference=TINY_PACK):
    ref = [] if reference is None else ["--reference-crisp", str(reference)]
    return pt.main(["--model", str(TINY), "--crisp", str(src), "--data", CALIB, "--out", str(out), "--budget", "0.25",
                    *SMALL, *ref, *extra])


def test_a_tail_pack_is_planned_on_its_own_bytes_and_written_as_a_new_pack(tail, tmp_path, monkeypatch):
    monkeypatch.setattr(pt, "default_candidates", lambda plan, tier_widths=(): list(SPACE))
    out = tmp_path / "planned"
    assert _run(tail, out, "--max-accuracy-loss", "1.0") == 0  # a bound of 1 admits the fastest
    pack, src = load_pack(out), load_pack(tail)
    record = serving_record(pack.info)
    search = record.search
    assert search["tail_layout"] == "2g128at0.25" and record.gpu_budget_fraction == 0.25
    assert "held-out calibration windows (3 x 12" in search["accuracy_text"]
    fastest = max(search["candidates"], key=lambda r: r["tokens_per_s"])
    chosen = next(c for c in SPACE if c.label == fastest["candidate"])
    assert search["chosen"]["candidate"] == chosen.label and record.policy == chosen.serving()
    assert pack.plan == tp._described(chosen, src.plan)  # the plan the choice serves
    info = pack.info["planned_for_throughput"]
    assert info["source_pack"] == str(tail) and info["source_plan_widths_sha256"] == src.plan.widths_digest()
    assert pack.info["tail_start"] == src.info["tail_start"] and pack.info["tail_layout"] == src.info["tail_layout"]
    for lid, layer in src.layers.items():  # the same experts, bit for bit
        assert (pack.layers[lid].qweight == layer.qweight).all() and (pack.layers[lid].scales == layer.scales).all()
    # planning the planned pack again replaces its choice (never two), and a 4-bit pack is planned on 4-bit rows
    again = tmp_path / "again"
    assert _run(out, again, "--max-accuracy-loss", "1.0") == 0
    assert serving_record(load_pack(again).info).search["tail_layout"] == "2g128at0.25"
    plain = tmp_path / "plain"
    assert _run(TINY_PACK, plain, "--max-accuracy-loss", "1.0", reference=None) == 0  # its own full width
    assert serving_record(load_pack(plain).info).search["tail_layout"] == "q4"
    # every loss is relative to the 4-bit full width (the reference pack's), not the tail pack's own
    model, _ = load_model(TINY)
    windows = tp.accuracy_windows_of(split_texts(load_texts([CALIB]), 0.1)[1], 3, 12, 0, 0.1)
    four_bit = score_plan(model, load_pack(TINY_PACK), full_plan(src.plan), windows)
    own = score_plan(model, src, full_plan(src.plan), windows)
    assert four_bit.accuracy != own.accuracy  # these windows tell the two apart
    assert search["full_width_accuracy"] == four_bit.accuracy
    assert search["accuracy_reference"] == "4-bit full width (the reference pack)"
    assert pack.info["planned_for_throughput"]["reference_crisp"] == str(TINY_PACK)


def test_refusals_come_before_any_work(tail, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tp, "search_throughput", lambda *a, **k: pytest.fail("searched"))
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "mine.txt").write_text("keep")
    assert _run(tail, existing) == 2
    assert "already exists" in capsys.readouterr().err and (existing / "mine.txt").read_text() == "keep"
    assert _run(tail, tmp_path / "o", "--throughput-windows", "8", "--throughput-accuracy-windows", "4") == 2
    assert "--throughput-accuracy-windows (4)" in capsys.readouterr().err
    emulated = tmp_path / "emulated"
    assert tail_emulation.main(["--model", str(TINY), "--crisp", str(TINY_PACK), "--layout", "m432", "--out",
                                str(emulated), "--quiet"]) == 0
    assert _run(emulated, tmp_path / "o") == 2
    assert "emulated tail layout" in capsys.readouterr().err
    assert _run(tmp_path / "nowhere", tmp_path / "o") == 2
    assert "--crisp" in capsys.readouterr().err
    # a tail pack's loss is relative to the 4-bit full width: never silently to its own
    assert _run(tail, tmp_path / "o", reference=None) == 2
    err = capsys.readouterr().err
    assert "pass --reference-crisp (e.g. " in err and str(TINY_PACK.relative_to(ROOT)) in err
    assert _run(tail, tmp_path / "o", reference=tail) == 2
    assert "a tail layout itself" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_no_candidate_within_the_bound_writes_nothing(tail, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pt, "default_candidates", lambda plan, tier_widths=(): list(SPACE))
    out = tmp_path / "o"
    assert _run(tail, out, "--max-accuracy-loss", "0") == 2
    err = capsys.readouterr().err
    assert "--budget 0.25" in err and "no candidate" in err and not out.exists()


def test_a_derived_pack_never_inherits_a_stored_choice(tmp_path, monkeypatch):
    """A tail pack (or an emulated one) of a pack that stores a serving choice does not store it: the choice was
    searched on the source's bytes and plan."""
    monkeypatch.setattr(pt, "default_candidates", lambda plan, tier_widths=(): [SPACE[1]])
    planned = tmp_path / "planned"
    assert _run(TINY_PACK, planned, "--max-accuracy-loss", "1.0") == 0
    assert serving_record(load_pack(planned).info).policy == SERVING_POLICIES["plan"]
    for tool, layout in ((tail_pack, "2g128@0.25"), (tail_emulation, "m432")):
        out = tmp_path / f"derived-{layout}"
        assert tool.main(["--model", str(TINY), "--crisp", str(planned), "--layout", layout, "--out", str(out),
                          "--quiet"]) == 0
        info = json.loads((out / "pack.json").read_text())
        assert "serving" not in info and serving_record(load_pack(out).info) is None


def test_other_tier_widths_are_searched_and_the_chosen_ones_stored(tail, tmp_path, monkeypatch):
    """--search-tier-widths: the real default_candidates over a small space (one plan-width candidate per tier
    widths); the fastest within a bound of 1 is chosen and its tier widths are the new pack's plan's."""
    def small(intermediate_size=None, tier_widths=(None,), baselines=()):  # the baselines: their own test
        return [tp.Candidate(prefetch=PrefetchWidth.PLAN, kind=tp.CandidateServing.PLAN, tier_widths=tw)
                for tw in tier_widths]

    monkeypatch.setattr(tp, "candidates", small)
    out = tmp_path / "planned"
    assert _run(tail, out, "--max-accuracy-loss", "1.0", "--search-tier-widths", "256,32,0", "256,64,32") == 0
    pack, src = load_pack(out), load_pack(tail)
    search = serving_record(pack.info).search
    labels = [r["candidate"] for r in search["candidates"]]
    assert labels == ["plan+prefetch-plan", "plan-tiers256.32.0+prefetch-plan"]  # 256,64,32 is the pack's own
    fastest = max(search["candidates"], key=lambda r: r["tokens_per_s"])
    assert search["chosen"]["candidate"] == fastest["candidate"] == labels[1]  # half the auxiliary bytes
    assert pack.plan.tier_widths == TierWidths(256, 32, 0) and pack.plan.layers == src.plan.layers
    assert "256 / 32 / 0 neurons" in pack.plan.description


def test_tier_widths_outside_the_experts_are_refused_before_any_work(tail, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tp, "search_throughput", lambda *a, **k: pytest.fail("searched"))
    assert _run(tail, tmp_path / "o", "--search-tier-widths", "256,300,0") == 2
    err = capsys.readouterr().err
    assert "--search-tier-widths 256,300,0" in err and "[0, 256]" in err and not (tmp_path / "o").exists()


def test_tail_layouts_are_searched_and_the_chosen_layout_written(tmp_path, monkeypatch):
    """--tail-layouts on a 4-bit pack: every candidate on the pack's own bytes and on each layout built from the
    model's weights (the bytes crisp_tools.tail_pack stores); the fastest within a bound of 1 is written with its
    layout's bytes and records, and every loss is relative to the 4-bit full width."""
    monkeypatch.setattr(pt, "default_candidates", lambda plan, tier_widths=(): [SPACE[1]])
    out = tmp_path / "planned"
    assert _run(TINY_PACK, out, "--max-accuracy-loss", "1.0", "--tail-layouts", "2g128@0.25", "q4", "2g128@0.5",
                "2g128@0.25", reference=None) == 0
    pack = load_pack(out)
    search = serving_record(pack.info).search
    assert search["tail_layouts"] == ["q4", "2g128at0.25", "2g128at0.5"]  # the pack's own first, each once
    assert [r["tail_layout"] for r in search["candidates"]] == search["tail_layouts"]
    by_layout = {r["tail_layout"]: r for r in search["candidates"]}
    assert by_layout["2g128at0.25"]["bytes_per_token"] < by_layout["2g128at0.5"]["bytes_per_token"] < \
        by_layout["q4"]["bytes_per_token"]
    fastest = max(search["candidates"], key=lambda r: r["tokens_per_s"])
    assert search["chosen"] == fastest and search["tail_layout"] == fastest["tail_layout"] == "2g128at0.25"
    assert search["accuracy_reference"] == "4-bit full width"
    # the written pack is the tail pack crisp_tools.tail_pack builds, with the search's plan and choice
    built = tmp_path / "built"
    assert tail_pack.main(["--model", str(TINY), "--crisp", str(TINY_PACK), "--layout", "2g128@0.25", "--out",
                           str(built), "--quiet"]) == 0
    ref = load_pack(built)
    assert pack.info["tail_start"] == ref.info["tail_start"] and pack.info["tail_layout"] == ref.info["tail_layout"]
    assert pack.info["tail_pack"] == ref.info["tail_pack"]
    for lid, layer in ref.layers.items():
        assert (pack.layers[lid].qweight == layer.qweight).all() and (pack.layers[lid].scales == layer.scales).all()
    assert pack.plan == tp._described(SPACE[1], load_pack(TINY_PACK).plan)


def test_bad_tail_layouts_are_refused_before_any_work(tail, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pt, "search_variants", lambda *a, **k: pytest.fail("searched"))
    monkeypatch.setattr(pt, "tail_layers", lambda *a, **k: pytest.fail("built"))
    assert _run(tail, tmp_path / "o", "--tail-layouts", "2g128@0.5") == 2
    assert "already" in capsys.readouterr().err
    for bad, said in (("2g64@0.25", "stores 2g128@F"), ("m432", "simulated and emulated only")):
        assert _run(TINY_PACK, tmp_path / "o", "--tail-layouts", bad, reference=None) == 2
        err = capsys.readouterr().err
        assert "--tail-layouts" in err and said in err, err
    assert not (tmp_path / "o").exists()


def test_a_tail_layout_that_leaves_no_neuron_at_2_bits_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pt, "search_variants", lambda *a, **k: pytest.fail("searched"))
    monkeypatch.setattr(pt, "tail_layers", lambda *a, **k: pytest.fail("built"))
    assert _run(TINY_PACK, tmp_path / "o", "--tail-layouts", "2g128@0.999", reference=None) == 2
    err = capsys.readouterr().err
    assert "--tail-layouts 2g128at0.999: " in err and "no neuron of I=256 is left for the 2-bit tail at 0.999" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("budget", [["--budget", "0.25"], ["--gpu-budget", "0.25"]])
def test_the_search_options_are_refused_by_their_own_names_before_any_work(tmp_path, capsys, monkeypatch, budget):
    monkeypatch.setattr(pt, "search_variants", lambda *a, **k: pytest.fail("searched"))
    monkeypatch.setattr(pt, "search_budgets", lambda *a, **k: pytest.fail("searched"))
    base = ["--model", str(TINY), "--crisp", str(TINY_PACK), "--data", CALIB, "--out", str(tmp_path / "o"), *budget,
            *SMALL]
    for extra, said in ((["--throughput-seq-len", "600"],  # tiny-mixtral: max_position_embeddings 512
                         "plan-throughput: error: --throughput-seq-len 600 is beyond the model's "
                         "max_position_embeddings (512)"),
                        (["--throughput-seq-len", "99999999"], "fewer than --throughput-seq-len 99999999"),
                        (["--hardware-profile", "nope"],
                         "plan-throughput: error: --hardware-profile nope: unknown profile 'nope'; choose one of: ")):
        assert pt.main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert said in err and sum("error:" in line for line in err.splitlines()) == 1, err
        assert " --seq-len" not in err and "--budget" not in err and "--profile:" not in err, err
    assert not (tmp_path / "o").exists()
