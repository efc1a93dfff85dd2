"""Eviction policies of the prefix cache: which resident prefix to drop when room is needed.

A policy sees keys ``(layer_id, expert)`` being inserted, used and removed, and picks a
victim among the resident keys that are not protected (the experts the current layer step
still needs). Policies only order keys; the cache owns the bytes and the budget.

- :class:`LRUPolicy` (default): least recently used first.
- :class:`FrequencyPolicy`: fewest uses first (counts kept across evictions, so an expert that
  is often routed keeps its history), least recently used among equals.
- :class:`TierAwarePolicy`: experts of the plan's Hot combinations are kept over those of Warm
  ones, Warm over the rest (from ``CrispPlan.layers``), least recently used among equals.
- :class:`NextUsePolicy`: furthest predicted next use, from the distance in the layer cycle and
  a reuse-frequency table (decoding walks the layers in a loop: recency is the wrong signal).
- :class:`PinnedPolicy`: another policy plus a pinned hot set, evicted only when nothing else can go.
- :class:`BeladyPolicy` (offline, simulator): furthest actual next use, given the future accesses.
"""

from __future__ import annotations

import abc
import bisect
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Container, Iterable, Sequence

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

    def use_hook(self) -> Callable[[Key], None]:
        """:meth:`on_use` as one callable, for the ledger's hit path (bound once). A policy that keeps the
        base ``on_use`` (LRU, tier-aware) gets its recency dict's own ``move_to_end``: the same effect
        without a Python frame (0.15 us per hit on the 2-core VM). Any override (class or instance) is kept."""
        if type(self).on_use is _BASE_ON_USE and "on_use" not in vars(self):
            return self._recency.move_to_end
        return self.on_use

    def on_remove(self, key: Key) -> None:
        self._recency.pop(key, None)

    def set_plan(self, plan) -> None:  # noqa: B027 - optional hook
        """Called when the handle switches plans (tier-aware policies re-read tiers)."""

    @abc.abstractmethod
    def victim(self, protected: Container[Key]) -> Key | None:
        """The key to evict next (never one in ``protected``), or None when nothing can go."""

    def _candidates(self, protected: Container[Key]):
        return (k for k in self._recency if k not in protected)


_BASE_ON_USE = EvictionPolicy.on_use  # the function use_hook may bypass (a later patch of the class is kept)


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
        from crisp_runtime.planning.plan import Tier

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


