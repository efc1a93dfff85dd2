"""Where the experts a layer step runs live on the compute device.

:class:`PrefixCache` holds expert *prefixes* ``(layer, expert) -> width`` under a hard byte
budget. Storage: one buffer set (qweight, scales, zeros) per resident prefix, exactly
``width`` neurons long, so a prefix occupies ``nbytes(width)`` and the budget is accounted
to the byte. A hit copies nothing; a prefix narrower than needed is widened by allocating a
buffer of the new width, copying the resident rows device-to-device and only the missing rows
``k..k'`` from the host store; a miss copies rows ``0..k``. What is resident, what is copied
and what is evicted is decided by the tensor-free :class:`~crisp_runtime.residency.ledger.ResidencyLedger`
(the one the simulator replays); this class only moves tensors as each decision says.
(Per-prefix buffers rather than one arena: simplest correct design; the cost is the allocator's
fragmentation and, while widening, the old prefix living until its rows are copied: a transient
of at most nbytes(old width).)

:class:`ResidentExperts` is the no-offload mode (``gpu_budget=None``): every packed layer
sits on the device at full width, nothing is ever copied.

On CPU the "device" is host memory and copies are synchronous: the tests exercise the very
code path the GPU runs, only without streams (those are in ``runtime.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from crisp_kernels import PackedExpert, PackedLayer
from crisp_runtime.residency.eviction import EvictionPolicy, Key, LRUPolicy
from crisp_runtime.residency.host_store import HostStore
from crisp_runtime.residency.ledger import HIT, TRANSIENT, CacheBudgetError, Decision, ResidencyLedger

__all__ = ["Acquired", "CacheBudgetError", "CacheEntry", "PrefixCache", "ResidentExperts"]


@dataclass
class CacheEntry:
    """The device buffers of one resident prefix (its width is the ledger's)."""

    expert: PackedExpert  # qweight (w, 3, H/2), scales (w, 3, H/g)[, zeros]: exactly the resident width
    last_use: object = None  # GPU-only: CUDA event recorded after the last compute that read it
    ready: object = None  # GPU-only: CUDA event after a prefetch's copy, until a step waits on it
    # The last hit's Acquired on these buffers, reused while the ledger returns the same hit Decision (a new
    # entry, i.e. new buffers, starts without one): a hit builds no NamedTuple (0.35 us each, 2-core VM).
    hit: Acquired | None = None


class Acquired(NamedTuple):
    """The result of :meth:`PrefixCache.acquire`: the resident prefix and what it took (a NamedTuple:
    one per expert call, built ~4x faster than a frozen dataclass).

    ``resident`` holds the whole resident prefix (at least ``width`` neurons, built once per
    copy, not per acquire); kernels take it with ``width``. ``expert`` is the exact
    ``width``-neuron view (built on demand).
    """

    resident: PackedExpert | None  # None only for a "transient" decision on an expert with nothing resident
    width: int
    decision: Decision | None  # None for ResidentExperts (nothing is ever copied)
    # A "transient" decision (``acquire(..., transient_room=...)``): rows [old_width, width) copied into the
    # step's transient buffer, an expert of width - old_width neurons (no down bias: it belongs to row 0's part),
    # never admitted; ``resident`` then holds rows [0, old_width) (None when old_width == 0).
    transient: PackedExpert | None = None

    @property
    def expert(self) -> PackedExpert:
        return self.resident if self.resident.width == self.width else self.resident.prefix(self.width)

    @property
    def kind(self) -> str:
        return HIT if self.decision is None else self.decision.kind

    @property
    def copied_bytes(self) -> int:
        return 0 if self.decision is None else self.decision.copy_bytes

    @property
    def evictions(self) -> int:
        return 0 if self.decision is None else self.decision.evictions


class PrefixCache:
    """Expert prefixes on ``device`` under ``budget_bytes``: moves tensors as its :class:`ResidencyLedger` decides."""

    def __init__(self, store: HostStore, budget_bytes: int, device, policy: EvictionPolicy | None = None) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"PrefixCache: budget must be a positive number of bytes, got {budget_bytes!r}")
        self.store = store
        self.device = torch.device(device)
        self.ledger = ResidencyLedger(
            budget_bytes,
            {i: store.neuron_nbytes(i) for i in store.layers},
            {i: store.full_width(i) for i in store.layers},
            policy if policy is not None else LRUPolicy(),
        )
        self._entries: dict[Key, CacheEntry] = {}

    # ------------------------------------------------------------------ queries (the ledger's)

    @property
    def budget(self) -> int:
        return self.ledger.budget

    @property
    def used(self) -> int:
        return self.ledger.used

    @property
    def peak(self) -> int:
        return self.ledger.peak

    @property
    def policy(self) -> EvictionPolicy:
        return self.ledger.policy

    def resident_width(self, layer_id: int, expert: int) -> int:
        return self.ledger.width(layer_id, expert)

    def resident(self) -> dict[Key, int]:
        return self.ledger.resident()

    def nbytes(self, layer_id: int, width: int) -> int:
        return self.ledger.nbytes(layer_id, width)

    # ------------------------------------------------------------------ the work

    def acquire(self, layer_id: int, expert: int, width: int, *, protected=(), weak_protected=(),
                transient_room: int = 0) -> Acquired:
        """Make ``(layer_id, expert)`` resident at ``width`` or wider (see ``ResidencyLedger.request``).

        transient_room: bytes of the step's transient buffer not yet used (the neuron split's
        ``ServingPolicy.transient_buffer``; 0: none): the ledger may then decide "transient"
        (``ResidencyLedger.request_transient``) and the missing rows are copied into a buffer of their own,
        returned as ``Acquired.transient``, which nothing keeps after the step's kernels."""
        if transient_room:
            decision = self.ledger.request_transient(layer_id, expert, width, transient_room, protected=protected,
                                                     weak_protected=weak_protected)
            if decision.kind == TRANSIENT:
                entry = self._entries.get(decision.key) if decision.old_width else None
                return Acquired(None if entry is None else entry.expert, width, decision,
                                self._copy_rows(layer_id, expert, decision.old_width, width))
        else:
            decision = self.ledger.request(layer_id, expert, width, protected=protected,
                                           weak_protected=weak_protected)
        if decision.kind != HIT:
            self._apply(decision)
            return Acquired(self._entries[decision.key].expert, width, decision)
        entry = self._entries[decision.key]
        got = entry.hit
        if got is None or got.decision is not decision:  # the ledger reuses a hit's Decision per key
            got = entry.hit = Acquired(entry.expert, width, decision)
        return got

    def acquire_resident(self, layer_id: int, experts: Sequence[int], widths: Sequence[int], *,
                         transient_room: int = 0) -> tuple[list[PackedExpert], int]:
        """The resident prefixes of a layer step that copies nothing: each ``(expert, width)`` asked of the
        ledger in order, exactly as :meth:`acquire` asks (``request``, or ``request_transient`` with a
        transient room: the same decisions), each a hit. Returns the prefixes (at least ``width`` neurons
        each) and how many hits were on a prefetched prefix not used before. No :class:`Acquired` is built:
        the executor's decode path (0.35 us a NamedTuple, 2-core VM).

        Raises RuntimeError when one is not resident at its width (the step was planned on a cache that
        changed since), after applying that decision, so that the cache and its ledger stay consistent."""
        ledger, entries = self.ledger, self._entries
        out = []
        from_prefetch = 0
        for expert, width in zip(experts, widths, strict=True):
            if transient_room:
                decision = ledger.request_transient(layer_id, expert, width, transient_room)
            else:
                decision = ledger.request(layer_id, expert, width)
            if decision.kind != HIT:
                if decision.kind != TRANSIENT:
                    self._apply(decision)
                raise RuntimeError(f"acquire_resident: expert {expert} of layer {layer_id} was not resident at "
                                   f"width {width} (the ledger decided {decision.kind!r})")
            if decision.from_prefetch:
                from_prefetch += 1
            out.append(entries[decision.key].expert)
        return out, from_prefetch

    def _copy_rows(self, layer_id: int, expert: int, start: int, stop: int) -> PackedExpert:
        """Rows [start, stop) of an expert in new device buffers (the transient buffer's part): an expert of
        stop - start neurons, without the down bias when start > 0 (the part with row 0 adds it)."""
        host = self.store.rows(layer_id, expert, start, stop)
        non_blocking = self.device.type == "cuda" and self.store.pinned
        out = []
        for src in host:  # new buffers on every device (on the CPU too: the path the GPU runs)
            buf = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            buf.copy_(src, non_blocking=non_blocking)
            out.append(buf)
        part = self.store.layer(layer_id).expert_from_rows(expert, tuple(out))
        return part if not start or part.down_bias is None else replace(part, down_bias=None)

    def prefetch(self, layer_id: int, expert: int, width: int, *, protected=()) -> Decision | None:
        """Copy ahead of demand if the ledger admits it (see ``ResidencyLedger.prefetch``)."""
        decision = self.ledger.prefetch(layer_id, expert, width, protected=protected)
        if decision is not None:
            self._apply(decision)
        return decision

    def mark_used(self, layer_id: int, expert: int, event) -> None:
        """GPU-only: the event after the last kernel reading this prefix; eviction waits on it."""
        self._entries[(layer_id, expert)].last_use = event

    def set_ready(self, layer_id: int, expert: int, event) -> None:
        """GPU-only: the event after a prefetch's copy; the first step using the prefix waits on it."""
        self._entries[(layer_id, expert)].ready = event

    def take_ready(self, layer_id: int, expert: int):
        """GPU-only: the pending prefetch event of a prefix (None if none), cleared."""
        entry = self._entries[(layer_id, expert)]
        event, entry.ready = entry.ready, None
        return event

    def _apply(self, decision: Decision) -> None:
        for key, _ in decision.evicted:
            self._drop(key)
        self._entries[decision.key] = CacheEntry(self._copy_in(decision))

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key)
        if entry.last_use is not None:  # GPU-only: a compute still queued may read it; keep the budget hard
            entry.last_use.synchronize()

    def evict(self, key: Key) -> None:
        self.ledger.evict(key)
        self._drop(key)

    def clear(self) -> None:
        for key in self.ledger.clear():
            self._drop(key)

    def _copy_in(self, decision: Decision) -> PackedExpert:
        """New buffers of the new width: resident rows copied on the device, the rest from the host store."""
        layer_id, expert = decision.key
        old, width = decision.old_width, decision.new_width
        entry = self._entries.get(decision.key) if old else None
        host = self.store.rows(layer_id, expert, old, width)
        non_blocking = self.device.type == "cuda" and self.store.pinned
        out = []
        for i, src in enumerate(host):
            buf = torch.empty((width, *src.shape[1:]), dtype=src.dtype, device=self.device)
            if old:
                buf[:old].copy_(entry.expert.tensors()[i])
            buf[old:].copy_(src, non_blocking=non_blocking)
            out.append(buf)
        # the down bias (gpt-oss: 4H bytes per expert, outside the ledger) goes with the expert
        return self.store.layer(layer_id).expert_from_rows(expert, tuple(out))


