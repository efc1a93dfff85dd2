"""A discrete-event simulation of batch-1 decoding with experts offloaded to host memory.

Per token, MoE layer after MoE layer (the next layer starts when the previous one ends):

    compute engine: other (attention, norms)  ->  router  ->  expert computes
    copy engine:                                         expert copies (H2D)

The router decides which experts the layer needs and at which width (the policy's
``CrispPlan``); the device cache (:class:`PrefixCache`) says what is resident; each routed
expert becomes a job (load time of its missing bytes, compute time of its width). Copies
and computes of different experts overlap as a two-stage flow shop: the copy engine copies
one expert after another; an expert's compute starts when its copy is done and the compute
engine is free; computes run in the same order as copies (a permutation schedule). Orders:

    serial        load expert, compute it, then the next: nothing overlaps (the paper's
                  layer breakdown adds up like this)
    router        overlapped, in router order (slot order of top_k_index)
    widest_first  overlapped, Johnson's rule: jobs whose load is shorter than their compute
                  first by increasing load (cache hits, load 0, lead), then the rest by
                  decreasing compute time, i.e. widest first; the last compute, which nothing
                  hides, is the narrowest. Johnson's order is optimal for the two-stage flow
                  shop, so it is never slower than ``router``.

Device cache: a byte budget over (layer, expert) prefixes, shared by all layers, with the
runtime's semantics: an expert whose resident prefix is at least as wide as needed is a hit
(no copy); a narrower resident prefix is widened by copying only the missing rows; a miss
copies the whole prefix. Before a layer's copies, least recently used entries that the
layer does not need are evicted whole until the missing bytes fit. The budget must hold one
layer's working set (``top_k`` full-width experts), else :class:`BudgetTooSmall`. With
``cache_scope="layer"`` the budget is split evenly into one such cache per layer instead
(mixtral-offloading's fixed per-layer expert slots). A global LRU cycles through the layers
in a loop, so below one token's working set (top_k of E experts per layer: 25% for Mixtral)
it evicts exactly what the next token needs first; the budget sweep shows that step.

Everything here is plain Python and deterministic; times are seconds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .profiles import HardwareProfile, ModelShape

ORDERS = ("serial", "router", "widest_first")
# Eviction, as the runtime's policies (crisp_runtime/eviction.py): "lru" evicts the least recently
# used entry; "frequency" the least often used one (use counts kept across evictions, ties LRU),
# which suits decoding's cyclic walk over the layers, where LRU evicts what the next token needs.
EVICTIONS = ("lru", "frequency")


class BudgetTooSmall(ValueError):
    """The cache budget cannot hold one layer step's experts."""


# ---------------------------------------------------------------------------- flow shop


@dataclass(frozen=True)
class Job:
    """One routed expert in one layer step."""

    expert: int
    width: int  # neurons computed (> 0)
    load_s: float  # copy time of its missing bytes (0 for a cache hit)
    compute_s: float


@dataclass(frozen=True)
class Slot:
    """When a job's copy and compute ran (copy_start == copy_end for a hit)."""

    expert: int
    copy_start: float
    copy_end: float
    compute_start: float
    compute_end: float


def johnson_order(jobs: Sequence[Job]) -> list[Job]:
    """Johnson's rule for the two-stage flow shop, tie-broken as ``crisp_runtime.scheduler.johnson_order``
    (equal loads: wider first; then router order)."""
    pos = {id(j): i for i, j in enumerate(jobs)}
    first = sorted((j for j in jobs if j.load_s < j.compute_s), key=lambda j: (j.load_s, -j.compute_s, pos[id(j)]))
    last = sorted((j for j in jobs if j.load_s >= j.compute_s), key=lambda j: (-j.compute_s, pos[id(j)]))
    return first + last


def schedule(jobs: Sequence[Job], order: str, start: float = 0.0) -> tuple[float, list[Slot]]:
    """Times of one layer's experts from ``start`` (the router's end); returns (end, slots)."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}")
    slots: list[Slot] = []
    if order == "serial":
        t = start
        for j in jobs:
            copy_end = t + j.load_s
            end = copy_end + j.compute_s
            slots.append(Slot(j.expert, t, copy_end, copy_end, end))
            t = end
        return t, slots
    seq = list(jobs) if order == "router" else johnson_order(jobs)
    copy_free = compute_free = start
    for j in seq:
        if j.load_s > 0:
            copy_start, copy_end = copy_free, copy_free + j.load_s
            copy_free = copy_end
        else:
            copy_start = copy_end = start
        compute_start = max(copy_end, compute_free)
        compute_free = compute_start + j.compute_s
        slots.append(Slot(j.expert, copy_start, copy_end, compute_start, compute_free))
    return max(copy_free, compute_free), slots


def flow_shop_bound(jobs: Sequence[Job]) -> float:
    """A lower bound on any schedule's makespan: max(all loads + last compute, first load + all computes)."""
    if not jobs:
        return 0.0
    loads = sum(j.load_s for j in jobs)
    computes = sum(j.compute_s for j in jobs)
    return max(loads + min(j.compute_s for j in jobs), min(j.load_s for j in jobs) + computes)


