"""crisp-bench cpu and bench.cpu.measure_cpu_expert (the measured profile's entry), on a tiny shape."""

import collections
import json

import pytest
import torch

from bench.cli import main
from bench.cpu import CpuBenchError, measure_cpu_expert
from bench.shapes import ModelShape
from crisp_kernels.cpu_expert import CpuImpl

TINY = ModelShape("t", 1, 2, 1, 128, 200)


@pytest.mark.parametrize("impl, extra", [(None, False), (CpuImpl.INT4PACK_BF16, True), (CpuImpl.DEQUANT_FP32, False)])
def test_measure_cpu_expert_reports_each_width(impl, extra):
    got = measure_cpu_expert(TINY, [64, 200, 130], repeats=1, impl=impl)
    want = "native-q8" if impl is None else impl.value  # the runtime's default where the C kernel builds
    assert got["widths"] == [64, 200, 130]
    assert got["impl"] == want
    assert len(got["seconds"]) == 3 and all(s > 0 for s in got["seconds"])
    assert got["prefix_bytes"] == [w * TINY.neuron_nbytes for w in (64, 200, 130)]
    assert got["memcpy_gbps"] > 0 and got["read_gbps"] > 0
    info = got["info"]
    assert info.impl.value == want and (info.extra_nbytes > 0) == extra and info.measured_gbps > 0


@pytest.mark.parametrize("widths", [[], [0], [201]])
def test_measure_cpu_expert_refuses_bad_widths(widths):
    with pytest.raises(CpuBenchError, match="widths"):
        measure_cpu_expert(TINY, widths, repeats=1)


def test_cli_json(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    assert main(["cpu", "--shapes", "tiny", "--widths", "0.5,1", "--tokens", "1,3", "--repeats", "1",
                 "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["command"] == "cpu"
    recs = doc["records"]
    assert {(r["width_frac"] > 0.9, r["tokens"]) for r in recs} == {(False, 1), (False, 3), (True, 1), (True, 3)}
    # the runtime's default: the native kernel with 8-bit activations, checked at its tolerance before timing
    assert all(r["rel_err"] <= 2.0**-5 and r["impl"] == "native-q8" for r in recs)
    # the kernel's rate against both references of the same rounds: a copy and a streaming read
    assert all(r["pct_read"] == pytest.approx(100 * r["gbps"] / r["read_gbps"]) and
               r["pct_memcpy"] == pytest.approx(100 * r["gbps"] / r["memcpy_gbps"]) for r in recs)
    out = capsys.readouterr().out
    assert "memcpy" in out and "% read" in out


def test_cli_times_several_kernels_in_the_same_rounds(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    assert main(["cpu", "--shapes", "tiny", "--widths", "0.5,1", "--tokens", "1", "--repeats", "1",
                 "--impl", "native-fp32,native-q8,int4pack-bf16", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    recs = doc["records"]
    assert {(r["impl"], r["width_frac"] > 0.9) for r in recs} == {
        (i, f) for i in ("native-fp32", "native-q8", "int4pack-bf16") for f in (False, True)}
    tol = {"native-fp32": 1e-5, "native-q8": 2.0**-5, "int4pack-bf16": 2 * 2.0**-8}
    assert all(r["rel_err"] <= tol[r["impl"]] for r in recs)
    assert all(r["rel_err"] > 1e-4 for r in recs if r["impl"] == "native-q8")  # the activations are rounded
    extra = next(iter(doc["memory"].values()))["extra_nbytes"]
    assert extra["native-fp32"] == 0 and extra["int4pack-bf16"] > 0
    out = capsys.readouterr().out
    assert "native-fp32" in out and "int4pack-bf16" in out


def test_cli_bad_shape(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["cpu", "--shapes", "nope"])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("nbytes, want", [(1, 1), (3 * 200 * TINY.neuron_nbytes - 1, 3), (10**12, 64)])
def test_cold_copies_cover_the_bytes_asked_for_in_memory_of_their_own(nbytes, want):
    """Enough copies of the expert that reading each in turn covers ``nbytes`` (at most MAX_COPIES), each in its own
    memory and equal to the original: a timed call never reads what the call before it left in the cache."""
    from bench.cpu import MAX_COPIES, cold_copies, random_expert

    packed = random_expert(TINY)
    copies = cold_copies(packed, nbytes)
    assert len(copies) == want <= MAX_COPIES and copies[0] is packed
    pointers = {t.data_ptr() for c in copies for t in (c.qweight, c.scales, c.zeros)}
    assert len(pointers) == 3 * want
    for c in copies:
        assert all(torch.equal(a, b) for a, b in ((c.qweight, packed.qweight), (c.scales, packed.scales),
                                                  (c.zeros, packed.zeros)))


def test_consecutive_timed_calls_read_different_copies(monkeypatch):
    """Every point of a run takes the next copy in one shared turn: no two calls in a row read the same expert,
    whichever points they belong to, and each copy is read as often as the others."""
    import bench.cpu as cpu_bench

    read = []
    real = cpu_bench.expert_mlp_cpu_accumulate_

    def spy(x, expert, *args, **kwargs):
        read.append(expert.qweight.data_ptr())
        return real(x, expert, *args, **kwargs)

    monkeypatch.setattr(cpu_bench, "MAX_COPIES", 5)
    monkeypatch.setattr(cpu_bench, "expert_mlp_cpu_accumulate_", spy)
    records, memory = cpu_bench.measure(TINY, [0.5, 1.0], [1, 2], 3)
    assert memory["expert_copies"] == 5 and len(records) == 4
    assert len(read) > 10 and all(a != b for a, b in zip(read[:-1], read[1:], strict=True))
    counts = collections.Counter(read)
    assert len(counts) == 5 and max(counts.values()) - min(counts.values()) <= 1
