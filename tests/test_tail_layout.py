"""Tail layouts: their bytes, the simulator's mapping onto them, the emulation inside the 4-bit format, and the
evaluation / accuracy plumbing that keeps a layout's figures apart from the 4-bit pack's."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from crisp_bench import sim_policies
from crisp_bench.shapes import MIXTRAL_8X7B
from crisp_bench.simulate import SimPolicy, simulate_decode
from crisp_bench.tail_sim import TailMapping
from crisp_bench.traces import plan_from_trace, synthetic_trace
from crisp_tools import tail_emulation as te

from crisp_kernels.format import QuantFormat, dequantize_rows, pack_expert, unpack_nibbles
from crisp_kernels.tail_layout import (
    M42,
    M432,
    PLAIN,
    Q3,
    TailLayout,
    TailSegment,
    neuron_nbytes,
    parse_tail_layout,
)
from crisp_runtime.planning.plan import CrispPlan, TierWidths
from crisp_runtime.planning.serving import SERVING_POLICIES, resident_policy

ROOT = Path(__file__).resolve().parents[1]
TINY, TINY_PACK = ROOT / "models" / "tiny-mixtral", ROOT / "models" / "tiny-mixtral-crisp"
H4096_4BIT = QuantFormat().neuron_nbytes(4096)  # 6,720 B


# ----------------------------------------------------------------------------- bytes


def test_low_bit_neuron_bytes_by_hand():
    # 3 vectors x (H bits / 8 + groups x (fp16 scale + uint8 zero))
    assert H4096_4BIT == 3 * (2048 + 64 * 3) == 6720
    assert neuron_nbytes(4096, 3, 64) == 3 * (1536 + 64 * 3) == 5184
    assert neuron_nbytes(4096, 2, 128) == 3 * (1024 + 32 * 3) == 3360
    assert neuron_nbytes(4096, 2, 64) == 3 * (1024 + 64 * 3) == 3648
    with pytest.raises(ValueError, match="multiple of group_size=128"):
        neuron_nbytes(64, 2, 128)


@pytest.mark.parametrize("width", [0, 1, 3583, 3584, 3585, 7167, 7168, 7169, 14335, 14336])
def test_prefix_bytes_are_piecewise_by_segment(width):
    inter = 14336  # m432: rows [0, 3584) 4-bit, [3584, 7168) 3-bit g64, [7168, I) 2-bit g128
    expect = (min(width, 3584) * 6720 + max(0, min(width, 7168) - 3584) * 5184 + max(0, width - 7168) * 3360)
    assert M432.prefix_nbytes(width, inter, 4096, H4096_4BIT) == expect
    assert PLAIN.prefix_nbytes(width, inter, 4096, H4096_4BIT) == width * H4096_4BIT


def test_full_fractions_of_the_presets():
    assert M432.full_fraction(14336, 4096, H4096_4BIT) == pytest.approx(4656 / 6720)  # 0.693
    assert M42.full_fraction(14336, 4096, H4096_4BIT) == pytest.approx(0.75)
    assert Q3.full_fraction(14336, 4096, H4096_4BIT) == pytest.approx(5184 / 6720)
    assert PLAIN.full_fraction(14336, 4096, H4096_4BIT) == 1.0


def test_parse_presets_and_specs():
    assert parse_tail_layout("m432") is M432 and parse_tail_layout("q4") is PLAIN
    custom = parse_tail_layout("3g64@0.25, 2g128@0.5")
    assert custom.segments == M432.segments and custom.spec() == M432.spec() == "3g64@0.25,2g128@0.5"
    assert parse_tail_layout(M42.spec()).segments == M42.segments


@pytest.mark.parametrize("spec, message", [
    ("", "not BITSgGROUP@START"), ("5g64@0.1", "not BITSgGROUP@START"), ("2g32@0.5", "not BITSgGROUP@START"),
    ("2g64@1.0", r"in \[0, 1\)"), ("2g64@0.5,3g64@0.25", "increase strictly"), ("2g64@0.5,2g64@0.5", "increase"),
    ("m999", "presets: q4, m432"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_tail_layout(spec)


def test_segment_fields_are_checked():
    with pytest.raises(ValueError, match="bits"):
        TailSegment(0.5, 4, 64)
    with pytest.raises(ValueError, match="group_size"):
        TailSegment(0.5, 2, 32)
    with pytest.raises(ValueError, match="start"):
        TailSegment(True, 2, 64)
    with pytest.raises(ValueError, match="name"):
        TailLayout("a b")


# ----------------------------------------------------------------------------- the simulator's mapping


def _crisp_plan(trace, warm=40, cold=16):
    # tiers from the trace's own pair counts (Hot, Warm and Cold pairs), auxiliaries at 256 / warm / cold
    return plan_from_trace(trace).with_tiers(TierWidths(trace.intermediate_size, warm, cold))


def test_mapping_counts_the_layouts_bytes():
    trace = synthetic_trace(num_tokens=8)
    mapping = TailMapping(M432, trace, MIXTRAL_8X7B)
    assert mapping.full == math.ceil(14336 * 4656 / 6720)  # 9,933 rows of 6,720 B
    for k in (0, 1, 63, 64, 65, 128, 200, 256):
        exact = M432.prefix_nbytes(k * 56, 14336, 4096, H4096_4BIT)
        assert 0 <= mapping.rows(k) * H4096_4BIT - exact < H4096_4BIT  # rounded up, to less than one row
    plan = mapping.mapped_plan(_crisp_plan(trace))
    assert plan.intermediate_size == mapping.full
    assert plan.tier_widths == TierWidths(mapping.full, 40 * 56, 16 * 56)  # the head is 4-bit: one row per neuron
    uni = mapping.mapped_plan(CrispPlan.uniform(8, 2, 256, trace.layer_ids, 128))
    assert uni.uniform_width == mapping.rows(128) == math.ceil(3584 + 3584 * 5184 / 6720)  # 4-bit + 3-bit rows
    resident = SERVING_POLICIES["resident"]
    assert mapping.mapped_serving(resident) is resident  # floor 1: nothing to restate
    floored = mapping.mapped_serving(resident_policy(0.75))
    assert floored.floor_width(mapping.full, mapping.full) == mapping.rows(192)  # 75% of the neurons, in rows
    assert mapping.mapped_shape().intermediate_size == mapping.full


@pytest.mark.parametrize("spec,start", [("2g128@0.25", 3584), ("2g128@0.5", 7168), ("2g128@0", 0)])
def test_a_storable_layout_maps_to_the_packs_own_storage_rows(spec, start):
    """``crisp_tools.tail_pack`` stores 2g128 tails of a g64 pack as two neurons per row: the simulator's rows
    are those rows (crisp_kernels.format.rows_for_neurons), width by width."""
    from crisp_kernels.format import rows_for_neurons

    trace = synthetic_trace(num_tokens=8)
    mapping = TailMapping(parse_tail_layout(spec), trace, MIXTRAL_8X7B)
    assert mapping.full == rows_for_neurons(14336, start)
    for k in range(257):
        assert mapping.rows(k) == rows_for_neurons(k * 56, start), k


def test_the_plain_mapping_simulates_what_the_unmapped_run_does():
    """The mapping is exact: with every row 4-bit it is the identity on bytes, so the run is the same."""
    trace = synthetic_trace(num_tokens=48, seed=3)
    shape = MIXTRAL_8X7B
    budget = int(0.25 * shape.total_expert_nbytes)
    mapping = TailMapping(TailLayout("plain", ()), trace, shape)
    for name, plan in (("full", CrispPlan.full(8, 2, 256, trace.layer_ids)), ("crisp", _crisp_plan(trace))):
        for serving in ("plan", "resident-floor75"):
            pol = SimPolicy(name, plan, SERVING_POLICIES[serving], "lru")
            a = simulate_decode(trace, pol, _profile(), shape, budget, orders=["widest_first"], warmup=8)
            b = simulate_decode(mapping.mapped_trace(), mapping.mapped_policy(pol), _profile(),
                                mapping.mapped_shape(), budget, orders=["widest_first"], warmup=8)
            sa, sb = a.summary("widest_first"), b.summary("widest_first")
            for key in ("tokens_per_s", "bytes_per_token", "hit_rate", "bytes_computed_per_token"):
                assert sb[key] == pytest.approx(sa[key], rel=1e-9), (name, serving, key)


def test_a_tail_layout_copies_its_fraction_of_the_bytes():
    trace = synthetic_trace(num_tokens=40, seed=1)
    shape = MIXTRAL_8X7B
    budget = shape.expert_nbytes * 2  # two 4-bit experts: nearly every access misses, at any layout
    full = SimPolicy("full", CrispPlan.full(8, 2, 256, trace.layer_ids))
    plain = simulate_decode(trace, full, _profile(), shape, budget, orders=["router"]).summary("router")
    mapping = TailMapping(M432, trace, shape)
    mixed = simulate_decode(mapping.mapped_trace(), mapping.mapped_policy(full), _profile(), mapping.mapped_shape(),
                            budget, orders=["router"]).summary("router")
    frac = mapping.full / 14336
    assert mixed["bytes_computed_per_token"] == pytest.approx(frac * plain["bytes_computed_per_token"], rel=1e-12)
    assert mixed["tokens_per_s"] > plain["tokens_per_s"]


def test_cpu_placements_are_refused_with_a_layout():
    trace = synthetic_trace(num_tokens=8)
    pol = SimPolicy("full", CrispPlan.full(8, 2, 256, trace.layer_ids), SERVING_POLICIES["hybrid_split"])
    with pytest.raises(ValueError, match="CPU placements"):
        TailMapping(M432, trace, MIXTRAL_8X7B).mapped_policy(pol)


def _profile():
    from crisp_bench.profiles import get_profile

    return get_profile("rtx4090-pcie4")


# ----------------------------------------------------------------------------- accuracy bookkeeping


def _write_eval(path, layout, losses):
    doc = {"model": "models/tiny-mixtral", "records": [
        {"policy": p, "relative_accuracy_loss_vs_full": v} for p, v in losses.items()]}
    if layout is not None:
        doc["tail_layout"] = layout
    path.write_text(json.dumps(doc))
    return path


def test_accuracy_is_attached_to_its_own_layout_only(tmp_path):
    plain = _write_eval(tmp_path / "q4.json", None, {"full": 0.0, "crisp": 0.013})
    mixed = _write_eval(tmp_path / "m432.json", "m432", {"full": 0.0, "crisp": 0.0165, "full_layout": 0.0024})
    rows, _ = sim_policies.read_accuracy([plain, mixed], "models/tiny-mixtral")
    record = {"policy": "crisp", "serving": "plan", "serving_policy": SERVING_POLICIES["plan"].to_dict(),
              "budget_fraction": 0.25, "prefetch": True, "eviction": "next_use"}
    assert sim_policies.accuracy_for(record, rows)[0] == 0.013
    assert sim_policies.accuracy_for({**record, "tail_layout": "m432"}, rows)[0] == 0.0165
    assert sim_policies.accuracy_for({**record, "tail_layout": "m42"}, rows) == (None, None)
    # the layout's own full width, not the 4-bit reference the loss is measured against
    full = {**record, "policy": "full"}
    assert sim_policies.accuracy_for({**full, "tail_layout": "m432"}, rows)[0] == 0.0024
    assert sim_policies.accuracy_for(full, rows)[0] == 0.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"records": [], "tail_layout": 3}))
    with pytest.raises(ValueError, match="tail_layout"):
        sim_policies.read_accuracy([bad], None)


# ----------------------------------------------------------------------------- emulation in the 4-bit format


@pytest.mark.parametrize("bits, group", [(2, 64), (2, 128), (3, 64), (3, 128)])
def test_quantize_on_grid_lies_exactly_on_the_low_bit_grid(bits, group):
    torch.manual_seed(bits * group)
    rows = torch.randn(5, 3, 256) * torch.rand(5, 3, 1)  # rows of differing scale
    rows[0, 0, :64] = 0.0  # an all-zero group
    rows[1, 1] = rows[1, 1].abs()  # one sign only
    codes, scales, zeros = te.quantize_on_grid(rows, bits, group, 64)
    step, levels = te.CODE_STEP[bits], 1 << bits
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert bool((codes % step == 0).all()) and bool((zeros % step == 0).all())
    per = group // 64
    assert torch.equal(scales, scales[..., ::per].repeat_interleave(per, dim=-1))  # one scale per low-bit group
    deq = dequantize_rows(codes, scales, zeros, 64)
    for g in deq.reshape(-1, group):
        assert g.unique().numel() <= levels
    # the clip search never does worse than plain min-max on the same grid (ratio 1.0 is a candidate)
    lo, hi = rows.reshape(5, 3, -1, group).amin(-1).clamp(max=0), rows.reshape(5, 3, -1, group).amax(-1).clamp(min=0)
    s = ((hi - lo) / ((levels - 1) * step)).clamp_min(2.0**-24).half().float() * step
    z = torch.round(-lo / s).clamp(0, levels - 1)
    g = rows.reshape(5, 3, -1, group)
    minmax = ((torch.round(g / s[..., None] + z[..., None]).clamp(0, levels - 1) - z[..., None]) * s[..., None] - g)
    err = (deq - rows).reshape(5, 3, -1, group).square().sum(-1)
    assert bool((err <= minmax.square().sum(-1) * (1 + 1e-6) + 1e-12).all())
    if bits == 3:  # a finer grid is closer than 2-bit's on the same rows
        c2, s2, z2 = te.quantize_on_grid(rows, 2, group, 64)
        assert float((dequantize_rows(c2, s2, z2, 64) - rows).square().sum()) > float((deq - rows).square().sum())


def _packed_layer(inter=32, hidden=128, experts=2, seed=0):
    from crisp_kernels.format import PackedLayer

    torch.manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden) * 0.1
    down = torch.randn(experts, hidden, inter) * 0.1
    fmt = QuantFormat()
    packed = [pack_expert(gate_up[e, :inter], gate_up[e, inter:], down[e], fmt) for e in range(experts)]
    order = torch.stack([torch.randperm(inter) for _ in range(experts)])
    # the pack's rows in a stored order: permute the packed rows as crisp-profile's reordering does
    qweight = torch.stack([p.qweight[order[e]] for e, p in enumerate(packed)])
    scales = torch.stack([p.scales[order[e]] for e, p in enumerate(packed)])
    zeros = torch.stack([p.zeros[order[e]] for e, p in enumerate(packed)])
    return PackedLayer(fmt, qweight, scales, zeros, order), gate_up, down


def test_emulated_layer_keeps_the_head_and_puts_the_tail_on_grids():
    layer, gate_up, down = _packed_layer()
    out = te.emulate_layer(layer, gate_up, down, M432)
    head = 8  # 25% of 32 rows
    assert torch.equal(out.qweight[:, :head], layer.qweight[:, :head])
    assert torch.equal(out.scales[:, :head], layer.scales[:, :head]) and torch.equal(out.zeros[:, :head],
                                                                                      layer.zeros[:, :head])
    assert torch.equal(out.neuron_order, layer.neuron_order)
    codes = unpack_nibbles(out.qweight)
    assert bool((codes[:, head:16] % 2 == 0).all()) and bool((codes[:, 16:] % 5 == 0).all())
    # the tail is quantized from the original rows (stored order), not re-quantized from 4-bit codes
    rows = te.stored_order_rows(gate_up, down, layer.neuron_order)
    tail = dequantize_rows(codes[:, 16:], out.scales[:, 16:], out.zeros[:, 16:], 64)
    assert float((tail - rows[:, 16:]).abs().max()) < float(rows[:, 16:].abs().max())
    assert te.emulate_layer(layer, gate_up, down, PLAIN) is layer
    with pytest.raises(ValueError, match="symmetric"):
        te.emulate_layer(replace(layer, zeros=None, fmt=QuantFormat(symmetric=True)), gate_up, down, M432)


# ----------------------------------------------------------------------------- the tools end to end


pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    out = tmp_path_factory.mktemp("tail") / "m432"
    assert te.main(["--model", str(TINY), "--crisp", str(TINY_PACK), "--layout", "m432", "--out", str(out),
                    "--tier-widths", "256,40,16", "--quiet"]) == 0
    return out


def test_emulation_writes_a_loadable_pack_that_names_its_layout(emulated, capsys):
    from crisp_runtime.storage.pack import load_pack

    src, pack = load_pack(TINY_PACK), load_pack(emulated)
    assert pack.info["tail_layout"] == M432.to_dict()
    assert pack.info["tail_emulation"]["source_pack"] == str(TINY_PACK)
    assert pack.plan.tier_widths == TierWidths(256, 40, 16)
    for lid, layer in pack.layers.items():
        assert torch.equal(layer.qweight[:, :64], src.layers[lid].qweight[:, :64])
        assert not torch.equal(layer.qweight[:, 64:], src.layers[lid].qweight[:, 64:])
    # an existing --out is never overwritten; q4 without --tier-widths has nothing to do
    before = sorted(p.name for p in emulated.iterdir())
    assert te.main(["--model", str(TINY), "--crisp", str(TINY_PACK), "--layout", "m42", "--out", str(emulated),
                    "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert sorted(p.name for p in emulated.iterdir()) == before
    assert te.main(["--model", str(TINY), "--crisp", str(TINY_PACK), "--layout", "q4", "--out",
                    str(emulated.parent / "q4"), "--quiet"]) == 2
    assert "nothing to emulate" in capsys.readouterr().err
    assert te.main(["--model", str(TINY), "--crisp", str(emulated), "--layout", "m42", "--out",
                    str(emulated.parent / "twice"), "--quiet"]) == 2
    assert "already a tail layout" in capsys.readouterr().err
    assert te.main(["--model", str(TINY), "--crisp", str(TINY_PACK), "--layout", "m42", "--out",
                    str(emulated.parent / "wide"), "--tier-widths", "256,300,0", "--quiet"]) == 2
    assert "--tier-widths" in capsys.readouterr().err
    assert not (emulated.parent / "q4").exists() and not (emulated.parent / "wide").exists()


def test_eval_of_an_emulation_needs_its_4bit_reference(emulated, tmp_path, capsys):
    from crisp_tools import evaluate

    base = ["--model", str(TINY), "--crisp", str(emulated), "--data", str(ROOT / "data" / "stdlib-heldout.txt"),
            "--samples", "4", "--seq-len", "32", "--quiet", "--threads", "1"]
    assert evaluate.main(base) == 2
    assert "--reference-crisp" in capsys.readouterr().err
    assert evaluate.main([*base, "--reference-crisp", str(TINY_PACK), "--mode", "decode"]) == 2
    assert "only for a 2-bit tail pack" in capsys.readouterr().err
    assert evaluate.main([*base, "--reference-crisp", str(emulated)]) == 2
    assert "a tail layout itself" in capsys.readouterr().err
    path = tmp_path / "m432.json"
    assert evaluate.main([*base, "--reference-crisp", str(TINY_PACK), "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["tail_layout"] == "m432" and doc["reference_crisp"] == str(TINY_PACK)
    from crisp_runtime.storage.pack import load_pack

    assert doc["plan_widths_sha256"] == load_pack(emulated).plan.widths_digest()
    by = {r["policy"]: r for r in doc["records"]}
    assert by["full"]["relative_accuracy_loss_vs_full"] == 0.0
    plain = tmp_path / "q4.json"
    assert evaluate.main([*base[:3], str(TINY_PACK), *base[4:], "--json", str(plain)]) == 0
    ref = {r["policy"]: r for r in json.loads(plain.read_text())["records"]}
    # the reference is the 4-bit pack's full width, not the layout's own
    assert by["full"]["perplexity"] == pytest.approx(ref["full"]["perplexity"], rel=1e-9)
    assert by["full_layout"]["perplexity"] != pytest.approx(ref["full"]["perplexity"], rel=1e-6)
    assert by["full_layout"]["bytes_per_token"] == by["full"]["bytes_per_token"]  # 4-bit bytes counted
    assert "m432" in by["full_layout"]["label"] and np.isfinite(by["full_layout"]["perplexity"])


def test_emulation_of_a_corrupt_pack_is_refused_and_writes_nothing(tmp_path, capsys):
    import shutil

    src = tmp_path / "pack"
    shutil.copytree(TINY_PACK, src)
    data = bytearray((src / "experts.safetensors").read_bytes())
    data[-100] ^= 0xFF  # one byte of the last tensor
    (src / "experts.safetensors").write_bytes(bytes(data))
    out = tmp_path / "out"
    assert te.main(["--model", str(TINY), "--crisp", str(src), "--layout", "m432", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--crisp" in err and len([line for line in err.splitlines() if line.strip()]) == 1
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["pack"]


def test_an_interrupted_emulation_leaves_nothing(tmp_path, monkeypatch, capsys):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(te, "emulate_layer", interrupt)
    out = tmp_path / "out"
    rc = te.main(["--model", str(TINY), "--crisp", str(TINY_PACK), "--layout", "m432", "--out", str(out), "--quiet"])
    assert rc == 130 and "interrupted" in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_evaluation_of_another_plan_is_not_attached(tmp_path):
    plan = CrispPlan.load(TINY_PACK / "plan.json")
    assert plan.widths_digest() == replace(plan, description="other words").widths_digest()
    other = plan.with_tiers(TierWidths(256, 40, 16))
    assert other.widths_digest() != plan.widths_digest()
    path = _write_eval(tmp_path / "e.json", None, {"full": 0.0, "crisp": 0.0092})
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "plan_widths_sha256": other.widths_digest()}))
    rows, notes = sim_policies.read_accuracy([path], "models/tiny-mixtral", plan)
    assert rows == [] and any("another CRISP plan" in n for n in notes)
    rows, _ = sim_policies.read_accuracy([path], "models/tiny-mixtral", other)
    assert [r["accuracy_loss"] for r in rows] == [0.0, 0.0092]
    rows, _ = sim_policies.read_accuracy([_write_eval(tmp_path / "old.json", None, {"crisp": 0.013})],
                                         "models/tiny-mixtral", other)
    assert len(rows) == 1  # written before the digest was recorded: trusted, as before


def test_a_promoted_plan_takes_evaluations_recorded_with_or_without_its_weight(tmp_path):
    """A decode that promotes a pack's plan records the pack's digest (without the weight) and the weight per
    record; a pack that stores the weight has the digest with it. Both name the promoted plan's widths, so
    either is attached to a simulation of the stored plan; another plan's digest still is not."""
    plan = CrispPlan.load(TINY_PACK / "plan.json")
    promoted = plan.promoted(0.33)
    assert promoted.widths_digest() != plan.widths_digest()
    path = _write_eval(tmp_path / "e.json", None, {"crisp": 0.0072})
    doc = json.loads(path.read_text())
    for digest in (plan.widths_digest(), promoted.widths_digest()):
        path.write_text(json.dumps({**doc, "plan_widths_sha256": digest}))
        rows, notes = sim_policies.read_accuracy([path], "models/tiny-mixtral", promoted)
        assert len(rows) == 1 and not any("another CRISP plan" in n for n in notes)
    other = plan.with_tiers(TierWidths(256, 40, 16)).promoted(0.33)
    path.write_text(json.dumps({**doc, "plan_widths_sha256": other.widths_digest()}))
    rows, notes = sim_policies.read_accuracy([path], "models/tiny-mixtral", promoted)
    assert rows == [] and any("another CRISP plan" in n for n in notes)
