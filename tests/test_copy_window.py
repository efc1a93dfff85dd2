"""The modeled copy clock that cuts prefetches (crisp_runtime/scheduling/copy_window.py): the rule on hand-made
steps, its invariants on random ones, and the window as the runtime takes it (PrefetchPolicy.window)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from crisp_bench.profiles import get_profile
from crisp_bench.shapes import TARGETS
from crisp_bench.simulate import neuron_scale, target_window
from runtime_helpers import random_layers

from crisp_runtime import RuntimeConfig
from crisp_runtime.execution.runtime import CrispRuntime
from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.residency.ledger import ResidencyLedger
from crisp_runtime.scheduling.copy_window import CopyClock, Job, PrefetchSpan, PrefetchWindow, admit_requests
from crisp_runtime.scheduling.prefetch import PrefetchPolicy
from crisp_runtime.scheduling.scheduler import CostModel

# One row copies in 1 s (no latency) and computes in 0.25 s; lead 1 s: times are easy to follow by hand.
WINDOW = PrefetchWindow(row_nbytes=100, h2d_bytes_per_s=100.0, copy_latency_s=0.0, compute_bytes_per_s=400.0,
                        compute_latency_s=0.0, lead_s=1.0)


class Widths:
    """A ledger stand-in: resident widths, every issue admitted (or refused for experts in ``refuse``)."""

    def __init__(self, refuse=()) -> None:
        self.w: dict[int, int] = {}
        self.refuse = set(refuse)
        self.asked: list[tuple[int, int]] = []

    def have(self, e: int) -> int:
        return self.w.get(e, 0)

    def issue(self, e: int, width: int):
        self.asked.append((e, width))
        if e in self.refuse:
            return None
        old = self.have(e)
        self.w[e] = width

        class D:
            old_width, new_width = old, width

        return D()


def test_a_request_that_does_not_fit_is_cut_to_the_rows_that_do_and_nothing_follows():
    span = PrefetchSpan(WINDOW, start=0.0, deadline=3.5)  # 3.5 s: 3 whole rows
    got = Widths()
    adm = admit_requests([(0, 5), (1, 2)], got.have, got.issue, span)
    assert got.asked == [(0, 3)]  # 3 of the 5 rows; expert 1 not asked
    assert adm.issued == [(0, 3, 0.0, 3.0)] and adm.cut and span.cut
    assert (adm.cut_requests, adm.cut_rows) == (2, 2 + 2)
    # a later call in the same step (the second phase) admits nothing once cut
    again = admit_requests([(2, 1)], got.have, got.issue, span)
    assert got.asked == [(0, 3)] and again.issued == [] and (again.cut_requests, again.cut_rows) == (1, 1)


def test_whole_requests_fit_in_order_and_a_resident_prefix_only_copies_its_missing_rows():
    span = PrefetchSpan(WINDOW, start=1.0, deadline=10.0)
    got = Widths()
    got.w[1] = 2  # expert 1 holds 2 rows: asking 4 copies rows 2..4
    adm = admit_requests([(0, 3), (1, 4), (2, 1)], got.have, got.issue, span)
    assert adm.issued == [(0, 3, 1.0, 4.0), (1, 4, 4.0, 6.0), (2, 1, 6.0, 7.0)]
    assert not adm.cut and not span.cut and span.cursor == 7.0


def test_copy_latency_counts_before_the_rows_and_a_span_with_no_room_cuts_at_once():
    w = PrefetchWindow(row_nbytes=100, h2d_bytes_per_s=100.0, copy_latency_s=0.5, compute_bytes_per_s=400.0,
                       compute_latency_s=0.0, lead_s=1.0)
    span = PrefetchSpan(w, start=0.0, deadline=2.4)  # 2.4 - 0.5 latency = 1.9 s: one row
    got = Widths()
    adm = admit_requests([(0, 4)], got.have, got.issue, span)
    assert adm.issued == [(0, 1, 0.0, 1.5)] and adm.cut
    full = PrefetchSpan(w, start=2.0, deadline=2.4)  # less than the latency left: nothing
    got2 = Widths()
    adm2 = admit_requests([(0, 1)], got2.have, got2.issue, full)
    assert got2.asked == [] and adm2.cut and adm2.issued == []


def test_a_rejected_request_uses_no_time():
    span = PrefetchSpan(WINDOW, start=0.0, deadline=4.0)
    got = Widths(refuse={0})
    adm = admit_requests([(0, 3), (1, 3)], got.have, got.issue, span)
    assert got.asked == [(0, 3), (1, 3)] and adm.issued == [(1, 3, 0.0, 3.0)] and not adm.cut


def test_without_a_span_every_request_is_asked_whole():
    got = Widths()
    adm = admit_requests([(0, 300), (1, 200)], got.have, got.issue, None)
    assert got.asked == [(0, 300), (1, 200)] and not adm.cut and adm.cut_rows == 0


def test_clock_times_a_step_and_carries_the_prefetch_spill():
    clock = CopyClock(WINDOW)
    # one missed expert (2 rows: copy 2 s, compute 0.5 s) and one hit (1 row: compute 0.25 s)
    t = clock.step([Job(0, 2, WINDOW.load_s(200), WINDOW.compute_s(200)), Job(1, 1, 0.0, WINDOW.compute_s(100))])
    # Johnson: the hit first (compute 1.0-1.25), the copy 1.0-3.0, its compute 3.0-3.5
    assert (t.demand_done, t.end, t.deadline) == (3.0, 3.5, 4.5)
    span = clock.span
    assert span.rows(5) == 1  # 1.5 s to the deadline: one row
    span.took(1)
    assert clock.copy_free == pytest.approx(0.5)  # the prefetch ends at 4.0, 0.5 s after the step
    nxt = clock.step([Job(2, 1, WINDOW.load_s(100), WINDOW.compute_s(100))])
    assert nxt.slots[0].copy_start == 1.0  # at lead: the spill (0.5 s) ended before the router did


@pytest.mark.parametrize("seed", range(5))
def test_a_prefetch_never_delays_a_demanded_copy_and_never_exceeds_the_budget(seed):
    """Random steps: the demanded copies' times with prefetches admitted by the clock equal those of the same
    jobs with no prefetch at all; every prefetch ends by its deadline; a ledger under the clock stays within
    its budget."""
    rng = random.Random(seed)
    window = PrefetchWindow(row_nbytes=64, h2d_bytes_per_s=64 / 2e-5, copy_latency_s=2e-5,
                            compute_bytes_per_s=64 / 2.5e-5, compute_latency_s=1e-6, lead_s=rng.uniform(1e-4, 8e-4))
    inter, layers, experts = 16, 4, 8
    led = ResidencyLedger(5 * inter * 64, {i: 64 for i in range(layers)}, {i: inter for i in range(layers)})
    with_p, without = CopyClock(window), CopyClock(window)
    cut_seen = whole_seen = False
    for step in range(200):
        layer = step % layers
        chosen = rng.sample(range(experts), 2)
        jobs = []
        for e in chosen:
            width = rng.choice((4, 8, 12, 16))
            d = led.request(layer, e, width, protected={(layer, x) for x in chosen})
            jobs.append(window.job(e, width, d.new_width - d.old_width))
        a, b = with_p.step(jobs), without.step(jobs)
        assert a.slots == b.slots and a.end == b.end  # the prefetch never moved a demanded copy
        nxt = (layer + 1) % layers
        asked = [(e, rng.choice((4, 8, 16))) for e in rng.sample(range(experts), 3)]
        protected = {(layer, e) for e in chosen} | {(nxt, e) for e, _ in asked}
        adm = admit_requests(asked, lambda e, nxt=nxt: led.width(nxt, e),
                             lambda e, w, nxt=nxt, keep=protected: led.prefetch(nxt, e, w, protected=keep), with_p.span)
        for _, _, begin, end in adm.issued:
            assert a.demand_done <= begin and end <= a.deadline + 1e-12
        cut_seen |= adm.cut
        whole_seen |= bool(adm.issued) and not adm.cut
        assert led.used <= led.budget and led.peak <= led.budget
    assert cut_seen and whole_seen  # both cases happened


def test_window_from_a_profile_models_mixtral_rows_on_a_tiny_model():
    profile, shape = get_profile("rtx4090-pcie4"), TARGETS["mixtral-8x7b"]
    w = target_window(profile, shape, 256)
    scale = neuron_scale(256, shape)
    assert scale == 56 and w.row_nbytes == shape.neuron_nbytes * scale
    # a whole tiny expert (256 rows) copies and computes like one Mixtral expert, bit for bit
    assert w.load_s(256 * w.row_nbytes) == profile.load_s(shape.expert_nbytes)
    assert w.compute_s(256 * w.row_nbytes) == profile.compute_s(shape.expert_nbytes)
    assert w.lead_s == profile.other_s + profile.router_s and w.name == "rtx4090-pcie4/mixtral-8x7b"
    assert math.isclose(w.load_s(256 * w.row_nbytes), 7.5e-3)  # the paper's full-width load
    with pytest.raises(ValueError, match="does not divide"):
        target_window(profile, shape, 300)


@pytest.mark.parametrize(("field", "value"), [("row_nbytes", 0), ("row_nbytes", 1.5), ("h2d_bytes_per_s", 0.0),
                                              ("compute_bytes_per_s", float("inf")), ("copy_latency_s", -1.0),
                                              ("lead_s", float("nan")), ("compute_latency_s", True)])
def test_bad_windows_are_refused(field, value):
    kw = {"row_nbytes": 100, "h2d_bytes_per_s": 1.0, "copy_latency_s": 0.0, "compute_bytes_per_s": 1.0,
          "compute_latency_s": 0.0, "lead_s": 0.0, field: value}
    with pytest.raises(ValueError, match=field):
        PrefetchWindow(**kw)


def test_prefetch_policy_window_default_none_and_in_its_record():
    assert PrefetchPolicy().window is None and "window" not in PrefetchPolicy().to_dict()
    assert PrefetchPolicy(window=WINDOW).to_dict()["window"]["row_nbytes"] == 100
    with pytest.raises(ValueError, match="window"):
        PrefetchPolicy(window="rtx4090-pcie4")


def test_runtime_with_a_window_cuts_and_counts_and_refuses_a_cpu_placement():
    layers = random_layers(layer_ids=(0, 1), num_experts=4, inter=16, hidden=64)
    nb = layers[0].fmt.neuron_nbytes(64)
    plan = CrispPlan.full(4, 2, 16, [0, 1])
    # a row copies in 1 ms, computes in 0.1 ms, lead 2 ms: after a step of two hits, ~2.2 ms for a prefetch
    window = PrefetchWindow(row_nbytes=nb, h2d_bytes_per_s=nb / 1e-3, copy_latency_s=0.0,
                            compute_bytes_per_s=nb / 1e-4, compute_latency_s=0.0, lead_s=2e-3)
    runtime = CrispRuntime(layers, plan, device="cpu", gpu_budget=4 * 16 * nb,
                           config=RuntimeConfig(prefetch=PrefetchPolicy(window=window)))
    index, weights = torch.tensor([[0, 1]]), torch.tensor([[0.6, 0.4]])
    runtime.forward(0, torch.randn(1, 64), index, weights)  # two misses: the clock times their copies
    runtime.forward(0, torch.randn(1, 64), index, weights)  # two hits: the step ends at 2 + 2 x 1.6 ms
    got = runtime.prefetch(1, [(2, 16), (3, 16)])
    stats = runtime.stats.as_dict()
    # the span: demand done at lead (2 ms, nothing copied), deadline 5.2 + 2 ms: 5.2 ms = 5 whole rows of expert 2
    assert [(d.key, d.new_width) for d in got] == [((1, 2), 5)]
    assert stats["prefetch_cut"] == 2 and stats["prefetch_cut_rows"] == 11 + 16
    assert runtime.prefetch(1, [(3, 4)]) == []  # the span is cut: a second phase admits nothing
    plain = CrispRuntime(layers, plan, device="cpu", gpu_budget=4 * 16 * nb, config=RuntimeConfig())
    plain.forward(0, torch.randn(1, 64), index, weights)
    assert [d.new_width for d in plain.prefetch(1, [(2, 16), (3, 16)])] == [16, 16]  # no window: whole
    with pytest.raises(ValueError, match="window"):
        CrispRuntime(layers, plan, device="cpu", gpu_budget=4 * 16 * nb,
                     config=RuntimeConfig(prefetch=PrefetchPolicy(window=window), serving="hybrid",
                                          cost=CostModel(h2d_bytes_per_s=1e9, device_bytes_per_s=1e9,
                                                         cpu_bytes_per_s=1e9)))