# ---------------------------------------------------------------------------- cache


@dataclass
class CacheStats:
    hits: int = 0  # resident prefix wide enough: no copy
    widened: int = 0  # resident but narrower: only missing rows copied
    misses: int = 0  # not resident
    bytes_copied: int = 0
    evictions: int = 0

    @property
    def accesses(self) -> int:
        return self.hits + self.widened + self.misses


class PrefixCache:
    """Expert prefixes on the device under a byte budget; whole entries evicted (LRU or least used)."""

    def __init__(self, budget_bytes: int, neuron_nbytes: int, eviction: str = "lru"):
        if eviction not in EVICTIONS:
            raise ValueError(f"unknown eviction {eviction!r}; choose one of {', '.join(EVICTIONS)}")
        self.budget = int(budget_bytes)
        self.neuron_nbytes = int(neuron_nbytes)
        self.eviction = eviction
        self.entries: OrderedDict[tuple[int, int], int] = OrderedDict()  # key -> resident width; LRU first
        self.uses: dict[tuple[int, int], int] = {}  # accesses per key, kept across evictions
        self.used = 0
        self.stats = CacheStats()

    def _victims(self):
        """Resident keys in eviction order."""
        if self.eviction == "lru":
            return list(self.entries)
        lru_rank = {key: i for i, key in enumerate(self.entries)}
        return sorted(self.entries, key=lambda key: (self.uses.get(key, 0), lru_rank[key]))

    def resident(self, layer: int, expert: int) -> int:
        return self.entries.get((layer, expert), 0)

    def step(self, layer: int, needed: dict[int, int]) -> dict[int, int]:
        """Make ``needed`` (expert -> width, router order) resident; returns expert -> bytes copied."""
        nb = self.neuron_nbytes
        missing = {e: max(0, w - self.resident(layer, e)) * nb for e, w in needed.items()}
        want = sum(missing.values())
        pinned = {(layer, e) for e in needed}
        if self.used + want > self.budget:
            for key in self._victims():
                if self.used + want <= self.budget:
                    break
                if key in pinned:
                    continue
                self.used -= self.entries.pop(key) * nb
                self.stats.evictions += 1
        if self.used + want > self.budget:
            raise BudgetTooSmall(
                f"a {self.budget / 1e6:.1f} MB cache cannot hold layer {layer}'s experts "
                f"{dict(needed)} ({(self.used + want) / 1e6:.1f} MB)"
            )
        for e, w in needed.items():
            key = (layer, e)
            r = self.entries.get(key, 0)
            if missing[e] == 0:
                self.stats.hits += 1
            elif r > 0:
                self.stats.widened += 1
            else:
                self.stats.misses += 1
            if w > r:
                self.entries[key] = w
                self.used += (w - r) * nb
            self.entries.move_to_end(key)
            self.uses[key] = self.uses.get(key, 0) + 1
        self.stats.bytes_copied += want
        return missing


# ---------------------------------------------------------------------------- decoding


@dataclass
class OrderTotals:
    time_s: float = 0.0
    expert_s: float = 0.0  # from router end to layer end (copies + computes not hidden)
    bound_s: float = 0.0  # other + router + the flow-shop lower bound of the expert part


@dataclass
class SimResult:
    """Totals of one simulated run (one policy, one budget), per order."""

    tokens: int
    layers: int
    bytes_copied: int
    bytes_computed: int
    stats: CacheStats
    load_s: float  # sum of copy durations
    compute_s: float  # sum of expert compute durations
    router_s: float
    other_s: float
    experts_run: int
    per_order: dict[str, OrderTotals] = field(default_factory=dict)

    def tokens_per_s(self, order: str) -> float:
        t = self.per_order[order].time_s
        return self.tokens / t if t > 0 else float("inf")

    def summary(self, order: str) -> dict:
        """A flat record of this run under one order (times in ms per MoE layer)."""
        steps = max(1, self.tokens * self.layers)
        tot = self.per_order[order]
        st = self.stats
        return {
            "order": order,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s(order),
            "ms_per_token": 1e3 * tot.time_s / max(1, self.tokens),
            "bytes_per_token": self.bytes_copied / max(1, self.tokens),
            "bytes_computed_per_token": self.bytes_computed / max(1, self.tokens),
            "hit_rate": st.hits / st.accesses if st.accesses else 0.0,
            "widened_rate": st.widened / st.accesses if st.accesses else 0.0,
            "experts_per_layer": self.experts_run / steps,
            "layer_ms": 1e3 * tot.time_s / steps,
            "load_ms": 1e3 * self.load_s / steps,
            "compute_ms": 1e3 * self.compute_s / steps,
            "router_ms": 1e3 * self.router_s / steps,
            "other_ms": 1e3 * self.other_s / steps,
            "expert_phase_ms": 1e3 * tot.expert_s / steps,
            "flow_shop_bound_ms": 1e3 * tot.bound_s / steps,
        }


