"""Three-resource scheduler (issue 11): split_step against brute force over every split and order."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from crisp_runtime.scheduler import (
    CostModel,
    HybridJob,
    Placement,
    flow_shop_makespan,
    plan_step,
    split_makespan,
    split_step,
)


def _brute_force(jobs, join_s):
    """Minimal makespan over every CPU subset and every order of the GPU part."""
    n = len(jobs)
    best = math.inf
    for mask in range(1 << n):
        cpu = [i for i in range(n) if mask >> i & 1]
        gpu = [i for i in range(n) if not mask >> i & 1]
        for order in itertools.permutations(gpu):
            best = min(best, split_makespan(order, cpu, jobs, join_s))
    return best


def _random_jobs(rng, n):
    jobs = []
    for _ in range(n):
        resident = rng.random() < 0.3
        load = 0.0 if resident else rng.uniform(0.1, 8.0)
        jobs.append(HybridJob(load, load * rng.uniform(1.0, 2.0), rng.uniform(0.05, 1.5), rng.uniform(0.2, 6.0)))
    return jobs


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("seed", range(6))
def test_exact_split_equals_brute_force(n, seed):
    rng = random.Random(1000 * n + seed)
    jobs = _random_jobs(rng, n)
    join = rng.choice([0.0, 0.05])
    split = split_step(jobs, placement=Placement.HYBRID, join_s=join)
    assert split.exact
    assert sorted(split.gpu + split.cpu) == list(range(n))
    # the reported makespan is the one of the split it returns, and it is the brute-force optimum
    assert split.makespan == pytest.approx(split_makespan(split.gpu, split.cpu, jobs, join), rel=1e-12)
    assert split.makespan == pytest.approx(_brute_force(jobs, join), rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_heuristic_beyond_exact_limit(seed):
    rng = random.Random(seed)
    n = 7
    jobs = _random_jobs(rng, n)
    exact = split_step(jobs, exact_max=n)
    greedy = split_step(jobs, exact_max=n - 1)
    assert not greedy.exact and exact.exact
    assert greedy.makespan == pytest.approx(split_makespan(greedy.gpu, greedy.cpu, jobs), rel=1e-12)
    all_gpu = split_step(jobs, placement=Placement.GPU).makespan
    assert exact.makespan - 1e-12 <= greedy.makespan <= all_gpu + 1e-12
    for fixed in (Placement.CPU, Placement.STATIC):
        assert greedy.makespan <= split_step(jobs, placement=fixed).makespan + 1e-12
    # measured over 900 random instances of 7-9 jobs: optimal in 94%, worst 1.27x the optimum
    assert greedy.makespan <= 1.3 * exact.makespan


def test_fixed_placements():
    jobs = [HybridJob(0.0, 0.0, 1.0, 3.0), HybridJob(4.0, 6.0, 1.0, 2.0), HybridJob(2.0, 3.0, 0.5, 1.0)]
    assert split_step(jobs, placement=Placement.CPU).makespan == pytest.approx(6.0 + 0.1 - 0.1)
    static = split_step(jobs, placement=Placement.STATIC, join_s=0.25)
    assert static.gpu == (0,) and static.cpu == (1, 2)
    assert static.makespan == pytest.approx(max(1.0, 3.0 + 0.25))
    gpu = split_step(jobs, placement=Placement.GPU)
    assert gpu.cpu == () and gpu.makespan == pytest.approx(flow_shop_makespan(gpu.gpu, [0, 4, 2], [1, 1, 0.5]))


def test_reduced_copy_rate_applies_when_the_cpu_works():
    # One miss: copying at 4 s beats the CPU's 5 s; with a second job on the CPU the copy slows to 8 s.
    jobs = [HybridJob(4.0, 8.0, 0.5, 5.0), HybridJob(3.0, 6.0, 0.5, 1.0)]
    split = split_step(jobs)
    assert split.makespan == pytest.approx(_brute_force(jobs, 0.0))
    assert split.makespan == pytest.approx(6.0)  # both on the CPU: 5 + 1 (a copy while the CPU streams is 8 s)
    assert set(split.cpu) == {0, 1}


@pytest.mark.parametrize("placement", list(Placement))
@pytest.mark.parametrize("tokens", [1, 3, 40])  # python path and tensor path of the grouping
def test_plan_step_places_tasks(placement, tokens):
    torch.manual_seed(tokens)
    nb, full, E, k = 100, 64, 8, 2
    index = torch.stack([torch.randperm(E)[:k] for _ in range(tokens)])
    widths = torch.randint(1, full + 1, (tokens, k))
    resident = {0: full, 3: 10}
    cost = CostModel(h2d_bytes_per_s=1e5, device_bytes_per_s=1e7, cpu_bytes_per_s=2e5, h2d_bytes_per_s_cpu_busy=6e4,
                     join_s=1e-4)
    step = plan_step(index, widths, num_experts=E, neuron_nbytes=nb, resident_width=lambda e: resident.get(e, 0),
                     cost=cost, placement=placement)
    base = plan_step(index, widths, num_experts=E, neuron_nbytes=nb, resident_width=lambda e: resident.get(e, 0),
                     cost=cost)
    # the same slots and widths, grouped the same, only placed and ordered differently
    assert sorted(zip(step.flat_pos.tolist(), step.flat_widths.tolist(), strict=True)) == sorted(
        zip(base.flat_pos.tolist(), base.flat_widths.tolist(), strict=True))
    for t in step.tasks:
        got = sorted(step.flat_pos[t.start:t.stop].tolist())
        assert all(int(index.reshape(-1)[p]) == t.expert for p in got)
        if t.on_cpu:
            assert t.copy_bytes == 0
    flags = [t.on_cpu for t in step.tasks]
    assert flags == sorted(flags)  # GPU tasks first, then the CPU's
    assert step.bytes_missing == sum(t.copy_bytes for t in step.tasks)
    if placement is Placement.GPU:
        assert not any(flags) and step.tasks == base.tasks
    elif placement is Placement.CPU:
        assert all(flags)
    elif placement is Placement.STATIC:
        assert all(t.on_cpu == (t.resident_width < t.width) for t in step.tasks)
    else:
        assert step.extra["makespan"] <= split_step(
            [HybridJob(t.load_time, t.copy_bytes / 6e4, t.compute_time, t.cpu_time) for t in base.tasks],
            placement=Placement.GPU, join_s=1e-4).makespan + 1e-12


def test_cpu_placement_needs_a_cpu_in_the_cost_model():
    with pytest.raises(ValueError, match="cpu_bytes_per_s"):
        plan_step(torch.tensor([[0, 1]]), torch.tensor([[4, 4]]), num_experts=2, neuron_nbytes=1,
                  resident_width=lambda e: 0, placement=Placement.HYBRID)


@pytest.mark.parametrize("field,value", [("cpu_bytes_per_s", 0), ("cpu_bytes_per_s", float("nan")),
                                         ("h2d_bytes_per_s_cpu_busy", -1.0), ("join_s", -1e-3),
                                         ("cpu_ridge_tokens", 0), ("h2d_bytes_per_s", True)])
def test_cost_model_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        CostModel(**{field: value})
