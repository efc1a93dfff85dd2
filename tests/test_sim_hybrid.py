"""The simulator's CPU placements: static_hybrid and cpu_only copy nothing, cpu_only's time is the
CPU's sum, hybrid is never slower than cpu_only on the same times, profiles with a CPU round-trip."""

from __future__ import annotations

from dataclasses import replace

import pytest
from crisp_bench.profiles import BUILTIN_PROFILES, HardwareProfile, get_profile
from crisp_bench.shapes import ModelShape
from crisp_bench.simulate import SimPolicy, simulate_decode
from crisp_bench.traces import synthetic_trace

from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.planning.serving import SERVING_POLICIES

# 4 layers of 8 experts of I = 16 neurons of 105 bytes (H = 64): an expert is 1680 bytes. No latencies, so
# the profile's times are the cost model's and the split the scheduler picks is optimal for them.
SHAPE = ModelShape("toy", num_layers=4, num_experts=8, top_k=2, hidden_size=64, intermediate_size=16)
PROFILE = HardwareProfile("toy-cpu", h2d_bytes_per_s=1680.0, copy_latency_s=0.0, compute_bytes_per_s=16800.0,
                          compute_latency_s=0.0, router_s=0.1, other_s=0.2, cpu_bytes_per_s=2400.0,
                          h2d_bytes_per_s_cpu_busy=1000.0)
TRACE = synthetic_trace(num_layers=4, num_tokens=60, intermediate_size=16, seed=3)


def run(serving, plan=None, budget_experts=8, profile=PROFILE):
    plan = plan or CrispPlan.full(8, 2, 16, TRACE.layer_ids)
    return simulate_decode(TRACE, SimPolicy("full", plan, SERVING_POLICIES[serving]), profile, SHAPE,
                           budget_experts * SHAPE.expert_nbytes, orders=["widest_first"], warmup=5)


def test_cpu_only_time_is_the_cpus_sum_and_nothing_is_copied():
    res = run("cpu_only")
    assert res.bytes_copied == 0 and res.cpu_runs == res.experts_run > 0
    lead = PROFILE.router_s + PROFILE.other_s
    steps = res.tokens * SHAPE.num_layers
    # every expert at full width on the CPU: 1680 bytes / 2400 B/s = 0.7 s each, plus the lead per step
    assert res.per_order["widest_first"].time_s == pytest.approx(steps * lead + res.cpu_runs * 0.7)


def test_static_hybrid_copies_nothing_and_keeps_its_pinned_experts():
    res = run("static_hybrid")
    assert res.bytes_copied == 0 and res.counters.misses == 0 and res.counters.evictions == 0
    assert 0 < res.cpu_runs < res.experts_run  # the pinned experts on the GPU, the others on the CPU
    assert res.peak_bytes <= 8 * SHAPE.expert_nbytes


@pytest.mark.parametrize("budget_experts", [2, 8, 20])
def test_hybrid_never_slower_than_cpu_only_or_gpu_only(budget_experts):
    hybrid = run("hybrid", budget_experts=budget_experts).per_order["widest_first"].time_s
    cpu_only = run("cpu_only", budget_experts=budget_experts).per_order["widest_first"].time_s
    assert hybrid <= cpu_only + 1e-9


def test_placement_needs_a_cpu_and_the_runtime_order():
    no_cpu = replace(PROFILE, cpu_bytes_per_s=None)
    with pytest.raises(ValueError, match="needs a hardware profile with a CPU"):
        run("hybrid", profile=no_cpu)
    with pytest.raises(ValueError, match="runtime's order only"):
        simulate_decode(TRACE, SimPolicy("full", CrispPlan.full(8, 2, 16, TRACE.layer_ids), SERVING_POLICIES["hybrid"]),
                        PROFILE, SHAPE, 8 * SHAPE.expert_nbytes, orders=["router"])