class NextUsePolicy(EvictionPolicy):
    """Evict the prefix whose next use is predicted furthest away.

    Decoding visits the MoE layers in a cycle, so the prefix used longest ago (LRU's victim) is
    the one the next token needs first. This policy predicts, for each resident key
    ``(layer, expert)``, how many layer steps pass until it is used again:

        steps = d + n * (1 / p - 1)

    where ``n`` is the number of layers in the cycle, ``d`` in 1..n the layer steps until
    ``layer`` comes next (0 counts as n: the current layer's other experts wait a whole
    cycle), and ``p`` the estimated chance that ``expert`` is routed at the next visit of
    ``layer`` (a geometric wait of 1/p - 1 further cycles). ``p`` is a moving average over the
    layer's visits, ``p <- (1 - decay) p + decay [used]``, starting from ``prior_rate``: with
    ``decay`` near 0 it is the long-run reuse frequency, near 1 "was it used at the last visit".
    Routing is correlated from one token to the next, so recent visits predict best (measured on
    the project's trace: docs/serving-and-residency.md). The table is also the admission rule: a one-off
    cold auxiliary keeps a low ``p``, becomes the first victim after its use, and the room it took
    is recycled by the next one-off instead of a hot dominant's.

    The current layer is the one of the last use, or of the keys the ledger protects when a
    new step begins (the ledger asks for a victim before it reports the step's first use).
    Ties: least recently used first.
    """

    name = "next_use"

    def __init__(self, decay: float = 0.5, prior_rate: float = 0.25) -> None:
        super().__init__()
        if not 0.0 < decay <= 1.0 or not 0.0 < prior_rate <= 1.0:
            raise ValueError(f"NextUsePolicy: decay and prior_rate must lie in (0, 1], got {decay} and {prior_rate}")
        self.decay = decay
        self.prior_rate = prior_rate
        self._keep = 1.0 - decay
        self.rate: dict[Key, tuple[float, int]] = {}  # key -> (p after its last use, layer visit of that use)
        self.visits: dict[int, int] = {}
        self._layers: list[int] = []  # the cycle, sorted layer ids seen so far
        self._pos: dict[int, int] = {}  # layer id -> position in the cycle
        self._last_layer: int | None = None

    def on_use(self, key: Key) -> None:
        super().on_use(key)
        layer = key[0]
        if layer != self._last_layer:  # a new layer step begins
            self.visits[layer] = self.visits.get(layer, 0) + 1
            self._last_layer = layer
            if layer not in self._pos:
                self._layers.append(layer)
                self._layers.sort()
                self._pos = {lay: i for i, lay in enumerate(self._layers)}
        visit = self.visits[layer]
        p = self.probability(key, visit - 1)  # decayed through the visits it was not used at
        self.rate[key] = (self._keep * p + self.decay, visit)

    def probability(self, key: Key, visit: int | None = None) -> float:
        """Estimated chance that ``key`` is used at the next visit of its layer (after ``visit``)."""
        p, at = self.rate.get(key, (self.prior_rate, 0))
        now = self.visits.get(key[0], 0) if visit is None else visit
        return p * self._keep ** max(0, now - at)

    def _current_layer(self, protected: Container[Key]) -> int | None:
        last = self._last_layer
        layers = {k[0] for k in protected} if isinstance(protected, (set, frozenset, _Union)) else set()
        if not layers or last in layers or last is None:
            return last if last is not None else (min(layers) if layers else None)
        return min(layers, key=lambda lay: self._distance(last, lay, zero_is_cycle=False))

    def _distance(self, current: int, layer: int, *, zero_is_cycle: bool = True) -> int:
        n = len(self._layers)
        if current not in self._pos or layer not in self._pos:
            return n if n else 1
        d = (self._pos[layer] - self._pos[current]) % n
        return n if d == 0 and zero_is_cycle else d

    def expected_steps(self, key: Key, current: int | None) -> float:
        """Predicted layer steps until ``key`` is used again, seen from layer ``current``."""
        n = max(1, len(self._layers))
        p = max(self.probability(key), _MIN_RATE)
        d = n if current is None else self._distance(current, key[0])
        return d + n * (1.0 / p - 1.0)

    def victim(self, protected: Container[Key]) -> Key | None:
        # expected_steps inlined: this runs once per resident key per eviction (~70 keys for
        # Mixtral at a 25% budget), the planner's hot loop.
        current = self._current_layer(protected)
        pos, rate, visits, keep = self._pos, self.rate, self.visits, self._keep
        n = max(1, len(self._layers))
        cur = pos.get(current)
        prior = (self.prior_rate, 0)
        best, best_steps = None, -1.0
        for key in self._recency:  # least recent first: strict > keeps the older on ties
            if key in protected:
                continue
            layer = key[0]
            lp = pos.get(layer)
            d = n if cur is None or lp is None else ((lp - cur) % n or n)
            p, at = rate.get(key, prior)
            gap = visits.get(layer, 0) - at
            p = max(p * keep ** gap if gap > 0 else p, _MIN_RATE)
            steps = d + n * (1.0 / p - 1.0)
            if steps > best_steps:
                best, best_steps = key, steps
        return best


_MIN_RATE = 1e-6  # a key whose estimate decayed to ~0: the furthest, without dividing by zero


class PinnedPolicy(EvictionPolicy):
    """Another policy with a pinned hot set: pinned keys go only when nothing else can.

    ``pinned``: keys chosen from a calibration trace (e.g. the most used experts up to a share
    of the budget). A pinned key is loaded on its first use like any other and then kept.
    """

    def __init__(self, inner: EvictionPolicy, pinned: Collection[Key]) -> None:
        super().__init__()
        if not isinstance(inner, EvictionPolicy):
            raise TypeError(f"PinnedPolicy: inner must be an EvictionPolicy, got {type(inner).__name__}")
        self.inner = inner
        self.pinned = frozenset((int(a), int(b)) for a, b in pinned)
        self.name = f"{inner.name}+pinned"

    def on_insert(self, key: Key) -> None:
        self.inner.on_insert(key)

    def on_use(self, key: Key) -> None:
        self.inner.on_use(key)

    def use_hook(self) -> Callable[[Key], None]:
        if type(self).on_use is PinnedPolicy.on_use and "on_use" not in vars(self):
            return self.inner.use_hook()  # the inner policy's hook: one frame less per hit
        return self.on_use

    def on_remove(self, key: Key) -> None:
        self.inner.on_remove(key)

    def set_plan(self, plan) -> None:
        self.inner.set_plan(plan)

    def victim(self, protected: Container[Key]) -> Key | None:
        got = self.inner.victim(_Union(protected, self.pinned))
        return got if got is not None else self.inner.victim(protected)


