"""The scheduler: Johnson's order against a brute-force flow-shop optimum, grouping against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crisp_runtime.scheduling.scheduler import CostModel, TaskOrder, flow_shop_makespan, johnson_order, plan_step

times = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False)


def brute_force_makespan(load, compute) -> float:
    return min(flow_shop_makespan(p, load, compute) for p in itertools.permutations(range(len(load))))


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6).flatmap(lambda n: st.tuples(st.lists(times, min_size=n, max_size=n),
                                                     st.lists(times, min_size=n, max_size=n))))
def test_johnson_order_is_optimal(jobs):
    load, compute = jobs
    order = johnson_order(load, compute)
    assert sorted(order) == list(range(len(load)))
    assert flow_shop_makespan(order, load, compute) == pytest.approx(brute_force_makespan(load, compute),
                                                                     rel=1e-12, abs=1e-12)


def test_makespan_by_hand():
    # load 2,1 / compute 3,1: order (0, 1): copies end 2, 3; computes end 5, 6.
    assert flow_shop_makespan([0, 1], [2, 1], [3, 1]) == 6
    # order (1, 0): copies end 1, 3; computes end 2, 6.
    assert flow_shop_makespan([1, 0], [2, 1], [3, 1]) == 6
    # load 1,3 / compute 1,1: (0, 1): copies 1, 4 -> computes 2, 5; (1, 0): copies 3, 4 -> computes 4, 5.
    assert flow_shop_makespan([0, 1], [1, 3], [1, 1]) == 5
    assert flow_shop_makespan([0, 1], [1, 1], [3, 1]) == 5


def test_widest_first_when_loads_dominate():
    # Missing experts whose load exceeds compute run by decreasing compute (widest first); cached ones first.
    load = [5.0, 0.0, 8.0, 3.0]
    compute = [0.5, 0.2, 0.8, 0.3]
    assert johnson_order(load, compute) == [1, 2, 0, 3]


def reference_groups(index, widths, num_experts):
    """Brute force: expert -> (max width, sorted list of (flat position, width))."""
    groups = {}
    t, k = index.shape
    for p in range(t * k):
        e, w = int(index.view(-1)[p]), int(widths.view(-1)[p])
        if w > 0 and 0 <= e < num_experts:
            groups.setdefault(e, []).append((p, w))
    return {e: (max(w for _, w in v), v) for e, v in groups.items()}


@st.composite
def routings(draw):
    num_experts = draw(st.integers(1, 10))
    k = draw(st.integers(1, min(num_experts, 4)))
    tokens = draw(st.integers(0, 30))  # crosses the python / tensor grouping threshold (64 slots)
    full = draw(st.integers(1, 16))
    index = torch.tensor([draw(st.permutations(range(num_experts)))[:k] for _ in range(tokens)],
                         dtype=torch.int64).reshape(tokens, k)
    if tokens and draw(st.booleans()):  # padding sentinels
        index[0, -1] = num_experts
    widths = torch.tensor(draw(st.lists(st.integers(0, full), min_size=tokens * k, max_size=tokens * k)),
                          dtype=torch.int64).reshape(tokens, k)
    resident = draw(st.lists(st.integers(0, full), min_size=num_experts, max_size=num_experts))
    return num_experts, index, widths, resident


@settings(max_examples=120, deadline=None)
@given(routings(), st.integers(1, 500))
def test_plan_step_groups_and_bytes(routing, nb):
    num_experts, index, widths, resident = routing
    cost = CostModel(h2d_bytes_per_s=1.0, device_bytes_per_s=7.0, ridge_tokens=4)
    step = plan_step(index, widths, num_experts=num_experts, neuron_nbytes=nb,
                     resident_width=lambda e: resident[e], cost=cost)
    ref = reference_groups(index, widths, num_experts)
    assert sorted(t.expert for t in step.tasks) == sorted(ref)
    for task in step.tasks:
        req, slots = ref[task.expert]
        assert task.width == req
        assert task.resident_width == resident[task.expert]
        assert task.copy_bytes == max(0, req - resident[task.expert]) * nb
        got = sorted(zip(step.flat_pos[task.start:task.stop].tolist(),
                         step.flat_widths[task.start:task.stop].tolist(), strict=True))
        assert got == sorted(slots)
    assert step.bytes_missing == sum(t.copy_bytes for t in step.tasks)
    assert step.bytes_read == sum(r for r, _ in ref.values()) * nb
    assert step.bytes_routed == sum(w for _, v in ref.values() for _, w in v) * nb
    assert step.skipped == index.numel() - sum(len(v) for _, v in ref.values())
    # The order is a flow-shop optimum for the step's own load/compute times.
    load = [t.load_time for t in step.tasks]
    compute = [t.compute_time for t in step.tasks]
    if len(step.tasks) <= 6:
        assert flow_shop_makespan(range(len(load)), load, compute) == pytest.approx(
            brute_force_makespan(load, compute), rel=1e-9, abs=1e-12)


def test_plan_step_cached_first_then_widest():
    index = torch.tensor([[0, 1], [2, 3]])
    widths = torch.tensor([[8, 4], [16, 2]])
    resident = {0: 0, 1: 4, 2: 0, 3: 0}  # expert 1 already resident at 4
    step = plan_step(index, widths, num_experts=4, neuron_nbytes=100, resident_width=resident.get)
    assert [t.expert for t in step.tasks] == [1, 2, 0, 3]
    assert [t.copy_bytes for t in step.tasks] == [0, 1600, 800, 200]


@settings(max_examples=80, deadline=None)
@given(routings())
def test_router_order_is_first_appearance(routing):
    num_experts, index, widths, resident = routing
    kw = dict(num_experts=num_experts, neuron_nbytes=3, resident_width=lambda e: resident[e])
    johnson = plan_step(index, widths, **kw)
    router = plan_step(index, widths, order=TaskOrder.ROUTER, **kw)
    first = []
    for e, w in zip(index.reshape(-1).tolist(), widths.reshape(-1).tolist(), strict=True):
        if w > 0 and 0 <= e < num_experts and e not in first:
            first.append(e)
    assert [t.expert for t in router.tasks] == first
    # Same tasks and slots, only the order differs.
    assert sorted(johnson.tasks, key=lambda t: t.expert) == sorted(
        (t._replace(start=s.start, stop=s.stop) for t, s in zip(
            sorted(router.tasks, key=lambda t: t.expert), sorted(johnson.tasks, key=lambda t: t.expert),
            strict=True)), key=lambda t: t.expert)
    for t in router.tasks:
        assert sorted(router.flat_pos[t.start:t.stop].tolist()) == router.flat_pos[t.start:t.stop].tolist()
    with pytest.raises(ValueError, match="TaskOrder"):
        plan_step(index, widths, order="router", **kw)


def test_plan_step_rejects_bad_shapes():
    with pytest.raises(ValueError, match="must both be"):
        plan_step(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64), num_experts=4,
                  neuron_nbytes=1, resident_width=lambda e: 0)
