"""`crisp-bench e2e --placements` on the committed tiny Mixtral: the hybrid path and its baselines run end
to end on this CPU; every layer step of a CPU placement equals the float64 reference at the widths it served within
the precision contract (bf16: 2u per CPU expert; fp32: 1e-5; q8: 2**-5), and with the exact fp32 CPU path the
logits equal the same plan's under the GPU placement (the same widths served)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from crisp_bench.cli import main

ROOT = Path(__file__).resolve().parents[1]
MODEL, TEXT = ROOT / "models" / "tiny-mixtral", ROOT / "data" / "stdlib-heldout.txt"


@pytest.mark.skipif(not (MODEL / "config.json").is_file() or not TEXT.is_file(), reason="committed tiny model absent")
@pytest.mark.parametrize("precision, kernel", [("bf16", "torch"), ("fp32", "torch"), ("bf16", "native"),
                                               ("q8", "native")])
def test_e2e_placements_equal_the_reference(tmp_path, capsys, precision, kernel):
    pytest.importorskip("transformers")
    out = tmp_path / "e2e.json"
    assert main(["e2e", "--model", str(MODEL), "--text", str(TEXT), "--tokens", "12", "--policies", "full,crisp",
                 "--placements", "gpu,hybrid,hybrid_split,static_hybrid,cpu_only", "--cpu-precision", precision,
                 "--cpu-kernel", kernel, "--json", str(out), "--threads", "1"]) == 0
    recs = {r["policy"]: r for r in json.loads(out.read_text())["records"]}
    # the footer names the kernel that ran and the tolerance it was held to (the native kernel computes fp32 under
    # either promise)
    impl = recs["full/hybrid"]["cpu_experts"]["impl"]
    assert f"CPU placements (kernel {impl}, held to the {precision} tolerance)" in capsys.readouterr().out
    for plan in ("full", "crisp"):
        for placement in ("hybrid", "hybrid_split", "static_hybrid", "cpu_only"):
            r = recs[f"{plan}/{placement}"]
            # 12 tokens + 3 warm-up, 4 MoE layers: every step checked, each within its bound
            assert r["steps_checked"] == 4 * 15 and r["within_tolerance"], (plan, placement, r["max_err_over_bound"])
            assert r["cpu_precision"] == precision
            if precision == "fp32" or (precision, kernel) == ("bf16", "native"):  # the native kernel: fp32 under bf16
                # float32 logits of a 128-wide model: a different summation order moves them by ~1e-6; 1e-4 is a bug
                assert r["max_logit_diff_vs_gpu"] <= 1e-4, (plan, placement, r["max_logit_diff_vs_gpu"])
                assert r["accuracy"] == pytest.approx(recs[plan]["accuracy"])
                assert r["cpu_experts"]["prepared_experts"] == 0
                assert r["cpu_experts"]["impl"] == ("native-fp32" if kernel == "native" else "dequant-fp32")
            elif precision == "q8":  # the native kernel on the host rows, 8-bit activations: no copy
                assert r["cpu_experts"]["impl"] == "native-q8" and r["cpu_experts"]["prepared_experts"] == 0
            elif r["cpu_runs_per_token"] > 0:  # the bf16 path read int4pack copies, built for the experts it ran
                assert 0 < r["cpu_experts"]["prepared_experts"] <= 4 * 8
        assert recs[f"{plan}/cpu_only"]["cpu_runs_per_token"] > 0 and recs[f"{plan}/cpu_only"]["bytes_per_token"] == 0
        assert recs[f"{plan}/static_hybrid"]["bytes_per_token"] == 0  # nothing copied after the pinned experts