class _Union:
    """``a | b`` for membership tests, without copying ``a`` (a set the ledger builds per request)."""

    def __init__(self, a: Container[Key], b: Container[Key]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self.a or key in self.b

    def __iter__(self):  # the protected keys proper (the current step's), for policies that read the step's layer
        return iter(self.a)


class BeladyPolicy(EvictionPolicy):
    """Offline: evict the key whose next use lies furthest in the future (Belady's MIN).

    ``steps``: the whole access sequence to come, one ``(layer, experts)`` per layer step in
    decoding order (the routed experts of each step, as in the trace). The policy follows the
    replay through the uses it is told about: a use of a key that the current step routes and
    has not used yet stays in the step; any other use moves to the next step routing that key
    (steps with no use, e.g. everything skipped, are passed over). Keys never used again go
    first (least recently used among them).

    Optimal (fewest misses, hence fewest bytes) when every prefix has the same size, which
    ``tests/test_eviction_belady.py`` checks against brute force. With prefixes of different
    widths the optimum is NP-hard and furthest-next-use is the standard heuristic: a strong
    reference, not a proven bound. With serving that skips auxiliaries it sees routed experts
    as uses, whether or not they end up requested.
    """

    name = "belady"

    def __init__(self, steps: Sequence[tuple[int, Iterable[int]]]) -> None:
        super().__init__()
        self.step_layers: list[int] = []
        self.step_experts: list[frozenset[int]] = []
        self.step_end: list[int] = []  # flat index of each step's last slot
        self.positions: dict[Key, list[int]] = {}  # flat slot indices (steps laid end to end, slots in order)
        flat = 0
        for layer, experts in steps:
            layer = int(layer)
            order = list(dict.fromkeys(int(x) for x in experts))
            self.step_layers.append(layer)
            self.step_experts.append(frozenset(order))
            for e in order:
                self.positions.setdefault((layer, e), []).append(flat)
                flat += 1
            self.step_end.append(flat - 1)
        self.cursor = -1  # the step of the last use
        self._next: dict[Key, float] = {}  # cached next_use (valid while ahead of the cursor's step)
        self._used_here: set[Key] = set()  # keys used at the cursor's step

    def on_use(self, key: Key) -> None:
        super().on_use(key)
        c = self.cursor
        if c >= 0 and key in self._step_keys(c) and key not in self._used_here:
            self._used_here.add(key)  # another expert of the current step
            return
        pos = self.positions.get(key, [])
        j = bisect.bisect_right(pos, self.step_end[c] if c >= 0 else -1)
        if j == len(pos):
            raise ValueError(f"BeladyPolicy: a use of {key} after the last step routing it in the future it was given")
        self.cursor = bisect.bisect_left(self.step_end, pos[j])
        self._used_here = {key}

    def _step_keys(self, i: int) -> set[Key]:
        layer = self.step_layers[i]
        return {(layer, e) for e in self.step_experts[i]}

    def next_use(self, key: Key) -> float:
        """Flat slot index of the next use of ``key`` in a step after the current one (inf: never).

        Slots count through the steps in the order given, so two keys next used in the same
        step are ordered by their slot in it (MIN on the flattened sequence needs that tie-break).
        """
        bound = self.step_end[self.cursor] if self.cursor >= 0 else -1
        cached = self._next.get(key)
        if cached is not None and cached > bound:  # still ahead: valid until the replay passes it
            return cached
        pos = self.positions.get(key)
        j = bisect.bisect_right(pos, bound) if pos else 0
        nxt = pos[j] if pos and j < len(pos) else math.inf
        self._next[key] = nxt
        return nxt

    def victim(self, protected: Container[Key]) -> Key | None:
        best, best_next = None, -1.0
        for key in self._candidates(protected):
            nxt = self.next_use(key)
            if nxt > best_next:
                best, best_next = key, nxt
                if nxt == math.inf:
                    break
        return best

POLICIES = {"lru": LRUPolicy, "frequency": FrequencyPolicy, "tier": TierAwarePolicy, "next_use": NextUsePolicy}


def make_policy(spec, plan=None) -> EvictionPolicy:
    """A policy from a name ("lru", "frequency", "tier", "next_use"), a class, or an instance (itself); told
    ``plan`` when one is given, an instance too (a TierAwarePolicy() made by the caller had no tiers before)."""
    if isinstance(spec, EvictionPolicy):
        policy = spec
    elif isinstance(spec, type) and issubclass(spec, EvictionPolicy):
        policy = spec()
    elif isinstance(spec, str) and spec in POLICIES:
        policy = POLICIES[spec]()
    else:
        raise ValueError(f"eviction: expected one of {sorted(POLICIES)} or an EvictionPolicy, got {spec!r}")
    if plan is not None:
        policy.set_plan(plan)
    return policy
