"""Serving policies: at which width each routed (token, expert) slot runs, given what is resident.

The plan gives every routed slot a *wanted* width and a role (dominant: the heaviest
``num_dominant`` experts of the token; auxiliary: the others). A :class:`ServingPolicy` then
decides the *served* width from the resident prefix width ``r`` of the slot's expert at the
start of the layer step (CRISP's prefix format makes every narrower width free to serve from a
wider resident copy):

==========================  =================================================================
slot                        width it needs resident
==========================  =================================================================
wanted 0 (the plan skips)   none: skipped, unless ``aux_skipped`` is RESIDENT (an auxiliary whose expert holds
                            rows after the step's copies runs at that width: no copy)
``r >= wanted``             ``wanted`` (a hit)
auxiliary, ``0 < r < w``    ``r`` if ``aux_narrower`` is RESIDENT (no copy), or NARROW_ONLY and the plan
                            wants it narrower than its dominant width; else ``wanted``
auxiliary, ``r == 0``       ``wanted`` if ``aux_missing`` is LOAD, none (skip) if SKIP
dominant, ``r == 0``        ``floor = min(wanted, ceil(dominant_floor * full))``: a missed
                            dominant loads only the floor prefix, never less (``dominant_floor`` is a
                            fraction of the *neurons*: on a pack with a 2-bit tail, whose widths count
                            storage rows, :func:`floor_in_rows` restates it in rows)
dominant, ``0 < r < w``     ``max(r, floor)`` if ``dominant_widen`` is NEVER or AHEAD (no demand
                            copy beyond the floor), ``wanted`` if it is HIT (rows ``r..wanted``
                            copied on demand)
==========================  =================================================================

Then each slot is served from its expert's width *available* after the step's copies
(``a = max(r, widths needed by the step's slots of that expert)``): at ``min(wanted, a)``,
or at ``a`` ("wider for free": no extra bytes, more accuracy) when ``hit_width`` is RESIDENT;
a slot with ``a == 0`` is skipped. So a slot never costs a copy the table did not ask for.

The default policy (``ServingPolicy()``, named "plan") serves every slot at the plan's width:
the paper's behaviour, outputs independent of the cache and the budget. Everything here is pure
and deterministic for a given sequence of steps (the resident widths come in as a function);
:func:`plan_served_step` is the one planning function of a layer step, used by the runtime's
executor and by the simulator: serving decisions -> per-slot served widths -> the scheduler's
ordered :class:`~crisp_runtime.scheduling.scheduler.ExpertTask` list.

Why these knobs (shared/PERF-BOUNDS.md's simulation study, RTX 4090, 25% budget): serving an auxiliary at
its wider resident width costs no bytes and lowered the accuracy loss 1.32% -> 0.98%; a missed
dominant at a 75% prefix was +29% tokens/s for ~0.8 point of loss (62.5% passed 2% loss).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from crisp_runtime.residency.ledger import transient_rows
from crisp_runtime.scheduling.scheduler import CostModel, Placement, StepPlan, TaskOrder, plan_step
from crisp_runtime.scheduling.slot_values import SlotValues


class HitWidth(enum.Enum):
    """A slot whose expert is resident at least as wide as wanted runs at..."""

    WANTED = "wanted"  # ... the plan's width
    RESIDENT = "resident"  # ... the resident width (more accuracy, no extra bytes)


class AuxNarrower(enum.Enum):
    """An auxiliary resident narrower than wanted..."""

    WIDEN = "widen"  # ... is widened (rows r..wanted copied)
    RESIDENT = "resident"  # ... runs at the resident width (no copy)
    # ... runs at the resident width when the plan wants it narrower than the plan's dominant width, and is widened
    # when the plan wants it whole (a Hot pair, or heavy by routing weight: CrispPlan.aux_full_weight). Why: with
    # RESIDENT a heavy auxiliary ran at the prefix a light use had left (Warm 64 / Cold 32 tail pack at
    # 25%: weight 0.3 lost 0.90% decoded against 0.78% at the plan's widths)
    NARROW_ONLY = "narrow_only"


class DominantWiden(enum.Enum):
    """A dominant whose expert is resident narrower than wanted (e.g. loaded at the floor)..."""

    NEVER = "never"  # ... runs at max(resident, floor): the floor holds for every use
    HIT = "hit"  # ... is widened on demand to the wanted width (rows r..wanted copied): the floor holds for a miss
    AHEAD = "ahead"  # ... runs at max(resident, floor), and the prefetcher tops it up ahead of its next use


class AuxSkipped(enum.Enum):
    """An auxiliary the plan skips (wanted width 0)..."""

    SKIP = "skip"  # ... is skipped, whatever is resident
    # ... runs at the width its expert holds after the step's copies (none: skipped). No byte is copied for it,
    # so it changes accuracy and compute, never the copies (the CRISP prefix format makes any resident prefix a
    # valid narrower expert; what a skip-auxiliary or three-band plan skips is often resident at 50%)
    RESIDENT = "resident"


class AuxMissing(enum.Enum):
    """An auxiliary not resident at all..."""

    LOAD = "load"  # ... is loaded at the wanted width
    SKIP = "skip"  # ... is skipped


@dataclass(frozen=True)
class ServingPolicy:
    """How each routed expert is served from what the GPU cache holds (frozen; ``apply(..., serving=...)``).

    The default serves every expert at the plan's width, so outputs do not depend on the cache. The other
    fields trade accuracy for fewer copied bytes:

    - ``name``: a label (the named policies of ``make_serving`` use theirs).
    - ``hit_width``: ``wanted`` (run at the plan's width) or ``resident`` (run at everything resident, free).
    - ``aux_narrower``: an auxiliary resident narrower than wanted is widened (``widen``: copy the missing rows),
      run at what is resident (``resident``), or run at what is resident only when the plan narrows it
      (``narrow_only``).
    - ``aux_missing``: an auxiliary not resident at all is loaded (``load``) or skipped (``skip``).
    - ``dominant_floor``: a dominant expert never runs below this fraction of its neurons; a missed one loads only
      that prefix (1.0: the plan's width).
    - ``dominant_widen``: a dominant loaded at its floor is widened ``never``, on its next use (``hit``) or by the
      prefetcher ahead of it (``ahead``).
    - ``placement``: where experts run: ``gpu`` (default), ``hybrid``, ``hybrid_split`` (one expert split by
      neurons between GPU and CPU), ``static_hybrid``, ``cpu_only``.
    - ``transient_buffer``: ``hybrid_split`` only: full-width experts of GPU memory for a per-step buffer of the
      split's copies instead of admitting them to the cache (0: admit).
    - ``aux_skipped``: an auxiliary the plan skips stays skipped (``skip``) or runs at what is resident
      (``resident``).

    Named policies and when each pays: docs/serving-and-residency.md.
    """

    name: str = "plan"
    hit_width: HitWidth = HitWidth.WANTED
    aux_narrower: AuxNarrower = AuxNarrower.WIDEN
    aux_missing: AuxMissing = AuxMissing.LOAD
    dominant_floor: float = 1.0  # fraction of the full width a dominant never goes below
    # Where the step's experts are computed: GPU only (default), or with the host CPU
    # (``scheduler.Placement``): a CPU-served expert runs at its served width from host memory and is
    # neither copied nor admitted by the residency ledger.
    placement: Placement = Placement.GPU
    dominant_widen: DominantWiden = DominantWiden.NEVER
    # The neuron split's transient buffer (Placement.SPLIT only), in full-width experts of GPU memory
    # taken out of the budget: 0 (default) = a split's GPU prefix rows that are not resident are copied
    # and admitted to the cache (evicting, LRU); > 0 = at most that many rows per step are copied, into
    # a per-step buffer, admitted only where they fit without evicting (docs/hybrid.md:
    # at 25% the admitted copies evicted the pinned hot experts, hit rate 0.95 -> 0.34).
    transient_buffer: float = 0.0
    aux_skipped: AuxSkipped = AuxSkipped.SKIP

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ServingPolicy: name must be a non-empty string, got {self.name!r}")
        for attr, kind in (("hit_width", HitWidth), ("aux_narrower", AuxNarrower), ("aux_missing", AuxMissing),
                           ("placement", Placement), ("dominant_widen", DominantWiden),
                           ("aux_skipped", AuxSkipped)):
            value = getattr(self, attr)
            if not isinstance(value, kind):
                try:
                    object.__setattr__(self, attr, kind(value))
                except ValueError:
                    choices = ", ".join(m.value for m in kind)
                    raise ValueError(f"ServingPolicy: {attr} must be one of {choices}, got {value!r}") from None
        floor = self.dominant_floor
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 < floor <= 1.0:
            raise ValueError(f"ServingPolicy: dominant_floor must be a fraction in (0, 1], got {floor!r}")
        buf = self.transient_buffer
        if isinstance(buf, bool) or not isinstance(buf, (int, float)) or not 0.0 <= buf <= 8.0:
            raise ValueError(f"ServingPolicy: transient_buffer must be a number of full-width experts in [0, 8], "
                             f"got {buf!r}")
        if buf and self.placement is not Placement.SPLIT:
            raise ValueError(f"ServingPolicy: transient_buffer applies to placement 'hybrid_split' only, got "
                             f"placement {self.placement.value!r}")

    @functools.cached_property
    def follows_plan(self) -> bool:
        """True when every slot is served at the plan's width whatever is resident (the default).
        Cached: read per layer step (frozen fields; the cache lives in the instance's ``__dict__``)."""
        return (self.hit_width is HitWidth.WANTED and self.aux_narrower is AuxNarrower.WIDEN
                and self.aux_missing is AuxMissing.LOAD and self.dominant_floor == 1.0
                and self.aux_skipped is AuxSkipped.SKIP)

    def floor_width(self, wanted: int, full: int) -> int:
        return min(wanted, math.ceil(self.dominant_floor * full))

    def to_dict(self) -> dict:
        out = {"name": self.name, "hit_width": self.hit_width.value, "aux_narrower": self.aux_narrower.value,
               "aux_missing": self.aux_missing.value, "dominant_floor": self.dominant_floor}
        if self.placement is not Placement.GPU:  # GPU-only dicts carry no placement key (older readers load them)
            out["placement"] = self.placement.value
        if self.dominant_widen is not DominantWiden.NEVER:  # dicts of the policies before it stay as they were
            out["dominant_widen"] = self.dominant_widen.value
        if self.transient_buffer:
            out["transient_buffer"] = self.transient_buffer
        if self.aux_skipped is not AuxSkipped.SKIP:  # likewise
            out["aux_skipped"] = self.aux_skipped.value
        return out

    def transient_rows(self, full: int) -> int | None:
        """Rows of a layer of full width ``full`` the transient buffer holds (None: no buffer)."""
        return transient_rows(self.transient_buffer, full) if self.transient_buffer else None

    @classmethod
    def from_dict(cls, data: Mapping) -> ServingPolicy:
        unknown = set(data) - {"name", "hit_width", "aux_narrower", "aux_missing", "dominant_floor", "placement",
                                "dominant_widen", "transient_buffer", "aux_skipped"}
        if unknown:
            raise ValueError(f"ServingPolicy: unknown keys {sorted(unknown)}")
        return cls(**data)


# Named policies: "plan" (default, residency-blind), "resident" (auxiliaries served from what is
# resident, never below it), "resident-floor75" (and a missed dominant loads a 75% prefix).
SERVING_POLICIES: dict[str, ServingPolicy] = {
    "plan": ServingPolicy(),
    "resident": ServingPolicy("resident", HitWidth.RESIDENT, AuxNarrower.RESIDENT, AuxMissing.LOAD, 1.0),
    "resident-floor75": ServingPolicy("resident-floor75", HitWidth.RESIDENT, AuxNarrower.RESIDENT, AuxMissing.LOAD,
                                      0.75),
    # "resident", but an auxiliary the plan wants whole (Hot, or heavy by CrispPlan.aux_full_weight) is widened
    "resident-narrow-aux": ServingPolicy("resident-narrow-aux", HitWidth.RESIDENT, AuxNarrower.NARROW_ONLY,
                                         AuxMissing.LOAD, 1.0),
    # the same, and an auxiliary the plan skips runs at what its expert holds (AuxSkipped.RESIDENT)
    "resident-narrow-aux-revive": ServingPolicy("resident-narrow-aux-revive", HitWidth.RESIDENT,
                                                AuxNarrower.NARROW_ONLY, AuxMissing.LOAD, 1.0,
                                                aux_skipped=AuxSkipped.RESIDENT),
    # the same, and a dominant resident narrower than wanted is widened: on its next use ("-widen") or
    # by the prefetcher ahead of it ("-ahead")
    "resident-floor75-widen": ServingPolicy("resident-floor75-widen", HitWidth.RESIDENT, AuxNarrower.RESIDENT,
                                            AuxMissing.LOAD, 0.75, dominant_widen=DominantWiden.HIT),
    "resident-floor75-ahead": ServingPolicy("resident-floor75-ahead", HitWidth.RESIDENT, AuxNarrower.RESIDENT,
                                            AuxMissing.LOAD, 0.75, dominant_widen=DominantWiden.AHEAD),
    # With the host CPU: every slot at the plan's width; per step the split GPU / CPU of
    # minimal makespan ("hybrid"); resident experts on the GPU and all others on the CPU, nothing
    # copied ("static_hybrid", llama.cpp --n-cpu-moe style with pinned experts); all on the CPU.
    "hybrid": ServingPolicy("hybrid", placement=Placement.HYBRID),
    "static_hybrid": ServingPolicy("static_hybrid", placement=Placement.STATIC),
    "cpu_only": ServingPolicy("cpu_only", placement=Placement.CPU),
    # "hybrid" plus the neuron split: an expert's rows [0, s) on the GPU, [s, width) on the CPU
    # (scheduler.split_rows; docs/hybrid.md)
    "hybrid_split": ServingPolicy("hybrid_split", placement=Placement.SPLIT),
    # ... with its prefix copies in a per-step transient buffer of one full expert (not admitted; docs/hybrid.md)
    "hybrid_split_transient": ServingPolicy("hybrid_split_transient", placement=Placement.SPLIT, transient_buffer=1.0),
}


_FLOOR_NAME = "resident-floor"
_NARROW_SUFFIX, _REVIVE_SUFFIX = "-narrow-aux", "-revive"


def resident_policy(floor: float, aux_narrower: AuxNarrower = AuxNarrower.RESIDENT,
                    aux_skipped: AuxSkipped = AuxSkipped.SKIP) -> ServingPolicy:
    """``resident`` (auxiliaries served from what is resident: wider for free, narrower without a copy; with
    ``AuxNarrower.NARROW_ONLY`` only those the plan wants narrower than its dominant width) with a missed dominant
    at ``floor`` of the full width, and ``aux_skipped``; named ``resident-floorP[-narrow-aux][-revive]``, or the
    named policy of :data:`SERVING_POLICIES` when there is one (floor 1: ``resident``, ``resident-narrow-aux``)."""
    if aux_narrower not in (AuxNarrower.RESIDENT, AuxNarrower.NARROW_ONLY):
        raise ValueError(f"resident_policy: aux_narrower must be RESIDENT or NARROW_ONLY, got {aux_narrower!r}")
    name = "resident" if floor == 1.0 else f"{_FLOOR_NAME}{100 * floor:g}"
    if aux_narrower is AuxNarrower.NARROW_ONLY:
        name = "resident-narrow-aux" if floor == 1.0 else name + _NARROW_SUFFIX
    if aux_skipped is AuxSkipped.RESIDENT:
        name += _REVIVE_SUFFIX
    if name in SERVING_POLICIES:
        return SERVING_POLICIES[name]
    return ServingPolicy(name, HitWidth.RESIDENT, aux_narrower, AuxMissing.LOAD, floor, aux_skipped=aux_skipped)


def floor_in_rows(policy: ServingPolicy, neurons: int, rows: int, rows_for: Callable[[int], int]) -> ServingPolicy:
    """``policy`` with its dominant floor, a fraction of an expert's ``neurons``, restated as a fraction of its
    ``rows`` storage rows (a 2-bit tail pack: ``rows_for(n)`` rows hold the first n neurons), so that
    :meth:`ServingPolicy.floor_width` on rows gives ``rows_for(ceil(dominant_floor * neurons))`` exactly. The
    runtime applies it to a tail pack and the simulator's tail mapping to its mapped rows (one rule for both:
    a fraction of the rows would give 140 of a 2g128@0.25 expert's 160 rows = 216 of 256 neurons at 87.5%, where
    the floor means 224 neurons). Unchanged at floor 1 and
    without a tail (rows == neurons)."""
    if policy.dominant_floor >= 1.0 or rows == neurons:
        return policy
    want = max(1, rows_for(math.ceil(policy.dominant_floor * neurons)))
    # half a row below: ceil(fraction * rows) == want whatever the float rounding of the product
    return dataclasses.replace(policy, dominant_floor=(want - 0.5) / rows if want < rows else 1.0)


def serving_by_name(name: str) -> ServingPolicy:
    """A named policy of :data:`SERVING_POLICIES`, or ``resident-floorP`` (:func:`resident_policy` with a missed
    dominant loading P percent of the full width, 0 < P <= 100) optionally followed by ``-narrow-aux``
    (AuxNarrower.NARROW_ONLY) and ``-revive`` (AuxSkipped.RESIDENT), in that order: e.g.
    ``resident-floor87.5-narrow-aux``. What the benchmarks' ``--serving`` lists take; ValueError otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"serving: expected a policy name, got {name!r}")
    if name in SERVING_POLICIES:
        return SERVING_POLICIES[name]
    rest = name
    revive = rest.endswith(_REVIVE_SUFFIX)
    rest = rest.removesuffix(_REVIVE_SUFFIX)
    narrow = rest.endswith(_NARROW_SUFFIX)
    rest = rest.removesuffix(_NARROW_SUFFIX)
    percent = rest.removeprefix(_FLOOR_NAME) if rest.startswith(_FLOOR_NAME) else ""
    floor = float(percent) / 100 if percent.replace(".", "", 1).isdigit() else math.nan
    if not 0.0 < floor <= 1.0:
        raise ValueError(f"serving: unknown policy {name!r}: expected one of {', '.join(SERVING_POLICIES)}, or "
                         f"resident-floorP[-narrow-aux][-revive] with 0 < P <= 100")
    return resident_policy(floor, AuxNarrower.NARROW_ONLY if narrow else AuxNarrower.RESIDENT,
                           AuxSkipped.RESIDENT if revive else AuxSkipped.SKIP)


def check_policy_name(policy: ServingPolicy) -> ServingPolicy:
    """``policy``, refused (ValueError) when it takes the name of a policy of :data:`SERVING_POLICIES` with other
    fields: what runs is then not what the name says (``stats()["serving"]`` and logs report the name)."""
    builtin = SERVING_POLICIES.get(policy.name)
    if builtin is not None and builtin != policy:
        ours, theirs = policy.to_dict(), builtin.to_dict()
        differ = ", ".join(f"{k}={ours.get(k)!r} (built-in: {theirs.get(k)!r})"
                           for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k))
        raise ValueError(f"serving: a policy named {policy.name!r} differs from the built-in {policy.name!r} in "
                         f"{differ}; give it a name of its own (the name is what stats and logs report)")
    return policy


def make_serving(spec) -> ServingPolicy:
    """A policy from a name (:func:`serving_by_name`: one in :data:`SERVING_POLICIES` or
    ``resident-floorP[-narrow-aux][-revive]``), a dict (``to_dict`` form) or an instance. A dict or instance
    named like a built-in policy must have its fields (:func:`check_policy_name`)."""
    if isinstance(spec, ServingPolicy):
        return check_policy_name(spec)
    if isinstance(spec, str):
        return serving_by_name(spec)
    if isinstance(spec, Mapping):
        return check_policy_name(ServingPolicy.from_dict(spec))
    raise ValueError(f"serving: expected a policy name ({', '.join(SERVING_POLICIES)}, or "
                     f"resident-floorP[-narrow-aux][-revive]), a dict or a ServingPolicy, got {spec!r}")


class ServedSlots(NamedTuple):
    """Served widths of one layer step, (T, k) int64 like the plan's, and what serving changed.

    ``widths``, ``wanted`` and ``dominant`` are tensors built on first read: a decode step is
    served in Python lists (``slot_values.SlotValues``; ``served_list`` reads them as a list).
    A NamedTuple: built once per layer step (as a frozen dataclass ~4 us on the 2-core VM).
    """

    slot_widths: SlotValues  # served width per slot (0 = not run)
    slot_wanted: SlotValues  # the plan's width per slot
    slot_dominant: SlotValues | None  # (T, k) bool; None when the policy follows the plan (roles not computed)
    fallbacks: int  # slots served narrower than wanted (> 0)
    skips: int  # slots wanted > 0 served 0
    wider: int  # slots served wider than wanted
    # Served slots and neurons per role (zeros when the roles were not computed: the default policy).
    dominant_slots: int = 0
    dominant_neurons: int = 0
    aux_slots: int = 0
    aux_neurons: int = 0
    widened: int = 0  # dominant slots widened on demand beyond what NEVER would serve (DominantWiden.HIT)

    @property
    def widths(self) -> torch.Tensor:
        return self.slot_widths.tensor()

    @property
    def wanted(self) -> torch.Tensor:
        return self.slot_wanted.tensor()

    @property
    def dominant(self) -> torch.Tensor | None:
        return None if self.slot_dominant is None else self.slot_dominant.tensor()

    @property
    def served_list(self) -> list[int]:
        """``widths`` flattened, as a Python list (do not modify it)."""
        return self.slot_widths.values()


def serve_slots(policy: ServingPolicy, index: torch.Tensor, wanted: torch.Tensor, dominant: torch.Tensor | None, *,
                num_experts: int, full_width: int, resident_width: Callable[[int], int],
                whole_width: int | None = None) -> ServedSlots:
    """Served widths of one step's slots (see the module docstring); all CPU, pure. ``whole_width``: the plan's
    dominant width (``CrispPlan.dominant_width``; default ``full_width``), what ``AuxNarrower.NARROW_ONLY`` keeps."""
    if policy.follows_plan and dominant is None:  # the default's fast path: no residency lookups, no roles
        same = SlotValues(wanted)
        return ServedSlots(same, same, None, 0, 0, 0)
    if dominant is None:
        raise ValueError(f"serve_slots: serving policy {policy.name!r} needs the slots' roles (dominant mask)")
    # Nested tolist + flatten in Python: a reshape per tensor is one more dispatch (~1 us each).
    flat_e = [v for row in index.tolist() for v in row]
    flat_w = [v for row in wanted.tolist() for v in row]
    flat_d = [v for row in dominant.tolist() for v in row]
    served, counts = _serve_lists(policy, flat_e, flat_w, flat_d, num_experts, full_width, resident_width,
                                  full_width if whole_width is None else whole_width)
    return ServedSlots(SlotValues(served, tuple(wanted.shape)), SlotValues(wanted), SlotValues(dominant, None,
                                                                                               torch.bool), *counts)


def _serve_lists(policy: ServingPolicy, flat_e: list[int], flat_w: list[int], flat_d: list[bool], num_experts: int,
                 full_width: int, resident_width: Callable[[int], int], whole_width: int
                 ) -> tuple[list[int], tuple[int, ...]]:
    """The served width of each slot (flat lists) and the counters of :class:`ServedSlots`."""
    resident: dict[int, int] = {}
    served = [0] * len(flat_w)
    widen = policy.dominant_widen is DominantWiden.HIT
    widened = 0
    revive = policy.aux_skipped is AuxSkipped.RESIDENT
    for p, (e, w, dom) in enumerate(zip(flat_e, flat_w, flat_d, strict=True)):
        if not 0 <= e < num_experts:
            continue
        if w <= 0:
            if revive and not dom and e not in resident:
                resident[e] = resident_width(e)
            continue
        r = resident.get(e)
        if r is None:
            r = resident[e] = resident_width(e)
        served[p] = _serve_one(policy, w, dom, r, full_width, whole_width)
        if widen and dom and 0 < r < w and served[p] > max(r, policy.floor_width(w, full_width)):
            widened += 1
    # A slot served below what its expert will hold after the step's copies gets those rows for free.
    available = dict(resident)
    for e, s in zip(flat_e, served, strict=True):
        if s > available.get(e, 0):
            available[e] = s
    fallbacks = skips = wider = dom_slots = dom_neurons = aux_slots = aux_neurons = 0
    free = policy.hit_width is HitWidth.RESIDENT
    for p, (e, w) in enumerate(zip(flat_e, flat_w, strict=True)):
        if not 0 <= e < num_experts:
            continue
        if w <= 0:  # the plan skips it: an auxiliary (a dominant's width is never 0)
            a = available.get(e, 0) if revive and not flat_d[p] else 0
            if a:
                served[p] = a
                wider += 1
                aux_slots += 1
                aux_neurons += a
            continue
        a = available.get(e, 0)
        s = served[p]
        if free:
            s = a
        elif s < w:
            s = min(w, a)
        served[p] = s
        if s == 0:
            skips += 1
            continue
        if s < w:
            fallbacks += 1
        elif s > w:
            wider += 1
        if flat_d[p]:
            dom_slots += 1
            dom_neurons += s
        else:
            aux_slots += 1
            aux_neurons += s
    return served, (fallbacks, skips, wider, dom_slots, dom_neurons, aux_slots, aux_neurons, widened)


def miss_width(policy: ServingPolicy, wanted: int, dominant: bool, full: int) -> int:
    """The prefix ``policy`` loads for a slot whose expert holds nothing (0 = skipped): the floor for a
    dominant, the wanted width for an auxiliary (0 under ``AuxMissing.SKIP``). What a prefetch at the
    serving policy's widths asks (``crisp_runtime.scheduling.prefetch.PrefetchWidth.SERVING``)."""
    return _serve_one(policy, wanted, dominant, 0, full) if wanted > 0 else 0


def ahead_width(policy: ServingPolicy, wanted: int, dominant: bool, full: int) -> int:
    """The prefix a copy made ahead of demand (a prefetch) should have for a slot whose expert holds
    nothing, so that its first use copies nothing more: :func:`miss_width`, except a dominant under
    ``DominantWiden.HIT``, which its first use would widen to ``wanted`` (the expert is then resident)."""
    if dominant and wanted > 0 and policy.dominant_widen is DominantWiden.HIT:
        return wanted
    return miss_width(policy, wanted, dominant, full)


def _serve_one(policy: ServingPolicy, wanted: int, dominant: bool, resident: int, full: int,
               whole: int | None = None) -> int:
    if resident >= wanted:
        return wanted
    if dominant:
        if resident and policy.dominant_widen is DominantWiden.HIT:
            return wanted
        return max(resident, policy.floor_width(wanted, full))
    if resident > 0:
        narrow = policy.aux_narrower
        if narrow is AuxNarrower.RESIDENT or narrow is AuxNarrower.NARROW_ONLY and wanted < (
                full if whole is None else whole):
            return resident
        return wanted
    return wanted if policy.aux_missing is AuxMissing.LOAD else 0


# Steps with at most this many routed slots (T * k) are planned on Python lists (the plan's and the
# scheduler's small-step thresholds are the same 64).
_LIST_PATH_MAX_SLOTS = 64


def plan_served_step(policy: ServingPolicy, plan, layer_id: int, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor, *, num_experts: int, neuron_nbytes: int,
                     resident_width: Callable[[int], int], cost: CostModel | None = None,
                     order: TaskOrder = TaskOrder.JOHNSON) -> tuple[ServedSlots, StepPlan]:
    """One layer step's plan: the plan's wanted widths and roles, the served widths, the ordered tasks.

    top_k_index / top_k_weights: (T, k) tensors as the router returns them (int ids, float weights).
    resident_width(e): expert e's resident prefix width in this layer now (0 = none).

    A step of at most 64 routed slots (decode) runs on Python lists end to end: the routing is read
    with one ``tolist`` each, and no tensor is built (the results' tensors are built if read; see
    ``slot_values``). Larger steps run the plan's tensor rules. Both give the same values.
    """
    roles = not policy.follows_plan
    if top_k_index.numel() <= _LIST_PATH_MAX_SLOTS:
        flat_e, flat_w, flat_d = plan.widths_and_roles_lists(layer_id, top_k_index, top_k_weights, roles=roles)
        shape = tuple(top_k_index.shape)
        wanted_v = SlotValues(flat_w, shape)
        if not roles:  # the default policy: every slot at the plan's width
            served = ServedSlots(wanted_v, wanted_v, None, 0, 0, 0)
        else:
            widths, counts = _serve_lists(policy, flat_e, flat_w, flat_d, num_experts, plan.intermediate_size,
                                          resident_width, plan.dominant_width)
            served = ServedSlots(SlotValues(widths, shape), wanted_v, SlotValues(flat_d, shape, torch.bool), *counts)
        step_index, step_widths = SlotValues(flat_e, shape), served.slot_widths
    else:
        index = top_k_index.detach().to("cpu", torch.int64)
        wanted, dominant = plan.token_widths_and_roles(layer_id, index, top_k_weights, roles=roles)
        served = serve_slots(policy, index, wanted, dominant, num_experts=num_experts,
                             full_width=plan.intermediate_size, resident_width=resident_width,
                             whole_width=plan.dominant_width)
        step_index, step_widths = index, served.widths
    step = plan_step(step_index, step_widths, num_experts=num_experts, neuron_nbytes=neuron_nbytes,
                     resident_width=resident_width, cost=CostModel() if cost is None else cost, order=order,
                     placement=policy.placement, max_copy_rows=policy.transient_rows(plan.intermediate_size))
    return served, step