class ResidentExperts:
    """No offload: every packed layer on the device at full width (``gpu_budget=None``)."""

    def __init__(self, layers: dict[int, PackedLayer], device) -> None:
        self.device = torch.device(device)
        self.layers = {i: _layer_to(layer, self.device) for i, layer in layers.items()}
        self.used = sum(layer.nbytes() for layer in self.layers.values())
        self.budget = None
        self.peak = self.used
        self._views: dict[Key, PackedExpert] = {}
        self._acquired: dict[Key, Acquired] = {}

    def resident_width(self, layer_id: int, expert: int) -> int:
        return self.layers[layer_id].intermediate_size

    def acquire(self, layer_id: int, expert: int, width: int, **_) -> Acquired:
        got = self._acquired.get((layer_id, expert))  # the last one per key, reused at the same width
        if got is None or got.width != width:
            got = self._acquired[(layer_id, expert)] = Acquired(self._expert(layer_id, expert), width, None)
        return got

    def acquire_resident(self, layer_id: int, experts: Sequence[int], widths: Sequence[int],
                         **_) -> tuple[list[PackedExpert], int]:
        """:meth:`PrefixCache.acquire_resident`: every expert is resident at full width, none prefetched."""
        return [self._expert(layer_id, e) for e in experts], 0

    def _expert(self, layer_id: int, expert: int) -> PackedExpert:
        """Full-width expert views, built (and validated) once."""
        key = (layer_id, expert)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.layers[layer_id].expert(expert)
        return view

    def clear(self) -> None:
        """Nothing to drop: every expert stays resident."""


def _layer_to(layer: PackedLayer, device: torch.device) -> PackedLayer:
    if layer.qweight.device == device:
        return layer
    return layer.to(device)  # every tensor but neuron_order, biases (gpt-oss) included