def needed_experts(index_row: Iterable[int], width_row: Iterable[int]) -> dict[int, int]:
    """expert -> width for one layer step (router order; the widest any slot needs; 0 dropped)."""
    needed: dict[int, int] = {}
    for e, w in zip(index_row, width_row, strict=True):
        e, w = int(e), int(w)
        if w > 0 and e >= 0:
            needed[e] = max(needed.get(e, 0), w)
    return needed


def simulate_decode(
    index,
    widths,
    profile: HardwareProfile,
    shape: ModelShape,
    budget_bytes: int,
    orders: Sequence[str] = ORDERS,
    warmup: int = 0,
    progress=None,
    cache_scope: str = "global",
    eviction: str = "lru",
) -> SimResult:
    """Decode ``T`` tokens one at a time through ``L`` MoE layers.

    index, widths: nested sequences (or arrays) of shape (T, L, k): routed expert ids and the
    width (neurons of ``shape``) each slot needs; width 0 = skipped. The first ``warmup``
    tokens run (filling the cache) but are not counted.
    """
    for o in orders:
        if o not in ORDERS:
            raise ValueError(f"unknown order {o!r}; choose one of {', '.join(ORDERS)}")
    if cache_scope not in ("global", "layer"):
        raise ValueError(f"cache_scope must be 'global' or 'layer', got {cache_scope!r}")
    min_budget = shape.top_k * shape.expert_nbytes * (shape.num_layers if cache_scope == "layer" else 1)
    if budget_bytes < min_budget:
        raise BudgetTooSmall(
            f"GPU budget of {budget_bytes:,} bytes ({budget_bytes / shape.total_expert_nbytes:.1%} of the expert "
            f"bytes) is smaller than one layer's working set ({shape.top_k} full-width experts = {min_budget:,} bytes, "
            f"{min_budget / shape.total_expert_nbytes:.1%})"
        )
    num_tokens = len(index)
    if warmup >= num_tokens:
        raise ValueError(f"warmup ({warmup}) must be smaller than the number of tokens ({num_tokens})")
    stats = CacheStats()
    if cache_scope == "global":
        shared = PrefixCache(budget_bytes, shape.neuron_nbytes, eviction)
        caches = [shared] * shape.num_layers
    else:
        caches = [PrefixCache(budget_bytes // shape.num_layers, shape.neuron_nbytes, eviction)
                  for _ in range(shape.num_layers)]
    for c in caches:
        c.stats = stats
    nb = shape.neuron_nbytes
    res = SimResult(0, shape.num_layers, 0, 0, stats, 0.0, 0.0, 0.0, 0.0, 0,
                    {o: OrderTotals() for o in orders})
    for t in range(num_tokens):
        counting = t >= warmup
        if t == warmup:
            res.stats = CacheStats()
            for c in caches:
                c.stats = res.stats
        for layer in range(shape.num_layers):
            needed = needed_experts(index[t][layer], widths[t][layer])
            missing = caches[layer].step(layer, needed)
            if not counting:
                continue
            jobs = [Job(e, w, profile.load_s(missing[e]), profile.compute_s(w * nb)) for e, w in needed.items()]
            res.bytes_copied += sum(missing.values())
            res.bytes_computed += sum(w * nb for w in needed.values())
            res.load_s += sum(j.load_s for j in jobs)
            res.compute_s += sum(j.compute_s for j in jobs)
            res.router_s += profile.router_s
            res.other_s += profile.other_s
            res.experts_run += len(jobs)
            lead = profile.other_s + profile.router_s
            bound = flow_shop_bound(jobs)
            for o in orders:
                end, _ = schedule(jobs, o)
                tot = res.per_order[o]
                tot.time_s += lead + end
                tot.expert_s += end
                tot.bound_s += lead + bound
        if counting:
            res.tokens += 1
        if progress is not None:
            progress(t + 1, num_tokens)
    return res


# ---------------------------------------------------------------------------- policies at a budget


def simulate_policies(
    mapped: dict[str, tuple],
    profile: HardwareProfile,
    shape: ModelShape,
    budget_fraction: float,
    orders: Sequence[str] = ORDERS,
    warmup: int = 0,
    progress=None,
    cache_scope: str = "global",
    eviction: str = "lru",
) -> list[dict]:
    """One record per (policy, order): ``mapped`` is policy -> (index, widths), each (T, L, k)."""
    budget = int(budget_fraction * shape.total_expert_nbytes)
    records = []
    for policy, (index, widths) in mapped.items():
        res = simulate_decode(index, widths, profile, shape, budget, orders, warmup,
                              progress=None if progress is None else (lambda d, n, p=policy: progress(p, d, n)),
                              cache_scope=cache_scope, eviction=eviction)
        for o in orders:
            rec = {"policy": policy, "budget_fraction": budget_fraction, "budget_bytes": budget,
                   "cache_scope": cache_scope, "eviction": eviction, **res.summary(o)}
            records.append(rec)
    return records
