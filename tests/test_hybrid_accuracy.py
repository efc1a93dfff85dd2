"""crisp_bench.hybrid_accuracy (docs/hybrid.md): the runtime-in-the-loop accuracy of hybrid serving
policies on the committed tiny Mixtral. Cases parse (or are refused with exit 2), the scaled cost model gives a
run expert a target expert's times, and a short decode serves what the policies say: the plan's widths under
hybrid_split (no dominant narrowed), every dominant at the floor when nothing is ever resident (cpu_only, no
pinned set), a loss of exactly 0 for the full-width reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from crisp_bench.common import CliError
from crisp_bench.hybrid_accuracy import main, parse_case, scaled_cost
from crisp_bench.profiles import get_profile

from crisp_runtime.planning.serving import SERVING_POLICIES, DominantWiden
from crisp_runtime.scheduling.scheduler import Placement

ROOT = Path(__file__).resolve().parents[1]
MODEL, PACK = ROOT / "models" / "tiny-mixtral", ROOT / "models" / "tiny-mixtral-crisp"
TEXT = ROOT / "data" / "stdlib-heldout.txt"
TRACE = ROOT / "bench" / "traces" / "heldout-predicted.npz"


def test_cases_parse():
    assert parse_case("full").policy is None
    c = parse_case("hybrid_split+prefetch")
    assert c.policy == SERVING_POLICIES["hybrid_split"] and c.prefetch and c.pin
    c = parse_case("floor=0.625,dominant_widen=hit+prefetch+nopin")
    p = c.policy
    assert (p.dominant_floor, p.dominant_widen, p.placement, c.prefetch, c.pin) == (
        0.625, DominantWiden.HIT, Placement.SPLIT, True, False)
    for bad in ("floor=2", "floor", "+prefetch", "floor=0.5+later", "dominant_widen=sometimes"):
        with pytest.raises(CliError):
            parse_case(bad)


@pytest.mark.parametrize("profile", ["rtx4090-pcie4-ddr5", "rtx4090-pcie5-ddr5"])
def test_a_run_expert_takes_a_target_experts_time(profile):
    p = get_profile(profile)
    run_row, target_row, run_inter, target_inter = 105, 6720 * 56, 256, 256  # a tiny row stands for 56 target rows
    cost = scaled_cost(p, run_row, target_row)
    run, target = run_inter * run_row, target_inter * target_row
    assert cost.load_time(run) == pytest.approx(target / p.h2d_bytes_per_s)
    assert cost.load_time_cpu_busy(run) == pytest.approx(target / p.h2d_bytes_per_s_cpu_busy)
    assert cost.cpu_time(run, 1) == pytest.approx(p.cpu_latency_s + target / p.cpu_bytes_per_s)
    assert cost.compute_time(run, 1) == pytest.approx(target / p.compute_bytes_per_s)
    with pytest.raises(CliError, match="needs a CPU"):
        scaled_cost(get_profile("rtx4090-pcie4"), run_row, target_row)


@pytest.mark.skipif(not all(p.exists() for p in (MODEL / "config.json", PACK, TEXT, TRACE)),
                    reason="committed tiny model, pack, text or trace absent")
def test_a_short_decode_serves_what_the_policies_say(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "acc.json"
    args = ["--model", str(MODEL), "--crisp", str(PACK), "--data", str(TEXT), "--trace", str(TRACE), "--windows", "1",
            "--seq-len", "12", "--budget", "0.25", "--case", "full", "--case", "hybrid_split+prefetch",
            "--case", "floor=0.875,placement=cpu_only+nopin", "--json", str(out)]
    assert main(args) == 0
    meta = json.loads(out.read_text())
    recs = {r["case"]: r for r in meta["records"]}
    assert recs["full"]["accuracy_loss"] == 0.0 and recs["full"]["tokens_evaluated"] == 11
    split = recs["hybrid_split+prefetch"]
    assert split["narrowed_dominant_fraction"] == 0.0 and split["prefetches"] > 0 and split["pinned"]
    # the prefetch window is on by default: the profile's clock for the target, with its CPU (the hybrid step)
    window = meta["prefetch_window"]
    assert split["prefetch_window"] and not recs["full"]["prefetch_window"] and split["prefetch_cut"] >= 0
    assert split["eviction"] == "lru" and recs["full"]["eviction"] is None  # --eviction's default, offloading only
    assert window["name"] == "rtx4090-pcie4-ddr5/mixtral-8x7b" and window["cpu_bytes_per_s"] > 0
    assert recs["floor=0.875,placement=cpu_only+nopin"]["narrowed_dominant_fraction"] == 1.0
    assert main(args) == 2  # the output exists: refused, never overwritten


@pytest.mark.parametrize("bad", [["--crisp", "/nonexistent/pack"], ["--model", "/nonexistent/model"],
                                 ["--budget", "0"], ["--windows", "0"], ["--profile", "no-such-profile"],
                                 ["--case", "floor=2"], ["--data", "/nonexistent/text.txt"]])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, bad):
    """Bad input ends in 'error: ...' and exit status 2, never a traceback, and writes no output file."""
    out = tmp_path / "acc.json"
    args = ["--budget", "0.25", "--case", "full", "--json", str(out), *bad]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert not out.exists()
