"""crisp-bench cpu and bench.cpu.measure_cpu_expert (the measured profile's entry), on a tiny shape."""

import json

import pytest

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