def test_profiles_with_a_cpu_round_trip(tmp_path):
    for name in ("rtx4090-pcie4-ddr5", "rtx4090-pcie5-ddr5"):
        p = get_profile(name)
        assert p.has_cpu and p.cost_model().has_cpu
        p.save(tmp_path / f"{name}.json")
        assert HardwareProfile.load(tmp_path / f"{name}.json") == p
    assert get_profile("rtx4090-pcie4-ddr5").h2d_bytes_per_s_cpu_busy == 15e9
    pcie5 = get_profile("rtx4090-pcie5-ddr5")
    assert pcie5.h2d_bytes_per_s == pcie5.cpu_bytes_per_s  # the case where the CPU and PCIe are equal
    # a profile without CPU fields still loads, without a CPU
    old = {k: v for k, v in get_profile("rtx4090-pcie4").to_dict().items()
           if k not in ("cpu_bytes_per_s", "cpu_latency_s", "h2d_bytes_per_s_cpu_busy", "join_s")}
    assert not HardwareProfile.from_dict(old).has_cpu
    assert set(BUILTIN_PROFILES) >= {"rtx4090-pcie4", "rtx4090-pcie4-ddr5", "rtx4090-pcie5-ddr5"}


@pytest.mark.parametrize("field,value", [("cpu_bytes_per_s", 0.0), ("h2d_bytes_per_s_cpu_busy", -1.0),
                                         ("join_s", -1e-6), ("cpu_latency_s", float("nan"))])
def test_profile_cpu_fields_checked(field, value):
    with pytest.raises(ValueError, match=field):
        replace(PROFILE, **{field: value})


def test_transfer_measures_the_cpu_and_its_profile_simulates_hybrid(tmp_path):
    import json

    from crisp_bench.cli import main

    out, prof = tmp_path / "tr.json", tmp_path / "prof.json"
    assert main(["transfer", "--shapes", "tiny", "--widths", "0.25,1.0", "--repeats", "1", "--json", str(out),
                 "--profile-out", str(prof), "--threads", "1"]) == 0
    cpu = [r for r in json.loads(out.read_text())["records"] if r["kind"] == "cpu_expert"]
    assert [r["width"] for r in cpu] == [64, 256] and all(r["cpu_ms"] > 0 for r in cpu)
    measured = HardwareProfile.load(prof)
    assert measured.has_cpu and measured.cpu_bytes_per_s > 0
    trace = synthetic_trace(num_layers=2, num_tokens=24)
    trace.save(tmp_path / "t.npz")
    assert main(["simulate", "--trace", str(tmp_path / "t.npz"), "--plan", "auto", "--profile", "measured",
                 "--profile-file", str(prof), "--target", "native", "--warmup", "4", "--matrix", "hybrid",
                 "--budget", "0.5", "--json", str(tmp_path / "s.json")]) == 0
    labels = {r["label"] for r in json.loads((tmp_path / "s.json").read_text())["records"]}
    assert {"full/static_hybrid/lru", "full/cpu_only/lru", "crisp/hybrid/lru"} <= labels


def test_hybrid_check_says_it_needs_a_gpu(capsys):
    import torch
    from crisp_bench import hybrid_check

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: bench/gpu_check.sh runs the measurement")
    assert hybrid_check.main([]) == 2  # not pytest's own argv
    assert capsys.readouterr().out.startswith("error: bench.hybrid_check needs a CUDA GPU")


@pytest.mark.parametrize("budget_experts", [2, 8, 20])
def test_hybrid_split_moves_rows_not_work(budget_experts):
    """hybrid_split runs the scheduler's neuron split: the same rows computed as hybrid (a split changes
    where rows run, not which), some experts split, never over the budget, never slower than the CPU
    alone; on this toy trace also not slower than whole-expert hybrid."""
    split, hybrid = run("hybrid_split", budget_experts=budget_experts), run("hybrid", budget_experts=budget_experts)
    cpu_only = run("cpu_only", budget_experts=budget_experts)
    assert split.bytes_computed == hybrid.bytes_computed and split.tokens == hybrid.tokens
    assert split.splits > 0 and split.peak_bytes <= budget_experts * SHAPE.expert_nbytes
    t = {name: r.per_order["widest_first"].time_s for name, r in (("split", split), ("hybrid", hybrid),
                                                                   ("cpu", cpu_only))}
    assert t["split"] <= t["cpu"] + 1e-9 and t["split"] <= t["hybrid"] + 1e-9
