"""A discrete-event simulation of batch-1 decoding with experts offloaded to host memory.

Per token, MoE layer after MoE layer (the next layer starts when the previous one ends):

    compute engine: other (attention, norms)  ->  router  ->  expert computes
    copy engine:                                         expert copies (H2D)  [-> prefetch copies]

The decisions are the runtime's own code, so the simulator and ``crisp_runtime`` cannot drift:

- widths and roles: the plan (``CrispPlan.token_widths_and_roles``);
- served widths: the serving policy (``crisp_runtime.planning.serving.serve_slots``: the default follows
  the plan; the residency-aware ones serve auxiliaries from what is resident and give a missed
  dominant a floor prefix);
- grouping and issue order: ``crisp_runtime.scheduling.scheduler.plan_step`` (Johnson's rule);
- residency: one ``crisp_runtime.residency.ledger.ResidencyLedger`` per cache (hits, widenings,
  misses, evictions, bytes; requests in issue order, each protecting the step's experts not yet
  run, so a budget below one step's experts streams as the runtime does);
- eviction: ``crisp_runtime.residency.eviction`` (LRU, frequency, tier-aware on the plan's tiers mapped onto the
  target's layers (``target_plan``), next-use; each optionally pinned (``<name>+pinned``: ``PinnedPolicy``
  over the trace's most used experts up to ``PIN_SHARE`` of the budget); Belady given the future).

Only time is the simulator's own: each expert becomes a job (load = copy of its missing bytes,
compute = its width). Copies and computes overlap as a two-stage flow shop: the copy engine
copies one expert after another; an expert's compute starts when its copy is done and the
compute engine is free (a permutation schedule). Orders:

    serial        load expert, compute it, then the next: nothing overlaps (the paper's
                  layer breakdown adds up like this); router order
    router        overlapped, in router order (slot order of top_k_index)
    widest_first  overlapped, Johnson's rule (``crisp_runtime.scheduling.scheduler.johnson_order`` on the
                  profile's times): the runtime's order, optimal for the two-stage flow shop

The ledger sees the requests in the runtime's issue order whatever order is timed; the three
orders share its decisions.

Prefetch (``SimPolicy.prefetch``, widest-first order only): after layer l's demanded copies, the
copy engine copies what the runtime's prefetcher asks for layer l+1 (the predicted top-k at the
widths ``SimPolicy.prefetch_width`` gives them, the runtime's own rule; widest first) through
``ResidencyLedger.prefetch`` (same budget; never evicts the step's experts), but only rows that
are copied before layer l+1's router ends, when its demanded copies may start: a prefetch never
delays a demanded copy. The cut and the timeline that decides it are the runtime's
(``crisp_runtime.scheduling.copy_window``: ``CopyClock`` on ``HardwareProfile.prefetch_window``), which the
runtime in the loop applies through ``PrefetchPolicy.window`` (``target_window``). Predictions come
with the trace (``predicted``, recorded by ``crisp_runtime.scheduling.prefetch``); without them there is no prefetch.

Hybrid placement (``ServingPolicy.placement`` other than GPU, the profile with a CPU,
widest-first order only): the runtime's ``plan_step(placement=...)`` splits each step between the
GPU and the CPU on the profile's cost model (``HardwareProfile.cost_model``); only the GPU's
experts go through the ledger (a CPU-served expert is neither copied nor admitted). The step's
time is ``scheduler.split_makespan`` on the profile's times: the GPU's flow shop (copies at the
reduced H2D rate when the CPU works) against the CPU's experts back to back plus one join.
``static_hybrid`` and ``hybrid`` start with the most used experts of the trace (counts of the
plan's routed slots over the whole trace: the placement a user of ``--n-cpu-moe`` picks offline,
an oracle for both) resident at full width within the budget; ``static_hybrid`` never changes
them, ``hybrid`` copies (and evicts, LRU) when the split says a copy is faster. ``hybrid_split``
(``Placement.SPLIT``) is ``hybrid`` with the neuron split: a task's GPU prefix ``gpu_width`` goes
through the ledger, its rows beyond run on the CPU, the task counted on both sides of the makespan.
With ``ServingPolicy.transient_buffer`` the buffer comes out of the budget and a prefix's missing rows
go through ``ResidencyLedger.request_transient`` (into the buffer, not admitted, when they do not fit
in the free budget), as the runtime asks. Prefetch under a CPU placement (``_hybrid_prefetch``): the
next layer's predicted experts, from the end of the step's demanded copies (at the busy H2D rate while
the step lasts, converted to full-rate time) to the next router's end (the CPU computes no expert in
attention, so the rest runs at the full rate); nothing copied after that deadline. The step's times and
that span are ``crisp_runtime.scheduling.copy_window.CopyClock.hybrid_step``: the runtime's clock with
``PrefetchPolicy.window`` under a CPU placement, so the runtime in the loop cuts the same prefetches.

Everything here is plain Python and deterministic; times are seconds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from crisp_runtime.execution.runtime import min_budget_bytes
from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.planning.serving import ServingPolicy, serve_slots
from crisp_runtime.residency.eviction import POLICIES as ONLINE_EVICTIONS
from crisp_runtime.residency.eviction import BeladyPolicy, EvictionPolicy, PinnedPolicy, make_policy
from crisp_runtime.residency.ledger import TRANSIENT, LedgerCounters, ResidencyLedger, pin_most_used
from crisp_runtime.scheduling.copy_window import (
    CopyClock,
    Job,
    PrefetchSpan,
    Slot,
    admit_requests,
    hybrid_jobs,
    johnson_jobs,
    overlap_schedule,
)
from crisp_runtime.scheduling.prefetch import (
    PrefetchPolicy,
    PrefetchWidth,
    merge_requests,
    slot_widths,
    topup_requests,
    widest_first,
)
from crisp_runtime.scheduling.scheduler import (
    SPLIT_GRANULE,
    CostModel,
    Placement,
    plan_step,
)

from .common import ORDERS, CliError
from .profiles import HardwareProfile
from .shapes import ModelShape

# Eviction of every cache: the runtime's online policies (crisp_runtime/residency/eviction.py), each also with a pinned
# hot set ("<name>+pinned"), and Belady's offline furthest-next-use, the reference every online policy is
# reported against.
PINNED = "+pinned"
BELADY = "belady"
EVICTIONS = (*ONLINE_EVICTIONS, *(name + PINNED for name in ONLINE_EVICTIONS), BELADY)
# The pinned set's share of the cache budget. A quarter: on the committed trace at a 25% budget (Mixtral,
# rtx4090-pcie4) shares 1/8 to 3/8 give lru+pinned 4.52-4.58 tok/s, next_use+pinned 4.75-4.92; 1/2 and 3/4
# crowd out the recently used experts (lru+pinned 4.43, 4.12).
PIN_SHARE = 0.25
CACHE_SCOPES = ("global", "layer")


class BudgetTooSmall(CliError):
    """The cache budget cannot hold one full-width expert."""


def budget_for_fraction(option: str, fraction: float, layers, top_k: int, total: int) -> int:
    """The GPU budget in bytes of ``fraction`` of ``total`` expert bytes, checked against packed ``layers``: a
    budget below one token's experts at full width (``min_budget_bytes``, what ``crisp_runtime.apply`` refuses) is
    :class:`BudgetTooSmall` naming ``option``, before any work."""
    budget = int(fraction * total)
    need = min_budget_bytes(layers, top_k)
    if budget < need:
        least = math.ceil(need / total * 1000) / 1000 if total > 0 else math.inf
        hint = f"give at least {least:g}" if least <= 1 else "no share of the expert bytes holds them"
        raise BudgetTooSmall(f"{option} {fraction:g}: {budget:,} B is below one token's experts at full width "
                             f"({top_k} x {need // top_k:,} B = {need / max(1, total):.1%} of the {total:,} expert "
                             f"bytes); {hint}")
    return budget


@dataclass(frozen=True)
class SimPolicy:
    """One simulated configuration: widths (plan), serving, eviction and prefetch."""

    name: str  # the plan's policy name in records: full, uniform, skip_aux, crisp
    plan: CrispPlan  # in the traced model's layers and neurons
    serving: ServingPolicy = field(default_factory=ServingPolicy)
    eviction: str = "lru"
    prefetch: bool = False
    # The width each prefetched slot is asked at (``scheduling.prefetch.PrefetchWidth``), when ``prefetch``.
    prefetch_width: PrefetchWidth = PrefetchWidth.PLAN
    variant: str = ""  # the plan's knob when one run sweeps it, e.g. "w96" (uniform width), "t0.3" (threshold)

    def __post_init__(self) -> None:
        check_eviction(self.eviction)
        object.__setattr__(self, "prefetch_width", PrefetchPolicy(width=self.prefetch_width).width)

    @property
    def label(self) -> str:
        """e.g. ``crisp/resident/next_use+prefetch``, ``crisp/resident-floor75/lru+prefetch-serving``,
        ``uniform@w96/plan/next_use``: unique in one run (prefetch at the plan's widths: ``+prefetch``)."""
        name = f"{self.name}@{self.variant}" if self.variant else self.name
        suffix = ""
        if self.prefetch:
            width = self.prefetch_width
            suffix = "+prefetch" + ("" if width is PrefetchWidth.PLAN else f"-{width.value}")
        return f"{name}/{self.serving.name}/{self.eviction}" + suffix


def check_eviction(name: str) -> str:
    """``name`` if the simulator knows it (one of ``EVICTIONS``); a ValueError naming the valid ones otherwise."""
    if name == BELADY + PINNED:
        raise ValueError(f"eviction {name!r}: Belady is offline and cannot be pinned (it already keeps whatever is "
                         f"used soonest; a pinned set could only overrule it); choose one of {', '.join(EVICTIONS)}")
    if name not in EVICTIONS:
        raise ValueError(f"eviction {name!r}: choose one of {', '.join(EVICTIONS)}")
    return name


# ---------------------------------------------------------------------------- flow shop


def order_jobs(jobs: Sequence[Job], order: str) -> list[Job]:
    """``jobs`` (router order) in the order ``order`` runs them."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}")
    if order != "widest_first":
        return list(jobs)
    return johnson_jobs(jobs)


def schedule(jobs: Sequence[Job], order: str, start: float = 0.0, copy_free: float = 0.0) -> tuple[float, list[Slot]]:
    """Times of one layer's experts from ``start`` (the router's end); returns (end, slots).

    jobs: in router order. copy_free: when the copy engine is free (a prefetch may still be
    copying; the prefetch rule makes that <= ``start``). The overlapped orders are
    ``crisp_runtime.scheduling.copy_window.overlap_schedule`` (the runtime's modeled clock times steps with it).
    """
    seq = order_jobs(jobs, order)
    if order != "serial":
        return overlap_schedule(seq, start, copy_free)
    slots: list[Slot] = []
    t = max(start, copy_free)
    for j in seq:
        copy_end = t + j.load_s
        end = copy_end + j.compute_s
        slots.append(Slot(j.expert, t, copy_end, copy_end, end))
        t = end
    return t, slots


def flow_shop_bound(jobs: Sequence[Job]) -> float:
    """A lower bound on any schedule's makespan: max(all loads + last compute, first load + all computes)."""
    if not jobs:
        return 0.0
    loads = sum(j.load_s for j in jobs)
    computes = sum(j.compute_s for j in jobs)
    return max(loads + min(j.compute_s for j in jobs), min(j.load_s for j in jobs) + computes)


# ---------------------------------------------------------------------------- results


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
    counters: LedgerCounters  # demand hits / widenings / misses, evictions, bytes; prefetch counts
    bytes_computed: int = 0
    load_s: float = 0.0  # sum of demanded copy durations
    compute_s: float = 0.0  # sum of expert compute durations
    router_s: float = 0.0
    other_s: float = 0.0
    experts_run: int = 0
    fallbacks: int = 0  # slots served narrower than the plan wanted
    skips: int = 0  # slots the plan wanted but serving skipped
    wider: int = 0  # slots served wider than wanted (resident rows, no extra bytes)
    widened: int = 0  # dominant slots widened on demand (DominantWiden.HIT)
    cpu_s: float = 0.0  # sum of the CPU's expert durations (hybrid placement)
    cpu_runs: int = 0  # experts computed on the CPU
    splits: int = 0  # experts split between the GPU (a prefix) and the CPU (the other rows), hybrid_split
    peak_bytes: int = 0  # most bytes resident at once (all caches)
    per_order: dict[str, OrderTotals] = field(default_factory=dict)

    @property
    def bytes_copied(self) -> int:
        """Everything the copy engine moved: demand + prefetch."""
        return self.counters.bytes_copied + self.counters.prefetch_bytes

    def tokens_per_s(self, order: str) -> float:
        t = self.per_order[order].time_s
        return self.tokens / t if t > 0 else float("inf")

    def summary(self, order: str) -> dict:
        """A flat record of this run under one order (times in ms per MoE layer)."""
        steps = max(1, self.tokens * self.layers)
        tokens = max(1, self.tokens)
        tot = self.per_order[order]
        c = self.counters
        accesses = c.hits + c.widenings + c.misses + c.transients
        return {
            "order": order,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s(order),
            "ms_per_token": 1e3 * tot.time_s / tokens,
            "bytes_per_token": self.bytes_copied / tokens,
            "prefetch_bytes_per_token": c.prefetch_bytes / tokens,
            "bytes_computed_per_token": self.bytes_computed / tokens,
            "hit_rate": c.hits / accesses if accesses else 0.0,
            "widened_rate": c.widenings / accesses if accesses else 0.0,
            "evictions_per_token": c.evictions / tokens,
            "transient_bytes_per_token": c.transient_bytes / tokens,  # of bytes_per_token: not admitted
            "prefetches_per_token": c.prefetches / tokens,
            "prefetch_hits_per_token": c.prefetch_hits / tokens,
            "fallbacks_per_token": self.fallbacks / tokens,
            "skips_per_token": self.skips / tokens,
            "wider_per_token": self.wider / tokens,
            "widened_per_token": self.widened / tokens,
            "experts_per_layer": self.experts_run / steps,
            "cpu_experts_per_layer": self.cpu_runs / steps,
            "split_experts_per_layer": self.splits / steps,
            "cpu_ms": 1e3 * self.cpu_s / steps,
            "layer_ms": 1e3 * tot.time_s / steps,
            "load_ms": 1e3 * self.load_s / steps,
            "compute_ms": 1e3 * self.compute_s / steps,
            "router_ms": 1e3 * self.router_s / steps,
            "other_ms": 1e3 * self.other_s / steps,
            "expert_phase_ms": 1e3 * tot.expert_s / steps,
            "flow_shop_bound_ms": 1e3 * tot.bound_s / steps,
        }


# ---------------------------------------------------------------------------- decoding


def neuron_scale(trace_intermediate: int, shape: ModelShape) -> int:
    """Target neurons per traced neuron (widths are kept as fractions of I, exactly)."""
    if shape.intermediate_size % trace_intermediate:
        raise ValueError(f"the traced model's I={trace_intermediate} does not divide the target's "
                         f"I={shape.intermediate_size}: widths cannot be mapped exactly (use --target native)")
    return shape.intermediate_size // trace_intermediate


def simulate_decode(
    trace,
    policy: SimPolicy,
    profile: HardwareProfile,
    shape: ModelShape,
    budget_bytes: int,
    *,
    orders: Sequence[str] = ORDERS,
    warmup: int = 0,
    cache_scope: str = "global",
    predicted: np.ndarray | None = None,
    progress=None,
    timeline: list | None = None,
) -> SimResult:
    """Decode the trace's tokens one at a time through ``shape.num_layers`` MoE layers.

    trace: ``bench.traces.Trace`` ((L, T, k) routing of the traced model); target layer l replays
    traced layer l mod L for the same token. Widths live in the traced model's neurons, each worth
    ``shape.intermediate_size / I`` target neurons of bytes. The first ``warmup`` tokens run
    (filling the cache) but are not counted.
    predicted: (L, T, n) experts of traced layer j + 1 predicted at layer j (-1 = none), for
    ``policy.prefetch``. timeline: a list to append each counted step's widest-first times to.
    """
    for o in orders:
        if o not in ORDERS:
            raise ValueError(f"unknown order {o!r}; choose one of {', '.join(ORDERS)}")
    if cache_scope not in CACHE_SCOPES:
        raise ValueError(f"cache_scope must be 'global' or 'layer', got {cache_scope!r}")
    if policy.prefetch and list(orders) != ["widest_first"]:
        raise ValueError("prefetch is simulated in the runtime's order only: orders=['widest_first']")
    placement = policy.serving.placement
    if placement.uses_cpu:
        if not profile.has_cpu:
            raise ValueError(f"placement {placement.value!r} needs a hardware profile with a CPU (cpu_bytes_per_s); "
                             f"{profile.name!r} has none (try rtx4090-pcie4-ddr5)")
        if list(orders) != ["widest_first"] or timeline is not None:
            raise ValueError(f"placement {placement.value!r} is simulated in the runtime's order only, without "
                             "a timeline: orders=['widest_first']")
    num_tokens, src_layers, inter = trace.num_tokens, trace.num_layers, trace.intermediate_size
    if not 0 <= warmup < num_tokens:
        raise ValueError(f"warmup ({warmup}) must lie in [0, {num_tokens}) (the number of tokens)")
    nb = shape.neuron_nbytes * neuron_scale(inter, shape)
    # the neuron split's granule in traced neurons: SPLIT_GRANULE target neurons (the CPU kernel's block), or
    # 1/16 of the width for experts narrower than 1024 neurons (toy shapes); 1 for Mixtral (56 each)
    granule = max(1, min(SPLIT_GRANULE, shape.intermediate_size // 16) // neuron_scale(inter, shape))
    layers = shape.num_layers
    per_cache = budget_bytes // layers if cache_scope == "layer" else budget_bytes
    if per_cache < shape.expert_nbytes:
        raise BudgetTooSmall(
            f"GPU budget of {budget_bytes:,} bytes ({budget_bytes / shape.total_expert_nbytes:.2%} of the expert "
            f"bytes) holds less than one full-width expert ({shape.expert_nbytes:,} bytes)"
            + (" per layer" if cache_scope == "layer" else ""))
    plan, serving = policy.plan, policy.serving
    # The plan's wanted widths and roles of every traced step at once (the runtime asks per step;
    # the rules are per token, so the result is the same).
    routed, wanted, dominant = [], [], []
    for li, layer_id in enumerate(trace.layer_ids):
        idx = torch.from_numpy(np.ascontiguousarray(trace.index[li])).to(torch.int64)
        w, d = plan.token_widths_and_roles(layer_id, idx, torch.from_numpy(np.ascontiguousarray(trace.weights[li])),
                                           roles=not serving.follows_plan)
        routed.append(idx)
        wanted.append(w)
        dominant.append(d)
    # the neuron split's transient buffer (ServingPolicy.transient_buffer) comes out of the GPU budget
    copy_rows = serving.transient_rows(inter)
    room = 0 if copy_rows is None else copy_rows * nb
    ledgers = _ledgers(policy, budget_bytes - room, layers, cache_scope, nb, inter, wanted, routed, num_tokens,
                       trace.layer_ids)
    # one (1, k) view per traced step, split once: slicing per step costs more than the step's planning
    idx_rows = [list(r.split(1)) for r in routed]
    idx_lists = [r.tolist() for r in routed]
    want_rows = [list(w.split(1)) for w in wanted]
    dom_rows = [None if d is None else list(d.split(1)) for d in dominant]
    cost = CostModel(h2d_bytes_per_s=profile.h2d_bytes_per_s, device_bytes_per_s=profile.compute_bytes_per_s)
    if placement.uses_cpu:
        cost = profile.cost_model()
        if placement in (Placement.STATIC, Placement.HYBRID, Placement.SPLIT):
            _pin_hot_experts(ledgers, routed, wanted, layers, nb, inter)
    res = SimResult(0, layers, ledgers[0].counters, per_order={o: OrderTotals() for o in orders})
    lead = profile.other_s + profile.router_s
    requests = topups = None
    if policy.prefetch:
        requests = prefetch_requests(plan, trace, predicted, PrefetchPolicy(width=policy.prefetch_width), serving)
        topups = prefetch_requests(plan, trace, predicted, PrefetchPolicy(width=policy.prefetch_width), serving,
                                   phase=2)
    # widest-first with prefetch or a timeline: the modeled clock of scheduling.copy_window (the runtime's, with
    # PrefetchPolicy.window): each step's times, its prefetch span, the copy engine's spill into the next step
    # (a CPU placement's steps are timed by its hybrid_step, with or without prefetch)
    copy_clock = (CopyClock(profile.prefetch_window(nb)) if policy.prefetch or timeline is not None
                  or placement.uses_cpu else None)
    clock = 0.0  # widest-first: absolute time of the current layer's start (for the timeline)
    for t in range(num_tokens):
        counting = t >= warmup
        if t == warmup:
            counters = LedgerCounters()
            for led in ledgers:
                led.counters = counters
            res.counters = counters
        for layer in range(layers):
            li = layer % src_layers
            led = ledgers[layer]
            index_row = idx_rows[li][t]
            served = serve_slots(serving, index_row, want_rows[li][t],
                                 None if dom_rows[li] is None else dom_rows[li][t],
                                 num_experts=trace.num_experts, full_width=inter,
                                 resident_width=lambda e, led=led, layer=layer: led.width(layer, e),
                                 whole_width=plan.dominant_width)
            step = plan_step(index_row, served.widths, num_experts=trace.num_experts, neuron_nbytes=nb,
                             resident_width=lambda e, led=led, layer=layer: led.width(layer, e), cost=cost,
                             placement=placement, split_granule=granule, max_copy_rows=copy_rows)
            if placement.uses_cpu:
                _hybrid_step(res, led, layer, step, served, copy_clock, profile, lead, counting, room)
                if requests is not None and layer + 1 < layers:
                    _hybrid_prefetch(led if cache_scope == "global" else ledgers[layer + 1], layer, step,
                                     requests[li][t], topups[li][t], copy_clock.span)
                continue
            pending = {(layer, task.expert) for task in step.tasks}
            jobs: dict[int, Job] = {}
            for task in step.tasks:  # the runtime's issue order
                decision = led.request(layer, task.expert, task.width, protected=pending)
                pending.discard((layer, task.expert))
                jobs[task.expert] = Job(task.expert, task.width, profile.load_s(decision.copy_bytes),
                                        profile.compute_s(task.width * nb))
            router_jobs = [jobs[e] for e in dict.fromkeys(idx_lists[li][t]) if e in jobs]
            if counting:
                _account(res, router_jobs, served, profile, nb, lead, orders)
            if copy_clock is not None:
                times = copy_clock.step(router_jobs)  # from lead; the prefetch span [demand done, end + lead)
                end, slots = times.end, times.slots
                last = requests is None or layer + 1 >= layers
                wanted_next = [] if last else requests[li][t]
                next_led = led if cache_scope == "global" else ledgers[layer + 1]
                step_keys = {(layer, j.expert) for j in router_jobs}
                span = copy_clock.span
                issued = _prefetch_span(next_led, layer + 1, wanted_next, span, step_keys)
                if not last and not span.cut and topups[li][t]:  # the second phase, in the time the first left
                    issued += _prefetch_span(next_led, layer + 1, topups[li][t], span, step_keys)
                if timeline is not None and counting:
                    timeline.append({"token": t, "layer": layer, "start": clock, "router_end": clock + lead,
                                     "slots": [Slot(s.expert, clock + s.copy_start, clock + s.copy_end,
                                                    clock + s.compute_start, clock + s.compute_end) for s in slots],
                                     "prefetch": [(e, w, clock + a, clock + b) for e, w, a, b in issued],
                                     "end": clock + end})
                clock += end
        if counting:
            res.tokens += 1
        if progress is not None:
            progress(t + 1, num_tokens)
    res.peak_bytes = max(led.peak for led in ledgers) if cache_scope == "global" else sum(l.peak for l in ledgers)
    return res


def _pin_hot_experts(ledgers, routed, wanted, layers: int, nb: int, inter: int) -> None:
    """Make the trace's most used (layer, expert) pairs resident at full width, while they fit (no eviction):
    ``crisp_runtime.residency.ledger.pin_most_used`` over the slots the plan runs (``_most_used``).

    Weighting by the width wanted (the bytes the CPU would otherwise read) was tried: 10.28 against
    10.30 tok/s (rtx4090-pcie4-ddr5, 25%). ``nb`` is kept for the callers' signature: the ledgers know it."""
    pin_most_used(_most_used(routed, wanted, layers), ledgers, dict.fromkeys(range(layers), inter))


def _most_used(routed, wanted, layers: int) -> dict[tuple[int, int], int]:
    """Uses of every (target layer, expert) over the whole trace: the routed slots the plan runs (> 0 width)."""
    src = len(routed)
    counts: dict[tuple[int, int], int] = {}
    for layer in range(layers):
        li = layer % src
        for e, w in zip(routed[li].reshape(-1).tolist(), wanted[li].reshape(-1).tolist(), strict=True):
            if w > 0:
                counts[(layer, e)] = counts.get((layer, e), 0) + 1
    return counts


def pinned_set(routed, wanted, budget: int, layers: int, scope: str, nb: int, inter: int,
               share: float = PIN_SHARE) -> frozenset[tuple[int, int]]:
    """The hot set a ``<name>+pinned`` eviction keeps: the trace's most used experts at full width up to
    ``share`` of each cache's budget, chosen by ``pin_most_used`` on scratch ledgers of that size (the
    oracle a user who pins offline picks, as for the hybrid placements' static set)."""
    def scratch(layer_bytes: dict[int, int], cache_budget: int) -> ResidencyLedger:
        return ResidencyLedger(max(1, int(share * cache_budget)), layer_bytes, dict.fromkeys(layer_bytes, inter))

    if scope == "global":
        holders = [scratch(dict.fromkeys(range(layers), nb), budget)] * layers
    else:
        holders = [scratch({i: nb}, budget // layers) for i in range(layers)]
    return frozenset(pin_most_used(_most_used(routed, wanted, layers), holders, dict.fromkeys(range(layers), inter)))


def _hybrid_step(res: SimResult, led, layer: int, step, served, clock: CopyClock, profile: HardwareProfile,
                 lead: float, counting: bool, room: int = 0) -> None:
    """One layer step under a CPU placement: the GPU's tasks through the ledger, the time of the split on the
    modeled clock (``CopyClock.hybrid_step``: the runtime's with ``PrefetchPolicy.window``), which opens the
    step's prefetch span.

    room: bytes of the neuron split's transient buffer (0: none); a GPU prefix's missing rows go there when
    they do not fit in the free budget (``ResidencyLedger.request_transient``, as the runtime asks)."""
    window = clock.window
    pending = {(layer, t.expert) for t in step.tasks if not t.on_cpu}
    def request(task) -> int:
        # The GPU part is the prefix [0, gpu_width) (the whole expert unless the neuron split cut it): the
        # ledger is asked for that width; the CPU computes the rows [gpu_width, width), if any.
        nonlocal room
        if room:
            decision = led.request_transient(layer, task.expert, task.gpu_width, room, protected=pending)
            if decision.kind == TRANSIENT:
                room -= decision.copy_bytes
        else:
            decision = led.request(layer, task.expert, task.gpu_width, protected=pending)
        pending.discard((layer, task.expert))
        return decision.copy_bytes

    jobs, gpu, cpu = hybrid_jobs(window, step.tasks, request)  # GPU tasks first (issue order), then the CPU's
    if counting:
        res.splits += len(set(gpu) & set(cpu))  # GPU prefixes whose remaining rows the CPU computes
    times = clock.hybrid_step(jobs, gpu, cpu)
    if not counting:
        return
    span = times.span
    res.bytes_computed += sum(t.width * window.row_nbytes for t in step.tasks)
    res.load_s += times.copied
    res.compute_s += sum(jobs[i].gpu_s for i in gpu)
    res.cpu_s += sum(jobs[i].cpu_s for i in cpu)
    res.cpu_runs += len(cpu)
    _count_step(res, served, profile, len(jobs))
    tot = res.per_order["widest_first"]
    tot.time_s += lead + span
    tot.expert_s += span
    tot.bound_s += lead + span  # the split is exact for decode steps: its makespan is the bound


def _hybrid_prefetch(led, layer: int, step, wanted, topups, span: PrefetchSpan) -> None:
    """A CPU placement's prefetch of layer ``layer + 1``'s predicted experts (``wanted``, then the second
    phase ``topups`` in the time the first left), as ``CrispRuntime.prefetch`` asks them (protecting every key
    of the step), in the step's ``span`` (``CopyClock.hybrid_step``: from the end of the demanded copies, at the
    busy H2D rate while the step lasts, then the full rate, to the next router's end: a prefetch never delays a
    demanded copy)."""
    keys = {(layer, t.expert) for t in step.tasks}
    _prefetch_span(led, layer + 1, wanted, span, keys)
    if not span.cut and topups:
        _prefetch_span(led, layer + 1, topups, span, keys)


def _ledgers(policy: SimPolicy, budget: int, layers: int, scope: str, nb: int, inter: int, wanted, routed,
             num_tokens: int, trace_layer_ids: Sequence[int]) -> list[ResidencyLedger]:
    """One ledger per target layer (the same object for every layer when the cache is global)."""
    name = policy.eviction
    pinned = (pinned_set(routed, wanted, budget, layers, scope, nb, inter) if name.endswith(PINNED)
              else frozenset())
    plan = target_plan(policy.plan, trace_layer_ids, layers)

    def evictor(only_layer: int | None) -> EvictionPolicy:
        if name == BELADY:
            return BeladyPolicy(_future(wanted, routed, layers, num_tokens, only_layer))
        if name.endswith(PINNED):
            return PinnedPolicy(make_policy(name.removesuffix(PINNED), plan), pinned)
        return make_policy(name, plan)

    if scope == "global":
        shared = ResidencyLedger(budget, {i: nb for i in range(layers)}, {i: inter for i in range(layers)},
                                 evictor(None))
        return [shared] * layers
    return [ResidencyLedger(budget // layers, {i: nb}, {i: inter}, evictor(i)) for i in range(layers)]


def target_plan(plan: CrispPlan, trace_layer_ids: Sequence[int], layers: int) -> CrispPlan:
    """``plan`` (in the traced model's layer ids) on the target's layers 0..layers-1: target layer l gets the
    tiers of traced layer ``trace_layer_ids[l mod L]``, the layer it replays. The simulator's ledgers key
    experts by target layer, so a policy that reads the plan (``TierAwarePolicy.set_plan``) needs it so."""
    src = len(trace_layer_ids)
    mapped = {layer: plan.layers[trace_layer_ids[layer % src]] for layer in range(layers)
              if trace_layer_ids[layer % src] in plan.layers}
    return dataclasses.replace(plan, layer_ids=tuple(range(layers)), layers=mapped)


def _future(wanted, routed, layers: int, num_tokens: int, only_layer: int | None) -> list[tuple[int, list[int]]]:
    """Belady's future: every step's routed experts the plan wants (> 0), in slot order."""
    src = len(routed)
    idx = [r.tolist() for r in routed]
    wid = [w.tolist() for w in wanted]
    steps = []
    for t in range(num_tokens):
        for layer in range(layers) if only_layer is None else (only_layer,):
            li = layer % src
            steps.append((layer, [e for e, w in zip(idx[li][t], wid[li][t], strict=True) if w > 0]))
    return steps


def _count_step(res: SimResult, served, profile: HardwareProfile, experts: int) -> None:
    """What every layer step adds whatever its placement: fixed per-layer time, experts run, serving counters."""
    res.router_s += profile.router_s
    res.other_s += profile.other_s
    res.experts_run += experts
    res.fallbacks += served.fallbacks
    res.skips += served.skips
    res.wider += served.wider
    res.widened += served.widened


def _account(res: SimResult, jobs: list[Job], served, profile: HardwareProfile, nb: int, lead: float,
             orders: Sequence[str]) -> None:
    res.bytes_computed += sum(j.width * nb for j in jobs)
    res.load_s += sum(j.load_s for j in jobs)
    res.compute_s += sum(j.compute_s for j in jobs)
    _count_step(res, served, profile, len(jobs))
    bound = flow_shop_bound(jobs)
    for o in orders:
        end, _ = schedule(jobs, o)
        tot = res.per_order[o]
        tot.time_s += lead + end
        tot.expert_s += end
        tot.bound_s += lead + bound


def prefetch_requests(plan: CrispPlan, trace, predicted, policy: PrefetchPolicy | None = None,
                      serving: ServingPolicy | None = None, *, phase: int = 1) -> list[list[list[tuple[int, int]]]]:
    """Per traced layer j and token: [(expert, width)] to prefetch for layer j + 1, as the runtime's
    ``crisp_runtime.scheduling.prefetch.Prefetcher`` asks (its ``slot_widths`` / ``merge_requests`` /
    ``widest_first``; ``policy`` default ``PrefetchPolicy()``: the predicted top-k at the plan's
    widths; ``serving`` default the plan's): widest first. The trace keeps the predicted experts in
    the router's order but not its weights: the slots get decreasing stand-in weights, which keeps the
    plan's dominant (the heavier) and tier exact; a skip threshold sees the stand-ins. The trace has
    no predictions beyond the top-k: ``policy.extra_experts`` is not simulated (refused).
    phase 2: the second phase, issued after the first (``crisp_runtime.scheduling.prefetch.topup_requests``:
    dominants widened ahead of demand under ``DominantWiden.AHEAD``; empty lists otherwise).
    """
    if phase not in (1, 2):
        raise ValueError(f"prefetch phase must be 1 or 2, got {phase!r}")
    if predicted is None:
        raise ValueError("prefetch: the trace holds no next-layer predictions")
    policy = PrefetchPolicy() if policy is None else policy
    serving = ServingPolicy() if serving is None else serving
    if policy.extra_experts:
        raise ValueError("prefetch: extra_experts is not simulated (the trace holds the predicted top-k only)")
    k = trace.top_k
    stand_in = torch.arange(k, 0, -1, dtype=torch.float32)
    stand_in = (stand_in / stand_in.sum()).expand(trace.num_tokens, k)
    out = []
    for li in range(trace.num_layers):
        if li + 1 >= trace.num_layers:
            out.append([[] for _ in range(trace.num_tokens)])
            continue
        index = torch.from_numpy(np.ascontiguousarray(predicted[li][:, :k])).to(torch.int64)
        if phase == 2:
            out.append([topup_requests(policy, plan, serving, trace.layer_ids[li + 1], index[t:t + 1],
                                       stand_in[t:t + 1].contiguous()) for t in range(trace.num_tokens)])
            continue
        widths = slot_widths(policy, plan, serving, trace.layer_ids[li + 1], index, stand_in.contiguous())
        out.append([widest_first(merge_requests(es, ws))
                    for es, ws in zip(index.tolist(), widths.tolist(), strict=True)])
    return out


def _prefetch(led: ResidencyLedger, layer: int, wanted: list[tuple[int, int]], nb: int, profile: HardwareProfile,
              start: float, deadline: float, step_keys: set) -> tuple[list[tuple[int, int, float, float]], bool]:
    """Prefetch ``wanted`` [(expert, width)] of ``layer`` in order, as ``CrispRuntime.prefetch`` does
    (protecting the step's keys and every requested key), but only rows that arrive before ``deadline``
    (``crisp_runtime.scheduling.copy_window.admit_requests``: a request that does not fit in the time left is cut
    to the rows that do, and nothing is issued after it).

    Returns ((expert, new width, copy start, copy end) per admitted prefetch, whether the time ran out).
    """
    span = PrefetchSpan(profile.prefetch_window(nb), start, deadline)
    return _prefetch_span(led, layer, wanted, span, step_keys), span.cut


def _prefetch_span(led: ResidencyLedger, layer: int, wanted: list[tuple[int, int]], span: PrefetchSpan,
                   step_keys: set) -> list[tuple[int, int, float, float]]:
    """:func:`_prefetch` in an open span (the modeled clock's, carried across the two phases of a step)."""
    protected = set(step_keys) | {(layer, e) for e, _ in wanted}
    return admit_requests(wanted, lambda e: led.width(layer, e),
                          lambda e, w: led.prefetch(layer, e, w, protected=protected), span).issued


def target_window(profile: HardwareProfile, shape: ModelShape, intermediate_size: int):
    """The modeled copy clock (``scheduling.copy_window.PrefetchWindow``) of ``profile`` running ``shape``,
    per neuron row of a model whose experts have ``intermediate_size`` neurons (each row stands for
    ``neuron_scale`` rows of the target, as the simulator maps a trace): what ``PrefetchPolicy.window``
    takes for the runtime in the loop to cut prefetches as ``simulate_decode`` does."""
    return profile.prefetch_window(shape.neuron_nbytes * neuron_scale(intermediate_size, shape),
                                   f"{profile.name}/{shape.name}")


# ---------------------------------------------------------------------------- policies at a budget


def simulate_policies(
    trace,
    policies: Sequence[SimPolicy],
    profile: HardwareProfile,
    shape: ModelShape,
    budget_fraction: float,
    *,
    orders: Sequence[str] = ORDERS,
    warmup: int = 0,
    cache_scope: str = "global",
    predicted: np.ndarray | None = None,
    progress=None,
    budget_bytes: int | None = None,
) -> list[dict]:
    """One record per (policy, order) at ``budget_fraction`` of the target's expert bytes (``budget_bytes``: the
    budget in bytes when the fraction is of another shape's bytes: a tail layout's, ``bench.tail_sim``)."""
    budget = int(budget_fraction * shape.total_expert_nbytes) if budget_bytes is None else int(budget_bytes)
    records = []
    for p in policies:
        run_orders = ["widest_first"] if p.prefetch or p.serving.placement.uses_cpu else list(orders)
        res = simulate_decode(trace, p, profile, shape, budget, orders=run_orders, warmup=warmup,
                              cache_scope=cache_scope, predicted=predicted,
                              progress=None if progress is None else (lambda d, n, p=p: progress(p, d, n)))
        for o in run_orders:
            records.append({"policy": p.name, "serving": p.serving.name, "eviction": p.eviction,
                            "prefetch": p.prefetch,
                            "prefetch_width": p.prefetch_width.value if p.prefetch else None, "label": p.label,
                            "budget_fraction": budget_fraction,
                            "budget_bytes": budget, "cache_scope": cache_scope, **res.summary(o)})
    return records
