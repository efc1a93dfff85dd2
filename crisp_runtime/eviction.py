"""Eviction policies of the prefix cache: which resident prefix to drop when room is needed.

A policy sees keys ``(layer_id, expert)`` being inserted, used and removed, and picks a
victim among the resident keys that are not protected (the experts the current layer step
still needs). Policies only order keys; the cache owns the bytes and the budget.

- :class:`LRUPolicy` (default): least recently used first.
- :class:`FrequencyPolicy`: fewest uses first (counts kept across evictions, so an expert that
  is often routed keeps its history), least recently used among equals.
- :class:`TierAwarePolicy`: experts of the plan's Hot combinations are kept over those of Warm
  ones, Warm over the rest (from ``CrispPlan.layers``), least recently used among equals.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Container

Key = tuple[int, int]


class EvictionPolicy(abc.ABC):
    """Interface; subclasses implement :meth:`victim` (and may use the hooks)."""

    name = "base"

    def __init__(self) -> None:
        self._recency: OrderedDict[Key, None] = OrderedDict()  # least recent first

    def on_insert(self, key: Key) -> None:
        self._recency[key] = None
        self._recency.move_to_end(key)

    def on_use(self, key: Key) -> None:
        self._recency.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._recency.pop(key, None)

    def set_plan(self, plan) -> None:  # noqa: B027 - optional hook
        """Called when the handle switches plans (tier-aware policies re-read tiers)."""

    @abc.abstractmethod
    def victim(self, protected: Container[Key]) -> Key | None:
        """The key to evict next (never one in ``protected``), or None when nothing can go."""

    def _candidates(self, protected: Container[Key]):
        return (k for k in self._recency if k not in protected)


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def victim(self, protected: Container[Key]) -> Key | None:
        return next(self._candidates(protected), None)


class FrequencyPolicy(EvictionPolicy):
    name = "frequency"

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[Key, int] = {}

    def on_use(self, key: Key) -> None:
        super().on_use(key)
        self.counts[key] = self.counts.get(key, 0) + 1

    def victim(self, protected: Container[Key]) -> Key | None:
        best, best_count = None, None
        for key in self._candidates(protected):  # least recent first: strict < keeps the older on ties
            count = self.counts.get(key, 0)
            if best_count is None or count < best_count:
                best, best_count = key, count
        return best


class TierAwarePolicy(EvictionPolicy):
    """Priority 2: the expert is in a Hot combination of its layer; 1: in a Warm one; 0: otherwise."""

    name = "tier"

    def __init__(self, plan=None) -> None:
        super().__init__()
        self.priority: dict[Key, int] = {}
        if plan is not None:
            self.set_plan(plan)

    def set_plan(self, plan) -> None:
        from .plan import Tier

        rank = {Tier.HOT: 2, Tier.WARM: 1, Tier.COLD: 0}
        priority: dict[Key, int] = {}
        for layer_id, lp in getattr(plan, "layers", {}).items():
            for pair, tier in lp.tiers.items():
                for e in pair:
                    key = (int(layer_id), int(e))
                    priority[key] = max(priority.get(key, 0), rank[tier])
        self.priority = priority

    def victim(self, protected: Container[Key]) -> Key | None:
        best, best_p = None, None
        for key in self._candidates(protected):
            p = self.priority.get(key, 0)
            if best_p is None or p < best_p:
                best, best_p = key, p
        return best


POLICIES = {"lru": LRUPolicy, "frequency": FrequencyPolicy, "tier": TierAwarePolicy}


def make_policy(spec, plan=None) -> EvictionPolicy:
    """A policy from a name ("lru", "frequency", "tier"), a class, or an instance (returned as is)."""
    if isinstance(spec, EvictionPolicy):
        return spec
    if isinstance(spec, type) and issubclass(spec, EvictionPolicy):
        policy = spec()
    elif isinstance(spec, str) and spec in POLICIES:
        policy = POLICIES[spec]()
    else:
        raise ValueError(f"eviction: expected one of {sorted(POLICIES)} or an EvictionPolicy, got {spec!r}")
    if plan is not None:
        policy.set_plan(plan)
    return policy
