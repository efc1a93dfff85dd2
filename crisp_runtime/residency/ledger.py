"""The residency ledger: which expert prefixes are resident at which width, under a hard byte budget.

Tensor-free and deterministic. It is the one residency model of the project: the runtime's
:class:`~crisp_runtime.residency.device_cache.PrefixCache` moves tensors exactly as the ledger decides,
and the simulator replays traces through the same ledger, so both see identical hits,
misses, widenings, evictions and bytes for the same sequence of requests.

API
---

``ResidencyLedger(budget_bytes, neuron_nbytes={layer: bytes}, full_width={layer: neurons}, policy=None)``

- ``width(layer, expert) -> int``: resident prefix width (0 = not resident).
- ``resident() -> {(layer, expert): width}``; ``used`` / ``peak`` / ``budget`` in bytes;
  ``nbytes(layer, width)``.
- ``request(layer, expert, width, protected=(), weak_protected=()) -> Decision``: demand.
  Makes the key resident at ``width`` or wider. ``kind`` is "hit" (nothing copied), "widen"
  (rows ``old_width..new_width`` copied) or "miss" (rows ``0..new_width``). Before a copy the
  policy's victims are evicted, in ``Decision.evicted`` order, until the new rows fit:
  first among keys not in ``protected``; when nothing else can go, keys in ``protected`` but
  not in ``weak_protected`` (a step whose experts do not fit at once runs as a stream).
  The requested key is never evicted. Raises :class:`CacheBudgetError` when it cannot fit.
- ``prefetch(layer, expert, width, protected=()) -> Decision | None``: a copy ahead of
  demand. Admitted only if it fits after evicting keys outside ``protected`` (pass the
  current step's keys and the other prefetches of the batch): it never evicts what the
  current step needs, and it is checked *before* anything is evicted, so a rejected
  prefetch changes nothing (returns None). A key already resident at ``width`` or wider is
  a no-op (returns None). A prefetch is not a use: eviction policies see ``on_insert`` for
  a new key and nothing for a widening.
- ``request_transient(layer, expert, width, room, protected=(), weak_protected=()) -> Decision``: a
  demand whose missing rows may go to the step's transient buffer (the neuron split's
  ``ServingPolicy.transient_buffer``). A hit as ``request``; rows that fit in the free budget are
  admitted as ``request`` admits them (nothing evicted); otherwise, if they fit in ``room`` (the
  bytes of the step's buffer not yet used), kind "transient": rows ``old_width..width`` copied into
  the buffer, nothing admitted or evicted, the resident width unchanged (``new_width == old_width``);
  otherwise as ``request`` (evicting: a prefill step beyond what the buffer holds).
- ``evict(key) -> int`` (bytes freed), ``clear()``.
- ``counters``: :class:`LedgerCounters` (demand hits / misses / widenings, evictions, bytes
  copied on demand, prefetches admitted / rejected, prefetched bytes, prefetch hits = a
  demand served without a copy by a prefetch not yet used, prefetches evicted unused; transient
  copies and their bytes, which ``bytes_copied`` includes).

:func:`transient_rows` / :func:`transient_buffer_bytes`: the size of that buffer, which the GPU budget
gives up (the ledger's budget is the GPU budget minus the buffer).

Eviction policies (``crisp_runtime.residency.eviction``) only order keys; the ledger owns bytes and
budget and calls the policy's hooks ``on_insert`` / ``on_use`` / ``on_remove`` / ``victim``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from typing import NamedTuple

from crisp_runtime.residency.eviction import EvictionPolicy, Key, LRUPolicy

HIT, WIDEN, MISS, TRANSIENT = "hit", "widen", "miss", "transient"


class CacheBudgetError(RuntimeError):
    """The prefixes one layer step needs at the same time do not fit in the budget."""


class Decision(NamedTuple):
    """What one request did. Rows ``old_width..new_width`` were copied (none for a hit).

    A NamedTuple rather than a frozen dataclass: one is built per expert call, and a tuple is
    built ~4x faster (the hot path's budget is a few microseconds per expert).
    """

    key: Key
    kind: str  # "hit", "widen", "miss" or "transient"
    width: int  # the width requested
    old_width: int  # resident width before (0 = not resident)
    new_width: int  # resident width after (>= width; == old_width for "transient": nothing admitted)
    copy_bytes: int  # bytes of rows old_width..new_width (0 for a hit)
    evicted: tuple[tuple[Key, int], ...] = ()  # (key, width it had), in eviction order
    prefetch: bool = False  # this decision is a prefetch (not a demand)
    from_prefetch: bool = False  # a demand hit on a prefetched prefix not used before

    @property
    def evictions(self) -> int:
        return len(self.evicted)


@dataclass
class LedgerCounters:
    hits: int = 0
    misses: int = 0
    widenings: int = 0
    evictions: int = 0
    bytes_copied: int = 0  # demand copies only
    prefetches: int = 0  # admitted
    prefetch_rejected: int = 0
    prefetch_bytes: int = 0
    prefetch_hits: int = 0  # demands served with no copy thanks to a prefetch not yet used
    prefetch_unused: int = 0  # prefetched prefixes evicted before any demand
    transients: int = 0  # demands whose missing rows went to the step's transient buffer (not admitted)
    transient_bytes: int = 0  # their bytes (also in bytes_copied)

    def as_dict(self) -> dict:
        return asdict(self)


class ResidencyLedger:
    """Resident prefix widths per ``(layer, expert)`` under ``budget_bytes``; see the module docstring."""

    def __init__(self, budget_bytes: int, neuron_nbytes: Mapping[int, int], full_width: Mapping[int, int],
                 policy: EvictionPolicy | None = None) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"ResidencyLedger: budget must be a positive number of bytes, got {budget_bytes!r}")
        if set(neuron_nbytes) != set(full_width):
            raise ValueError(f"ResidencyLedger: neuron_nbytes has layers {sorted(neuron_nbytes)}, full_width has "
                             f"{sorted(full_width)}; expected the same layers")
        for layer_id, nb in neuron_nbytes.items():
            if int(nb) <= 0 or int(full_width[layer_id]) <= 0:
                raise ValueError(f"ResidencyLedger: layer {layer_id} needs positive neuron_nbytes and full_width, "
                                 f"got {nb} and {full_width[layer_id]}")
        if policy is not None and not isinstance(policy, EvictionPolicy):
            raise TypeError(f"ResidencyLedger: policy must be an EvictionPolicy, got {type(policy).__name__}")
        self.budget = budget_bytes
        self._nb = {int(i): int(v) for i, v in neuron_nbytes.items()}
        self._full = {int(i): int(v) for i, v in full_width.items()}
        self.policy = policy if policy is not None else LRUPolicy()
        self._widths: dict[Key, int] = {}
        self._prefetched: set[Key] = set()  # prefetched, not demanded since
        self._hits: dict[Key, Decision] = {}  # per key, the last hit's Decision (request reuses it)
        self._on_use = self.policy.use_hook()  # a hit's one policy call, bound once (the policy is never replaced)
        self.used = 0
        self.peak = 0
        self.counters = LedgerCounters()

    # ------------------------------------------------------------------ queries

    def width(self, layer_id: int, expert: int) -> int:
        return self._widths.get((layer_id, expert), 0)

    def layer_width(self, layer_id: int) -> Callable[[int], int]:
        """``lambda e: width(layer_id, e)`` as one frame (the planner asks it per routed expert; through
        the cache's and the ledger's methods it was three). Reads the ledger live, like :meth:`width`."""
        get = self._widths.get
        return lambda e: get((layer_id, e), 0)

    def resident(self) -> dict[Key, int]:
        return dict(self._widths)

    def nbytes(self, layer_id: int, width: int) -> int:
        return self._nb[layer_id] * width

    def full_width(self, layer_id: int) -> int:
        return self._full[layer_id]

    def _check(self, layer_id: int, width: int, what: str) -> None:
        full = self._full.get(layer_id)
        if full is None:
            raise KeyError(f"{what}: no layer {layer_id}; the ledger holds layers {sorted(self._full)}")
        if not 0 < width <= full:
            raise ValueError(f"{what}: width {width} out of range (0, {full}] for layer {layer_id}")

    # ------------------------------------------------------------------ demand

    def request(self, layer_id: int, expert: int, width: int, *, protected: Collection[Key] = (),
                weak_protected: Collection[Key] = ()) -> Decision:
        key = (layer_id, expert)
        old = self._widths.get(key, 0)
        if old >= width > 0:  # a hit (checked first: 0 < width <= old <= the layer's full width is valid)
            self._on_use(key)
            self.counters.hits += 1
            if key in self._prefetched:
                self._prefetched.discard(key)
                self.counters.prefetch_hits += 1
                return Decision(key, HIT, width, old, old, 0, from_prefetch=True)
            # A hit's Decision is a value (key, width, old): the last one per key is reused while those
            # match (a decode step's usual case) instead of built (0.42 us a NamedTuple on the 2-core VM).
            hit = self._hits.get(key)
            if hit is None or hit[2] != width or hit[3] != old:  # its width and old_width (indexing: faster)
                hit = self._hits[key] = Decision(key, HIT, width, old, old, 0)
            return hit
        self._check(layer_id, width, "request")
        c = self.counters
        self._prefetched.discard(key)
        extra = self._nb[layer_id] * (width - old)
        evicted = self._make_room(extra, key, protected, weak_protected)
        self._grow(key, old, width, extra)
        self.policy.on_use(key)
        c.bytes_copied += extra
        if old:
            c.widenings += 1
            return Decision(key, WIDEN, width, old, width, extra, evicted)
        c.misses += 1
        return Decision(key, MISS, width, 0, width, extra, evicted)

    def request_transient(self, layer_id: int, expert: int, width: int, room: int, *,
                          protected: Collection[Key] = (), weak_protected: Collection[Key] = ()) -> Decision:
        """A demand whose missing rows go to the step's transient buffer (``room``: its bytes not yet used this
        step) when they do not fit in the free budget; see the module docstring."""
        key = (layer_id, expert)
        old = self._widths.get(key, 0)
        if old < width:
            self._check(layer_id, width, "request_transient")
            extra = self._nb[layer_id] * (width - old)
            if self.used + extra > self.budget and extra <= room:
                self._prefetched.discard(key)
                if old:
                    self.policy.on_use(key)  # its resident rows are used
                c = self.counters
                c.transients += 1
                c.transient_bytes += extra
                c.bytes_copied += extra
                return Decision(key, TRANSIENT, width, old, old, extra)
        return self.request(layer_id, expert, width, protected=protected, weak_protected=weak_protected)

    def _grow(self, key: Key, old: int, width: int, extra: int) -> None:
        self._widths[key] = width
        if not old:
            self.policy.on_insert(key)
        self.used += extra
        if self.used > self.peak:
            self.peak = self.used

    def _make_room(self, extra: int, key: Key, protected, weak_protected) -> tuple[tuple[Key, int], ...]:
        if self.used + extra <= self.budget:
            return ()
        if extra > self.budget:
            raise CacheBudgetError(f"one prefix of {extra} bytes exceeds the whole budget of {self.budget} bytes")
        strong = set(protected)
        strong.add(key)
        weak = set(weak_protected)
        weak.add(key)
        evicted = []
        while self.used + extra > self.budget:
            victim = self.policy.victim(strong)
            if victim is None:
                victim = self.policy.victim(weak)
            if victim is None:
                raise CacheBudgetError(
                    f"cannot fit {extra} more bytes: {self.used} of {self.budget} bytes are held by prefixes the "
                    "current layer step is using"
                )
            evicted.append((victim, self._widths[victim]))
            self.evict(victim)
        return tuple(evicted)

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, layer_id: int, expert: int, width: int, *, protected: Collection[Key] = ()) -> Decision | None:
        self._check(layer_id, width, "prefetch")
        key = (layer_id, expert)
        old = self._widths.get(key, 0)
        if old >= width:
            return None
        extra = self._nb[layer_id] * (width - old)
        keep = set(protected)
        keep.add(key)
        held = sum(self._nb[k[0]] * w for k, w in self._widths.items() if k in keep)
        if held + extra > self.budget:  # evicting every unprotected key would not make room
            self.counters.prefetch_rejected += 1
            return None
        evicted = []
        while self.used + extra > self.budget:
            victim = self.policy.victim(keep)
            if victim is None:  # a policy that declines an evictable key: give up (nothing evicted is lost)
                raise CacheBudgetError(f"prefetch: policy {self.policy.name!r} named no victim although "
                                       f"{self.used - held} bytes are evictable")
            evicted.append((victim, self._widths[victim]))
            self.evict(victim)
        self._grow(key, old, width, extra)
        self._prefetched.add(key)
        self.counters.prefetches += 1
        self.counters.prefetch_bytes += extra
        return Decision(key, WIDEN if old else MISS, width, old, width, extra, tuple(evicted), prefetch=True)

    # ------------------------------------------------------------------ removal

    def evict(self, key: Key) -> int:
        width = self._widths.pop(key)
        freed = self._nb[key[0]] * width
        self.used -= freed
        self.counters.evictions += 1
        if key in self._prefetched:
            self._prefetched.discard(key)
            self.counters.prefetch_unused += 1
        self.policy.on_remove(key)
        return freed

    def clear(self) -> list[Key]:
        """Evict everything (counted as evictions); returns the keys in eviction order."""
        keys = list(self._widths)
        for key in keys:
            self.evict(key)
        return keys


def transient_rows(buffer_experts: float, full_width: int) -> int:
    """Rows of a layer whose full width is ``full_width`` that a transient buffer of ``buffer_experts``
    full-width experts holds (0: no buffer)."""
    return math.floor(buffer_experts * full_width)


def transient_buffer_bytes(buffer_experts: float, neuron_nbytes: Mapping[int, int],
                           full_width: Mapping[int, int]) -> int:
    """Bytes of the transient buffer: its rows in the layer that needs the most bytes for them. The GPU
    budget gives them up: the ledger's budget is the GPU budget minus this."""
    return max((transient_rows(buffer_experts, int(full_width[i])) * int(nb) for i, nb in neuron_nbytes.items()),
               default=0)


def pin_most_used(counts: Mapping[Key, int], holders, full_width: Mapping[int, int]) -> list[Key]:
    """Make the most used keys resident at full width while they fit, evicting nothing: the static
    hot set that llama.cpp's ``--n-cpu-moe``-style placement keeps on the GPU, and the start of every
    hybrid run (runtime, simulator, e2e benchmark and accuracy decode alike).

    counts: uses per ``(layer, expert)`` (what counts as a use is the caller's: routed slots, or
    slots the plan runs). holders: ``holders[layer]`` is a :class:`ResidencyLedger` or a
    ``PrefixCache`` (``used``, ``budget``, ``nbytes(layer, width)``, ``prefetch(layer, expert, width)``);
    one shared by every layer for a global cache. Order: most uses first, ties by key, so the set is
    deterministic. A key that does not fit is skipped and a smaller one may still fit after it.
    Returns the keys made resident, in order."""
    pinned = []
    for key, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        layer, expert = key
        holder, full = holders[layer], int(full_width[layer])
        if holder.used + holder.nbytes(layer, full) <= holder.budget and holder.prefetch(layer, expert, full):
            pinned.append(key)
    return pinned
