"""Where the experts a layer step runs live on the compute device.

:class:`PrefixCache` holds expert *prefixes* ``(layer, expert) -> width`` under a hard byte
budget. Storage: one buffer set (qweight, scales, zeros) per resident prefix, exactly
``width`` neurons long, so a prefix occupies ``nbytes(width)`` and the budget is accounted
to the byte. A hit copies nothing; a prefix narrower than needed is widened by allocating a
buffer of the new width, copying the resident rows device-to-device and only the missing rows
``k..k'`` from the host store; a miss copies rows ``0..k``. Before any copy the eviction policy
frees room until the new bytes fit. (Per-prefix buffers rather than one arena: simplest
correct design; the cost is the allocator's fragmentation and, while widening, the old
prefix living until its rows are copied: a transient of at most nbytes(old width).)

:class:`ResidentExperts` is the no-offload mode (``gpu_budget=None``): every packed layer
sits on the device at full width, nothing is ever copied.

On CPU the "device" is host memory and copies are synchronous: the tests exercise the very
code path the GPU runs, only without streams (those are in ``executor.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crisp_kernels import PackedExpert, PackedLayer

from .eviction import EvictionPolicy, Key, LRUPolicy
from .host_store import HostStore


class CacheBudgetError(RuntimeError):
    """The prefixes one layer step needs at the same time do not fit in the budget."""


@dataclass
class CacheEntry:
    width: int
    tensors: tuple[torch.Tensor, ...]  # qweight (w, 3, H/2), scales (w, 3, H/g)[, zeros (w, 3, H/g)]
    last_use: object = None  # GPU-only: CUDA event recorded after the last compute that read it


@dataclass(frozen=True)
class Acquired:
    """The result of :meth:`PrefixCache.acquire`: the prefix to run and what it took."""

    expert: PackedExpert  # a view of exactly ``width`` neurons on the device
    kind: str  # "hit", "miss" or "widen"
    copied_bytes: int
    evictions: int


class PrefixCache:
    """Expert prefixes on ``device`` under ``budget_bytes`` (a hard limit on resident bytes)."""

    def __init__(self, store: HostStore, budget_bytes: int, device, policy: EvictionPolicy | None = None) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"PrefixCache: budget must be a positive number of bytes, got {budget_bytes!r}")
        self.store = store
        self.budget = budget_bytes
        self.device = torch.device(device)
        self.policy = policy if policy is not None else LRUPolicy()
        self.entries: dict[Key, CacheEntry] = {}
        self.used = 0  # bytes held by resident prefixes, Σ width * neuron_nbytes
        self.peak = 0
        self._nb = {i: store.neuron_nbytes(i) for i in store.layers}

    # ------------------------------------------------------------------ queries

    def resident_width(self, layer_id: int, expert: int) -> int:
        entry = self.entries.get((layer_id, expert))
        return 0 if entry is None else entry.width

    def resident(self) -> dict[Key, int]:
        return {k: e.width for k, e in self.entries.items()}

    def nbytes(self, layer_id: int, width: int) -> int:
        return self._nb[layer_id] * width

    # ------------------------------------------------------------------ the work

    def acquire(self, layer_id: int, expert: int, width: int, *, protected=(), weak_protected=()) -> Acquired:
        """Make ``(layer_id, expert)`` resident at ``width`` or wider and return its first ``width`` neurons.

        protected: keys not to evict (the experts this step still needs); if nothing else can
        go, keys in ``protected`` but not in ``weak_protected`` may be evicted after all (a
        step whose experts do not fit at once runs as a stream). Never evicts the key itself.
        """
        key = (layer_id, expert)
        full = self.store.full_width(layer_id)
        if not 0 < width <= full:
            raise ValueError(f"acquire: width {width} out of range (0, {full}] for layer {layer_id}")
        entry = self.entries.get(key)
        if entry is not None and entry.width >= width:
            self.policy.on_use(key)
            return Acquired(_view(self.store.layer(layer_id), entry.tensors, width), "hit", 0, 0)

        old_width = 0 if entry is None else entry.width
        extra = self.nbytes(layer_id, width - old_width)
        evictions = self._make_room(extra, key, protected, weak_protected)
        tensors = self._copy_in(layer_id, expert, entry, width)
        if entry is None:
            entry = CacheEntry(width, tensors)
            self.entries[key] = entry
            self.policy.on_insert(key)
        else:
            entry.width, entry.tensors = width, tensors
        self.used += extra
        self.peak = max(self.peak, self.used)
        self.policy.on_use(key)
        kind = "miss" if old_width == 0 else "widen"
        return Acquired(_view(self.store.layer(layer_id), tensors, width), kind, extra, evictions)

    def _make_room(self, extra: int, key: Key, protected, weak_protected) -> int:
        if extra > self.budget:
            raise CacheBudgetError(f"one prefix of {extra} bytes exceeds the whole budget of {self.budget} bytes")
        evictions = 0
        strong = set(protected) | {key}
        weak = set(weak_protected) | {key}
        while self.used + extra > self.budget:
            victim = self.policy.victim(strong)
            if victim is None:
                victim = self.policy.victim(weak)
            if victim is None:
                raise CacheBudgetError(
                    f"cannot fit {extra} more bytes: {self.used} of {self.budget} bytes are held by prefixes the "
                    "current layer step is using"
                )
            self.evict(victim)
            evictions += 1
        return evictions

    def evict(self, key: Key) -> None:
        entry = self.entries.pop(key)
        if entry.last_use is not None:  # GPU-only: a compute still queued may read it; keep the budget hard
            entry.last_use.synchronize()
        self.used -= self.nbytes(key[0], entry.width)
        self.policy.on_remove(key)

    def clear(self) -> None:
        for key in list(self.entries):
            self.evict(key)

    def _copy_in(self, layer_id: int, expert: int, entry: CacheEntry | None, width: int) -> tuple[torch.Tensor, ...]:
        """New buffers of ``width`` rows: resident rows copied on the device, the rest from the host store."""
        old = 0 if entry is None else entry.width
        host = self.store.rows(layer_id, expert, old, width)
        non_blocking = self.device.type == "cuda" and self.store.pinned
        out = []
        for i, src in enumerate(host):
            buf = torch.empty((width, *src.shape[1:]), dtype=src.dtype, device=self.device)
            if old:
                buf[:old].copy_(entry.tensors[i])
            buf[old:].copy_(src, non_blocking=non_blocking)
            out.append(buf)
        return tuple(out)


class ResidentExperts:
    """No offload: every packed layer on the device at full width (``gpu_budget=None``)."""

    def __init__(self, layers: dict[int, PackedLayer], device) -> None:
        self.device = torch.device(device)
        self.layers = {i: _layer_to(layer, self.device) for i, layer in layers.items()}
        self.used = sum(layer.nbytes() for layer in self.layers.values())
        self.budget = None
        self.peak = self.used

    def resident_width(self, layer_id: int, expert: int) -> int:
        return self.layers[layer_id].intermediate_size

    def acquire(self, layer_id: int, expert: int, width: int, **_) -> Acquired:
        return Acquired(self.layers[layer_id].expert(expert).prefix(width), "hit", 0, 0)

    def clear(self) -> None:
        """Nothing to drop: every expert stays resident."""


def _view(layer: PackedLayer, tensors, width: int) -> PackedExpert:
    zeros = tensors[2][:width] if len(tensors) > 2 else None
    return PackedExpert(layer.fmt, tensors[0][:width], tensors[1][:width], zeros)


def _layer_to(layer: PackedLayer, device: torch.device) -> PackedLayer:
    if layer.qweight.device == device:
        return layer
    return PackedLayer(
        layer.fmt,
        layer.qweight.to(device),
        layer.scales.to(device),
        None if layer.zeros is None else layer.zeros.to(device),
        layer.neuron_order,
    )
