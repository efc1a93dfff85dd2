"""The residency ledger against a brute-force replay (demand and prefetch), and its error cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crisp_runtime import CacheBudgetError, FrequencyPolicy, LRUPolicy
from crisp_runtime.residency.ledger import ResidencyLedger

NB = {0: 7, 3: 11}  # bytes per neuron differ per layer so that bytes, not widths, decide eviction
FULL = {0: 12, 3: 12}


class BruteLedger:
    """Naive LRU replay (lists, full scans), written independently of crisp_runtime.residency.ledger."""

    def __init__(self, budget):
        self.budget = budget
        self.widths = {}
        self.recency = []  # least recent first
        self.log = []

    def used(self):
        return sum(w * NB[k[0]] for k, w in self.widths.items())

    def _touch(self, key):
        if key in self.recency:
            self.recency.remove(key)
        self.recency.append(key)

    def _evict_until(self, extra, allowed):
        evicted = []
        while self.used() + extra > self.budget:
            victim = next(k for k in self.recency if allowed(k))
            evicted.append((victim, self.widths.pop(victim)))
            self.recency.remove(victim)
        return tuple(evicted)

    def request(self, key, width, pending):
        have = self.widths.get(key, 0)
        if have >= width:
            self._touch(key)
            self.log.append((key, "hit", have, have, 0, ()))
            return
        extra = (width - have) * NB[key[0]]
        evicted = []
        while self.used() + extra > self.budget:
            cands = [k for k in self.recency if k not in pending and k != key] or [k for k in self.recency if k != key]
            victim = cands[0]
            evicted.append((victim, self.widths.pop(victim)))
            self.recency.remove(victim)
        self.widths[key] = width
        self._touch(key)
        self.log.append((key, "widen" if have else "miss", have, width, extra, tuple(evicted)))

    def prefetch(self, key, width, protected):
        have = self.widths.get(key, 0)
        if have >= width:
            self.log.append((key, "noop"))
            return
        extra = (width - have) * NB[key[0]]
        keep = set(protected) | {key}
        if sum(w * NB[k[0]] for k, w in self.widths.items() if k in keep) + extra > self.budget:
            self.log.append((key, "rejected"))
            return
        evicted = self._evict_until(extra, lambda k: k not in keep)
        self.widths[key] = width
        if key not in self.recency:
            self.recency.append(key)  # a new key enters as most recent; a widened one keeps its place
        self.log.append((key, "prefetch", have, width, extra, evicted))


steps_strategy = st.lists(
    st.tuples(
        st.dictionaries(st.tuples(st.sampled_from([0, 3]), st.integers(0, 4)), st.integers(1, 12), min_size=1,
                        max_size=3),
        st.lists(st.tuples(st.sampled_from([0, 3]), st.integers(0, 4), st.integers(1, 12)), max_size=3),
    ),
    min_size=1, max_size=14,
)


@settings(max_examples=120, deadline=None)
@given(steps_strategy, st.integers(0, 80))
def test_ledger_equals_brute_force_replay(steps, extra_budget):
    budget = 3 * 12 * max(NB.values()) + extra_budget  # a step's three experts always fit at full width
    ledger = ResidencyLedger(budget, NB, FULL, LRUPolicy())
    brute = BruteLedger(budget)
    log = []
    for demand, prefetches in steps:
        pending = set(demand)
        for key, width in demand.items():
            pending.discard(key)
            d = ledger.request(key[0], key[1], width, protected=pending)
            brute.request(key, width, pending)
            log.append((key, d.kind, d.old_width, d.new_width, d.copy_bytes, d.evicted))
            assert ledger.used <= budget
        protected = set(demand)
        for layer_id, e, width in prefetches:
            d = ledger.prefetch(layer_id, e, width, protected=protected)
            brute.prefetch((layer_id, e), width, protected)
            if d is None:
                log.append(((layer_id, e), "noop" if ledger.width(layer_id, e) >= width else "rejected"))
            else:
                assert d.prefetch and not any(k in protected for k, _ in d.evicted)
                log.append(((layer_id, e), "prefetch", d.old_width, d.new_width, d.copy_bytes, d.evicted))
                protected.add((layer_id, e))
            for key in demand:  # a prefetch never evicts what the current step needs
                assert ledger.width(*key) >= demand[key]
            assert ledger.used <= budget
        assert ledger.resident() == brute.widths
    assert log == brute.log
    assert ledger.used == sum(w * NB[k[0]] for k, w in ledger.resident().items())
    assert ledger.peak <= budget
    c = ledger.counters
    kinds = [entry[1] for entry in log]
    assert (c.hits, c.misses, c.widenings) == (kinds.count("hit"), kinds.count("miss"), kinds.count("widen"))
    assert c.prefetches == kinds.count("prefetch") and c.prefetch_rejected == kinds.count("rejected")


def test_prefetch_hit_and_unused_counters():
    ledger = ResidencyLedger(2 * 12 * 7, {0: 7}, {0: 12})
    assert ledger.prefetch(0, 1, 6).copy_bytes == 6 * 7
    d = ledger.request(0, 1, 4)
    assert d.kind == "hit" and ledger.counters.prefetch_hits == 1
    assert ledger.request(0, 1, 5).kind == "hit" and ledger.counters.prefetch_hits == 1  # counted once
    ledger.prefetch(0, 2, 12)
    ledger.request(0, 3, 12, protected={(0, 1)})  # evicts the unused prefetch of expert 2
    assert ledger.counters.prefetch_unused == 1 and ledger.width(0, 2) == 0
    assert ledger.prefetch(0, 3, 12) is None  # already resident: no-op


def test_prefetch_rejected_changes_nothing():
    ledger = ResidencyLedger(20 * 7, {0: 7}, {0: 12})
    ledger.request(0, 0, 12)
    ledger.request(0, 1, 4)
    before = ledger.resident()
    assert ledger.prefetch(0, 2, 10, protected={(0, 0)}) is None  # would need to evict expert 0
    assert ledger.resident() == before and ledger.counters.prefetch_rejected == 1
    d = ledger.prefetch(0, 2, 8, protected={(0, 0)})  # fits by evicting expert 1 only
    assert d.evicted == (((0, 1), 4),) and ledger.width(0, 0) == 12


def test_widening_copies_only_missing_rows_and_frequency_policy():
    ledger = ResidencyLedger(30 * 7, {0: 7}, {0: 12}, FrequencyPolicy())
    assert ledger.request(0, 2, 4).copy_bytes == 4 * 7
    d = ledger.request(0, 2, 10)
    assert (d.kind, d.old_width, d.new_width, d.copy_bytes) == ("widen", 4, 10, 6 * 7)
    ledger.request(0, 2, 1)
    ledger.request(0, 3, 10)
    d = ledger.request(0, 4, 12)  # expert 3 used once, expert 2 three times: 3 goes
    assert d.evicted == (((0, 3), 10),)


@pytest.mark.parametrize("bad, match", [
    (dict(budget_bytes=0), "positive"), (dict(budget_bytes=True), "positive"),
    (dict(full_width={1: 12}), "same layers"), (dict(neuron_nbytes={0: 0}), "positive"),
    (dict(policy="lru"), "EvictionPolicy"),
])
def test_constructor_errors(bad, match):
    kw = dict(budget_bytes=100, neuron_nbytes={0: 7}, full_width={0: 12}, policy=None) | bad
    with pytest.raises((ValueError, TypeError), match=match):
        ResidencyLedger(**kw)


def test_request_errors():
    ledger = ResidencyLedger(5 * 7, {0: 7}, {0: 12})
    with pytest.raises(ValueError, match="out of range"):
        ledger.request(0, 0, 13)
    with pytest.raises(KeyError, match="no layer 5"):
        ledger.request(5, 0, 1)
    with pytest.raises(CacheBudgetError, match="exceeds the whole budget"):
        ledger.request(0, 0, 6)
    ledger.request(0, 0, 5)
    with pytest.raises(CacheBudgetError, match="cannot fit"):
        ledger.request(0, 1, 1, protected={(0, 0)}, weak_protected={(0, 0)})


@pytest.mark.parametrize("budget", [1, 7 * 12 - 1, 7 * 12, 7 * 12 + 11 * 12, 7 * 12 * 2 + 11 * 12, 7 * 12 * 3, 10_000])
def test_pin_most_used_keeps_the_most_used_that_fit(budget):
    """The static hot set: most uses first (ties by key), full width, nothing evicted; a key that does not
    fit is skipped while a later, smaller one may still fit. Checked against a direct greedy replay."""
    from crisp_runtime.residency.ledger import pin_most_used

    counts = {(3, 1): 5, (0, 2): 5, (0, 0): 9, (3, 0): 1, (0, 1): 2}
    order = [(0, 0), (0, 2), (3, 1), (0, 1), (3, 0)]  # by count, then key: (0, 2) before (3, 1) at 5 uses
    expected, used = [], 0
    for layer, e in order:
        if used + NB[layer] * FULL[layer] <= budget:
            expected.append((layer, e))
            used += NB[layer] * FULL[layer]
    led = ResidencyLedger(budget, neuron_nbytes=NB, full_width=FULL)
    pinned = pin_most_used(counts, {0: led, 3: led}, FULL)
    assert pinned == expected
    assert led.resident() == {key: FULL[key[0]] for key in expected}
    assert led.used == used <= budget
    assert led.counters.evictions == 0
    if budget == 7 * 12 * 3:  # (3, 1) does not fit after the two layer-0 experts; (0, 1) still does
        assert pinned == [(0, 0), (0, 2), (0, 1)]
