"""Plan for throughput: the serving configuration with the most simulated tokens/s at a GPU budget on a
hardware profile whose accuracy loss, measured with the runtime in the loop, stays within a bound.

The plan's tiers and widths are chosen before, by bytes (``search.py``); this search chooses how the pack is
*served* at a budget, and the plan knobs that serving depends on, from a small stated space (:func:`candidates`):

- the dominant floor (``ServingPolicy.dominant_floor``): 1.0, 0.875, 0.75, 0.625, 0.5 of the full width;
- prefetch of the next layer's predicted experts: none, at the plan's widths (PLAN), or at the
  serving policy's widths (SERVING: a missed dominant at its floor);
- widening a floor-loaded dominant (``ServingPolicy.dominant_widen``): never, or ahead of demand
  (AHEAD, with SERVING prefetch: the prefetcher's second phase); on demand (HIT) is left out: on the
  simulated RTX 4090 it ran 2.03x against 2.42x without (docs/serving-and-residency.md);
- auxiliaries served from what is resident (wider for free, narrower without a copy), eviction fixed
  by the goal (default next-use, the runtime's best online policy there);
- the one plan knob: auxiliaries of routing weight >= w at the dominant width
  (``CrispPlan.aux_full_weight``), none or w in :data:`SEARCH_AUX_WEIGHTS` (on the
  tiny Mixtral's held-out text the weight picked the auxiliaries that matter better than the pair tiers
  below 1% loss). The chosen weight is stored in the pack's plan;
- at the plan's widths: the skip / auxiliary weight bands and the width cap of :data:`SEARCH_EXACT_BANDS` and
  :data:`SEARCH_CAPS`;
- with ``tier_widths`` given (``--search-tier-widths``), the whole space again at each other Hot / Warm / Cold
  width of the non-dominant expert (the tiers and dominant labels stay the plan's): a wider Warm width costs bytes
  but buys the accuracy a lower dominant floor spends;
- at top-k > 2 (``--combination-key auto``), the whole space again with the plan's tiers over the other
  combination key at the same cut-offs (``Candidate.combination_key``; the profiler builds them:
  ``search.rekeyed_plans``);
- the simple baselines in place of the plan, at its bytes per token: skip-auxiliary by routing weight (the plan's
  dominant count) and one uniform width, each the closest at or below the plan's neurons per token on the traced
  routing (``crisp_runtime.planning.baselines.equal_bytes_plans(..., at_most=True)``), served at their widths with
  plan-width prefetch. The fastest candidate within the bound is chosen whichever kind it is, so the choice is never
  slower than a baseline that meets the bound; when a baseline wins, the pack's plan is that baseline and the
  record says so (``search.chosen_kind``; ``search.baselines`` holds their speed and loss, scored even when slower).

Speed: each candidate replays a routing trace recorded on the held-out calibration windows (with
the next layer's predictions) through the simulator's library API (``crisp_bench.simulate``, the
runtime's own serving / residency / eviction / prefetch code), mapped onto a target model's sizes
(default: Mixtral-8x7B when the expert count and top-k match, else the model itself) on a hardware
profile (``crisp_bench.profiles``); tokens/s relative to full-width LRU on the same trace and budget.

Accuracy: teacher-forced decoding through ``crisp_runtime.apply`` with its cache at the budget
(``crisp_tools.serving_eval.run_case``, what ``crisp-eval --mode decode`` runs) on the same held-out
*calibration* windows (the last ``--holdout-fraction`` of the calibration text: never the evaluation
text), relative to 4-bit full width, with the prefetch window of the same profile and target
(``crisp_runtime.scheduling.copy_window``: the decode admits only the prefetch rows the simulated copy engine delivers
before the next layer's demand, so the accuracy belongs to the simulated widths; without it every prefetch
completed and the loss was 1-2 points lower, docs/serving-and-residency.md). Candidates are evaluated
fastest first and the search stops at the first within ``max_accuracy_loss``: the fastest feasible candidate.

Package graph: ``crisp_tools`` imports ``crisp_bench.simulate`` / ``.profiles`` / ``.traces`` (the
simulator's library, which imports only ``crisp_runtime`` and ``crisp_kernels``); the bench CLIs import
``crisp_tools.text`` only. No module imports back into this one, so the module graph is acyclic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import multiprocessing
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from statistics import NormalDist

import torch
from crisp_bench.profiles import ProfileError, get_profile
from crisp_bench.shapes import TARGETS, ModelShape
from crisp_bench.simulate import SimPolicy, simulate_decode, target_window
from crisp_bench.tail_sim import TailMapping, mapped_target
from crisp_bench.traces import record_trace, routing

from crisp_kernels.tail_layout import PLAIN, TailLayout
from crisp_runtime import cli_args as ca
from crisp_runtime.planning.baselines import baseline_description, equal_bytes_plans, full_plan
from crisp_runtime.planning.pairs import CombinationKey
from crisp_runtime.planning.plan import CrispPlan, PlanError, PolicyKind, TierWidths
from crisp_runtime.planning.serving import SERVING_POLICIES, DominantWiden, ServingPolicy, resident_policy
from crisp_runtime.residency.eviction import POLICIES as EVICTION_POLICIES
from crisp_runtime.scheduling.prefetch import PrefetchPolicy, PrefetchWidth
from crisp_runtime.scheduling.scheduler import Placement
from crisp_runtime.storage.pack import CrispPack
from crisp_runtime.storage.serving_record import SERVING_KEY, ServingRecord

from ..calibration import EVAL_SEQ_LEN, CliError, TokenScores, random_windows
from ..loss_estimate import finite_or_none, relative_loss
from ..serving_eval import ServingCase, run_case, score_plan, total_expert_bytes
from ..tail_emulation import tier_widths_arg
from .config import DEFAULT_ACCURACY_WINDOWS, accuracy_window_count

__all__ = ["SERVING_KEY", "Candidate", "CandidateServing", "PackVariant", "ThroughputGoal", "candidates",
           "check_tier_widths", "default_candidates", "goal_from_config", "plan_serving", "search_throughput",
           "search_variants", "simulate_candidates", "target_shape"]

SEARCH_FLOORS = (1.0, 0.875, 0.75, 0.625, 0.5)


@dataclass(frozen=True)
class ThroughputGoal:
    """What the search optimises: tokens/s at ``budget`` (fraction of all expert bytes at full width) on
    ``profile``, subject to a relative accuracy loss <= ``max_accuracy_loss`` (a fraction) with one-sided
    ``confidence`` (0.5: the point estimate alone)."""

    budget: float
    max_accuracy_loss: float = 0.02
    profile: str = "rtx4090-pcie4"
    target: str = "auto"  # a crisp_bench.profiles.TARGETS name, "native", or "auto" (see the module docstring)
    eviction: str = "next_use"
    # 0.95: z = 1.645. A choice on the point estimate lost 1.74% on 16 x 128 calibration windows and 2.44% held out
    confidence: float = 0.95

    @property
    def z(self) -> float:
        """Standard errors between the estimated loss and the bound it must clear (0 at confidence 0.5)."""
        return 0.0 if self.confidence == 0.5 else NormalDist().inv_cdf(self.confidence)

    def __post_init__(self) -> None:
        for name, low_open in (("budget", True), ("max_accuracy_loss", False)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 < v <= 1.0 if low_open
                                                                               else 0.0 <= v <= 1.0):
                raise ValueError(f"ThroughputGoal: {name} must be a fraction in {'(0, 1]' if low_open else '[0, 1]'}, "
                                 f"got {v!r}")
        c = self.confidence
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.5 <= c < 1.0:
            raise ValueError(f"ThroughputGoal: confidence must be in [0.5, 1), got {c!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"ThroughputGoal: eviction must be one of {', '.join(EVICTION_POLICIES)}, "
                             f"got {self.eviction!r}")
        if self.target not in ("auto", "native", *TARGETS):
            raise ValueError(f"ThroughputGoal: target must be auto, native or one of {', '.join(TARGETS)}, "
                             f"got {self.target!r}")
        get_profile(self.profile)  # a clear error for an unknown profile, before any work


# The tiers alone, and heavy auxiliaries whole from 0.3 / 0.4 (on the tiny Mixtral's held-out text the
# weight picked the auxiliaries that matter better than the pair tiers below 1% loss). Served from what is
# resident, each is decoded: kept few.
SEARCH_AUX_WEIGHTS = (None, 0.3, 0.4)
# Plans served at their own widths (exact: one batch forward scores each, so the grid can be wider): the tiers,
# heavy auxiliaries whole, skip-auxiliary at 0.3 / 0.4 (S = W) and the three-band points of the frontier at
# 10 / 25 / 50% (S 0.15 / W 0.3 at 0.68%, S 0.25 / W 0.4 at 1.18%, S 0.35 / W 0.45 at 1.96% on
# the tail pack), each uncapped and capped at 7/8 and 3/4 of the width (the frontier's capped points: 192 of 256).
SEARCH_EXACT_BANDS = ((None, None), (None, 0.3), (None, 0.4), (0.3, 0.3), (0.4, 0.4), (0.15, 0.3), (0.2, 0.4),
                      (0.25, 0.4), (0.3, 0.4), (0.35, 0.45))
SEARCH_CAPS = (None, 0.875, 0.75)
# The baselines a CRISP plan's search also serves in its place, at its bytes per token.
SEARCH_BASELINES = (PolicyKind.SKIP_AUX, PolicyKind.UNIFORM)


class CandidateServing(enum.Enum):
    """How a candidate serves its plan."""

    PLAN = "plan"  # the plan's widths whatever is resident: outputs independent of the cache, scored in batch
    RESIDENT = "resident"  # from what is resident (a dominant floor, wider / narrower auxiliaries): decoded


@dataclass(frozen=True)
class Candidate:
    """One configuration of the search space: how the plan is served, and the plan knobs it sets."""

    dominant_floor: float = 1.0
    widen: DominantWiden = DominantWiden.NEVER
    prefetch: PrefetchWidth | None = None
    aux_full_weight: float | None = None  # the plan's CrispPlan.aux_full_weight (None: unset)
    aux_skip_weight: float | None = None  # the plan's CrispPlan.aux_skip_weight (None: unset)
    width_cap: int | None = None  # the plan's CrispPlan.width_cap in neurons (None: uncapped)
    kind: CandidateServing = CandidateServing.RESIDENT
    tier_widths: TierWidths | None = None  # the plan's CrispPlan.tier_widths in neurons (None: the plan's own)
    # serve this baseline instead of the plan, at the plan's bytes per token (None: the plan); the matched plan is set
    # by matched_on, on the search's routing
    baseline: PolicyKind | None = None
    matched: CrispPlan | None = dataclasses.field(default=None, compare=False, repr=False)
    # the plan's tiers over this combination key (None: the plan's own); ``rekeyed`` holds them, the same cut-offs,
    # widths and knobs as the plan (default_candidates)
    combination_key: CombinationKey | None = None
    rekeyed: CrispPlan | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.baseline is not None:
            if self.baseline not in SEARCH_BASELINES:
                raise ValueError(f"Candidate: baseline must be one of {', '.join(b.value for b in SEARCH_BASELINES)}, "
                                 f"got {self.baseline!r}")
            if self.kind is not CandidateServing.PLAN or (self.aux_full_weight, self.aux_skip_weight, self.width_cap,
                                                          self.tier_widths, self.combination_key) != (None,) * 5:
                raise ValueError("Candidate: a baseline is served at its own widths, without plan knobs")
        if self.combination_key is not None and (self.rekeyed is None
                                                 or self.rekeyed.combination_key is not self.combination_key):
            raise ValueError(f"Candidate: combination key {self.combination_key} needs the plan's tiers over it "
                             f"(rekeyed)")
        if self.kind is CandidateServing.PLAN and (self.dominant_floor != 1.0 or self.widen is not DominantWiden.NEVER
                                                   or self.prefetch not in (None, PrefetchWidth.PLAN)):
            raise ValueError(f"Candidate: serving at the plan's widths has no dominant floor, widening or "
                             f"serving-width prefetch, got floor {self.dominant_floor}, widen {self.widen.value}, "
                             f"prefetch {self.prefetch}")

    @property
    def exact(self) -> bool:
        """Outputs independent of the cache: a batch forward scores it as its decode would."""
        return self.kind is CandidateServing.PLAN

    @property
    def label(self) -> str:
        pf = "" if self.prefetch is None else f"+prefetch-{self.prefetch.value}"
        widen = "" if self.widen is DominantWiden.NEVER else f"-{self.widen.value}"
        aux = "" if self.aux_full_weight is None else f"-aux{self.aux_full_weight:g}"
        skip = "" if self.aux_skip_weight is None else f"-skip{self.aux_skip_weight:g}"
        cap = "" if self.width_cap is None else f"-cap{self.width_cap}"
        tw = self.tier_widths
        tiers = "" if tw is None else f"-tiers{tw.hot}.{tw.warm}.{tw.cold}"
        key = "" if self.combination_key is None else f"-key-{self.combination_key.value.split('-by-')[0]}"
        head = "plan" if self.exact else f"floor{self.dominant_floor:g}{widen}"
        if self.baseline is not None:
            head = f"baseline-{self.baseline.value}"
        return f"{head}{key}{tiers}{aux}{skip}{cap}{pf}"

    @property
    def kind_served(self) -> str | None:
        """What a record's ``kind`` says: the baseline's policy, None for the plan (its own policy)."""
        return None if self.baseline is None else self.baseline.value

    def matched_on(self, plan: CrispPlan, route) -> Candidate:
        """This candidate with its baseline matched to ``plan``'s neurons per token on ``route``
        (``crisp_runtime.planning.baselines.Routing``; at or below them); itself when it serves the plan."""
        if self.baseline is None:
            return self
        base = equal_bytes_plans(plan, route, at_most=True)[self.baseline.value]
        return dataclasses.replace(self, matched=base)

    def plan_for(self, plan: CrispPlan) -> CrispPlan:
        """The plan this candidate serves: ``plan`` with the candidate's weights, cap and tier widths (``plan``
        itself when they are its own), or its baseline matched to ``plan`` (:meth:`matched_on`)."""
        if self.baseline is not None:
            if self.matched is None or self.matched.layer_ids != plan.layer_ids:
                raise ValueError(f"Candidate {self.label}: the baseline is not matched to this plan (matched_on)")
            return self.matched
        if plan.policy is not PolicyKind.CRISP:
            if (self.aux_full_weight, self.aux_skip_weight, self.width_cap, self.tier_widths,
                    self.combination_key) != (None,) * 5:
                raise ValueError(f"Candidate {self.label}: plan knobs apply to CRISP plans only, not "
                                 f"{plan.policy.value!r}")
            return plan
        base = plan
        if self.combination_key is not None:
            if self.rekeyed.layer_ids != plan.layer_ids or self.rekeyed.tier_widths != plan.tier_widths:
                raise ValueError(f"Candidate {self.label}: its re-keyed tiers are not of this plan")
            base = self.rekeyed
        out = dataclasses.replace(base, aux_full_weight=self.aux_full_weight, aux_skip_weight=self.aux_skip_weight,
                                  width_cap=self.width_cap,  # at once: a pack plan's own skip weight may exceed W
                                  tier_widths=plan.tier_widths if self.tier_widths is None else self.tier_widths)
        return plan if out == plan else out

    def serving(self) -> ServingPolicy:
        if self.exact:
            return SERVING_POLICIES["plan"]
        # named as the runtime names it (resident-floorP, P in percent: resident-floor87.5-ahead), so that
        # stats() and serving_by_name read the stored choice's name as what it serves
        base = resident_policy(self.dominant_floor)
        return replace(base, name=base.name + _WIDEN_SUFFIX[self.widen], dominant_widen=self.widen)

    def prefetch_policy(self) -> PrefetchPolicy | None:
        return None if self.prefetch is None else PrefetchPolicy(width=self.prefetch)


# the suffixes of the built-in resident-floor75-widen / -ahead
_WIDEN_SUFFIX = {DominantWiden.NEVER: "", DominantWiden.HIT: "-widen", DominantWiden.AHEAD: "-ahead"}


def candidates(floors: Sequence[float] = SEARCH_FLOORS,
               aux_full_weights: Sequence[float | None] = SEARCH_AUX_WEIGHTS, *,
               exact_bands: Sequence[tuple[float | None, float | None]] = SEARCH_EXACT_BANDS,
               caps: Sequence[float | None] = SEARCH_CAPS, intermediate_size: int | None = None,
               tier_widths: Sequence[TierWidths | None] = (None,),
               baselines: Sequence[PolicyKind] = ()) -> list[Candidate]:
    """The search space (module docstring). Served from what is resident, per auxiliary weight and floor: no
    prefetch, PLAN prefetch, and below full width SERVING prefetch without and with AHEAD widening (at full width
    those equal PLAN): 18 per weight. At the plan's widths (``intermediate_size`` given: a CRISP plan's neurons),
    per (skip weight, auxiliary weight) band of ``exact_bands`` and cap of ``caps``: PLAN prefetch (a prefetch at
    the plan's widths never delays a demanded copy, and at floor 1 it was 1.89x full-width LRU against 1.72x
    without in a search at 25%). All of it once per entry of ``tier_widths`` (None: the plan's own). Then each of
    ``baselines`` once, at its widths with plan-width prefetch (matched to the plan in the search)."""
    out = []
    for tw in tier_widths:
        for w in aux_full_weights:
            for f in floors:
                out += [Candidate(f, aux_full_weight=w, tier_widths=tw),
                        Candidate(f, prefetch=PrefetchWidth.PLAN, aux_full_weight=w, tier_widths=tw)]
                if f < 1.0:
                    out += [Candidate(f, prefetch=PrefetchWidth.SERVING, aux_full_weight=w, tier_widths=tw),
                            Candidate(f, DominantWiden.AHEAD, PrefetchWidth.SERVING, aux_full_weight=w,
                                      tier_widths=tw)]
        if intermediate_size is not None:
            for s, w in exact_bands:
                for cap in caps:
                    neurons = None if cap is None else max(1, round(cap * intermediate_size))
                    out.append(Candidate(prefetch=PrefetchWidth.PLAN, aux_full_weight=w, aux_skip_weight=s,
                                         width_cap=neurons, kind=CandidateServing.PLAN, tier_widths=tw))
    out += [Candidate(prefetch=PrefetchWidth.PLAN, kind=CandidateServing.PLAN, baseline=b) for b in baselines]
    return out


def target_shape(goal: ThroughputGoal, trace, hidden_size: int) -> ModelShape:
    """The model the trace is mapped onto (widths kept as fractions; the target's I a multiple of the trace's)."""
    if goal.target == "native" or goal.target == "auto" and not _auto_target(trace):
        return ModelShape("native", trace.num_layers, trace.num_experts, trace.top_k, hidden_size,
                          trace.intermediate_size)
    shape = TARGETS[goal.target] if goal.target != "auto" else _auto_target(trace)
    if (shape.num_experts, shape.top_k) != (trace.num_experts, trace.top_k) or \
            shape.intermediate_size % trace.intermediate_size:
        raise ValueError(f"target {shape.name}: E={shape.num_experts}, top-{shape.top_k}, I={shape.intermediate_size} "
                         f"cannot replay a trace of E={trace.num_experts}, top-{trace.top_k}, "
                         f"I={trace.intermediate_size}")
    return shape


def _auto_target(trace) -> ModelShape | None:
    for shape in TARGETS.values():
        if (shape.num_experts, shape.top_k) == (trace.num_experts, trace.top_k) and \
                shape.intermediate_size % trace.intermediate_size == 0:
            return shape
    return None


def default_workers() -> int:
    """Simulation processes by default: every CPU but one, at most 8 (1 on a 2-core machine: no pool)."""
    return max(1, min(8, (os.cpu_count() or 1) - 1))


def _simulate_one(trace, sim: SimPolicy, profile, shape: ModelShape, budget: int, warmup: int, predicted) -> dict:
    """One candidate's widest-first summary (a module function: what a worker process runs)."""
    res = simulate_decode(trace, sim, profile, shape, budget, orders=["widest_first"], warmup=warmup,
                          predicted=predicted if sim.prefetch else None)
    return res.summary("widest_first")


def simulate_candidates(trace, plan: CrispPlan, goal: ThroughputGoal, shape: ModelShape, cands: Sequence[Candidate],
                        *, warmup: int, layout: TailLayout = PLAIN, workers: int = 1,
                        log: Callable[[str], None] = lambda msg: None) -> tuple[float, list[dict]]:
    """(full-width LRU tokens/s in router order, one record per candidate) on ``trace`` at ``goal.budget``;
    ``log`` gets one line per candidate as it is simulated (~5 s each for 2,048 tokens mapped onto Mixtral on a
    small CPU). ``layout``: the pack's tail layout (``crisp_kernels.tail_layout``; a 2-bit tail pack's): the
    candidates are simulated on its bytes (``crisp_bench.tail_sim.TailMapping``, as ``crisp-bench simulate
    --tail-layout``), the baseline on the 4-bit rows, at the same budget in bytes (a fraction of the 4-bit
    experts': equal GPU memory). ``workers`` > 1: the candidates are simulated in that many processes (spawned:
    nothing is shared but the arguments); the records are the same as in one process, in the same order."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"simulate_candidates: workers must be a positive integer, got {workers!r}")
    profile = get_profile(goal.profile)
    budget = int(goal.budget * shape.total_expert_nbytes)
    predicted = trace.predicted
    base = simulate_decode(trace, SimPolicy("full", full_plan(plan)), profile, shape, budget, orders=["router"],
                           warmup=warmup)
    base_tps = base.tokens_per_s("router")
    mapping = None if layout.is_plain else TailMapping(layout, trace, shape)
    sim_trace, sim_shape = (trace, shape) if mapping is None else (mapping.mapped_trace(), mapping.mapped_shape())
    sims = [SimPolicy("crisp", c.plan_for(plan), c.serving(), goal.eviction, c.prefetch is not None,
                      c.prefetch or PrefetchWidth.PLAN) for c in cands]
    if mapping is not None:
        sims = [mapping.mapped_policy(sim) for sim in sims]
    one = functools.partial(_simulate_one, profile=profile, shape=sim_shape, budget=budget, warmup=warmup,
                            predicted=predicted)
    out = []
    with contextlib.ExitStack() as stack:
        if workers > 1 and len(sims) > 1:
            pool = stack.enter_context(ProcessPoolExecutor(min(workers, len(sims)),
                                                           mp_context=multiprocessing.get_context("spawn")))
            summaries = pool.map(one, [sim_trace] * len(sims), sims)
        else:
            summaries = (one(sim_trace, sim) for sim in sims)
        for c, s in zip(cands, summaries, strict=True):
            out.append({"candidate": c.label, "tokens_per_s": s["tokens_per_s"],
                        "x_full_lru": s["tokens_per_s"] / base_tps, "bytes_per_token": s["bytes_per_token"],
                        "hit_rate": s["hit_rate"]})
            log(f"throughput: simulated {len(out)}/{len(cands)} {c.label}: {s['tokens_per_s']:.2f} tok/s "
                f"({s['tokens_per_s'] / base_tps:.2f}x full-width LRU)")
    return base_tps, out


def default_candidates(plan: CrispPlan, tier_widths: Sequence[TierWidths] = (),
                       rekeyed: Sequence[CrispPlan] = ()) -> list[Candidate]:
    """:func:`candidates` for ``plan``: a CRISP plan's knobs at its neurons, at its own tier widths and at each of
    ``tier_widths`` (``--search-tier-widths``; those equal to its own or repeated are tried once), all of them again
    over each plan of ``rekeyed`` (the plan's tiers over another combination key), and the baselines at its bytes
    (:data:`SEARCH_BASELINES`); other plans' serving alone (ValueError with ``tier_widths`` or ``rekeyed``)."""
    if plan.policy is not PolicyKind.CRISP:
        if tier_widths or rekeyed:
            what = "--search-tier-widths: tier widths" if tier_widths else "combination keys"
            raise ValueError(f"{what} apply to CRISP plans only, not {plan.policy.value!r}")
        return candidates(aux_full_weights=(None,))
    check_tier_widths(tier_widths, plan.intermediate_size)
    others = [tw for tw in dict.fromkeys(tier_widths) if tw != plan.tier_widths]
    out = candidates(intermediate_size=plan.intermediate_size, tier_widths=(None, *others),
                     baselines=SEARCH_BASELINES)
    own = [c for c in out if c.baseline is None]
    for other in rekeyed:
        if other.combination_key is plan.combination_key:
            raise ValueError(f"rekeyed: a plan over the plan's own key {plan.combination_key.value!r}")
        keyed = [dataclasses.replace(c, combination_key=other.combination_key, rekeyed=other) for c in own]
        out = out[:len(out) - len(SEARCH_BASELINES)] + keyed + out[len(out) - len(SEARCH_BASELINES):]
    return out


def check_tier_widths(tier_widths: Sequence[TierWidths], intermediate_size: int) -> None:
    """ValueError naming ``--search-tier-widths`` for a width outside [0, intermediate_size] (before any work)."""
    for tw in tier_widths:
        if not all(0 <= w <= intermediate_size for w in (tw.hot, tw.warm, tw.cold)):
            raise ValueError(f"--search-tier-widths {tw.hot},{tw.warm},{tw.cold}: each width must lie in "
                             f"[0, {intermediate_size}] neurons (the experts' intermediate size)")


@dataclass(frozen=True)
class PackVariant:
    """One stored form of the pack the search may choose (``search_variants``): its layers and their tail layout
    (``crisp_kernels.tail_layout``; PLAIN: 4-bit rows)."""

    layers: Mapping
    layout: TailLayout = PLAIN


def search_throughput(model, layers, plan: CrispPlan, windows: torch.Tensor, goal: ThroughputGoal, *,
                      layout: TailLayout = PLAIN, **options) -> tuple[ServingRecord, CrispPlan]:
    """The fastest candidate within the accuracy bound on one pack (``layers`` of ``layout``): its
    :class:`ServingRecord` and the plan it serves (``plan`` with the candidate's knobs: the pack stores that).
    ``options``: :func:`search_variants`'s."""
    record, chosen, _ = search_variants(model, [PackVariant(layers, layout)], plan, windows, goal, **options)
    return record, chosen


def search_variants(model, variants: Sequence[PackVariant], plan: CrispPlan, windows: torch.Tensor,
                    goal: ThroughputGoal, *, accuracy_windows: torch.Tensor | None = None,
                    cands: Sequence[Candidate] | None = None, source: str = "held-out calibration windows",
                    workers: int = 1, reference_layers=None, rule: Candidate | None = None,
                    log: Callable[[str], None] = lambda msg: None) -> tuple[ServingRecord, CrispPlan, PackVariant]:
    """The fastest (candidate, pack variant) within the accuracy bound (see the module docstring): its
    :class:`ServingRecord`, the plan it serves and the variant (its layers are what the pack stores).

    variants: the stored forms of one profiled pack (the same neuron order and plan): the 4-bit rows and 2-bit
    tail layouts of them (``crisp_tools.tail_pack``); every candidate is simulated on each, on its own bytes.
    windows: (N, L) held-out calibration token windows the routing trace is recorded on (the speed).
    accuracy_windows: (M, L) windows scored for the accuracy (default ``windows``), their first N
    ``windows`` themselves when the profiler draws them (``plan_serving``). (Candidate, variant) pairs are taken
    fastest first. One served at the plan's widths (outputs independent of the cache) is scored by one batch
    forward over all M windows, paired with the full width's batch forward; one served from what is resident is
    decoded in looks of N windows, paired with the full width's decode, and stopped at a look where its loss - z
    standard errors is already over the bound. A candidate is accepted when, over all M, its loss + z standard
    errors <= ``goal.max_accuracy_loss`` (z of ``goal.confidence``, one-sided; :mod:`crisp_tools.loss_estimate`).
    The decodes' budget is the same fraction of the 4-bit expert bytes on every variant
    (``crisp_runtime.storage.serving_record.budget_base_bytes``). workers: simulation processes
    (:func:`simulate_candidates`). reference_layers: the 4-bit pack (same neuron order) whose full width every
    loss is relative to, required when a variant has a tail (a tail pack's own full width lost 0.56% on the tiny
    Mixtral's held-out text: a loss against it would be understated by that much); None: the one variant's
    4-bit layers. rule: what runs without a stored choice (:func:`rule_candidate`); when it is not one of
    ``cands`` it is simulated beside them but never scored, and a candidate slower than it is never chosen (storing
    it would slow the budget down). Raises ValueError when no candidate is accepted, or none faster than ``rule``.
    """
    variants = list(variants)
    if not variants or len({v.layout.name for v in variants}) != len(variants):
        raise ValueError("search_throughput: give one or more pack variants of distinct tail layouts")
    if reference_layers is None:
        if len(variants) > 1 or not variants[0].layout.is_plain:
            raise ValueError(f"search_throughput: a {variants[-1].layout.name} tail pack's loss is relative to the "
                             "4-bit full width: give reference_layers (the 4-bit pack it was made from)")
        reference_layers = variants[0].layers
    cands = list(default_candidates(plan) if cands is None else cands)
    if not cands:
        raise ValueError("search_throughput: no candidates")
    rule_label = None
    if rule is not None and rule.label not in {c.label for c in cands}:
        rule_label = rule.label
        cands.append(rule)
    if len({c.label for c in cands}) != len(cands):
        raise ValueError("search_throughput: candidates must be distinct")
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"search_throughput: windows must be (N, L >= 2) token ids, got {tuple(windows.shape)}")
    if accuracy_windows is None:
        accuracy_windows = windows
    if accuracy_windows.dim() != 2 or accuracy_windows.shape[1] < 2:
        raise ValueError(f"search_throughput: accuracy_windows must be (M, L >= 2) token ids, got "
                         f"{tuple(accuracy_windows.shape)}")
    for c in cands:  # a knob the plan refuses (a skip weight over its auxiliary weight), before minutes of work
        if c.baseline is not None:
            continue  # matched on the trace below
        try:
            c.plan_for(plan)
        except (PlanError, ValueError) as exc:
            raise ValueError(f"search_throughput: candidate {c.label}: {exc}") from None
    trace = record_trace(model, windows, source=source)
    if any(c.baseline is not None for c in cands):
        route = routing(trace)
        cands = [c.matched_on(plan, route) for c in cands]
    first = next(iter(reference_layers.values()))
    shape = target_shape(goal, trace, first.hidden_size)
    warmup = min(32, trace.num_tokens // 4)
    several = len(variants) > 1
    sims: list[dict] = []
    variant_of: dict[int, PackVariant] = {}  # id(record) -> its variant
    for v in variants:
        at = "" if not several else f" ({v.layout.name})"
        base_tps, got = simulate_candidates(trace, plan, goal, shape, cands, warmup=warmup, layout=v.layout,
                                            workers=workers, log=lambda msg, at=at: log(msg + at))
        for r in got:
            if several:
                r["tail_layout"] = v.layout.name
            if r["candidate"] == rule_label:
                r["default_rule"] = True  # simulated for comparison only: what runs without a stored choice
            variant_of[id(r)] = v
        sims += got
    reference_pack = CrispPack(reference_layers, full_plan(plan))
    budget_bytes = int(goal.budget * total_expert_bytes(reference_layers))
    z = goal.z
    look = windows.shape[0]
    total = accuracy_windows.shape[0]
    references: dict[str, TokenScores] = {}

    def progress(what: str):  # a decode of 128 windows takes minutes to an hour on 2 cores: said at each look
        return lambda n, count: log(f"throughput: {what}: decoded {n}/{count} windows") \
            if n % look == 0 or n == count else None

    def reference(mode: str) -> TokenScores:  # the 4-bit full width, scored as the candidates are
        if mode not in references:
            if mode == "batch":
                references[mode] = score_plan(model, reference_pack, full_plan(plan), accuracy_windows)
            else:
                references[mode], _ = run_case(model, reference_pack, full_plan(plan), accuracy_windows, budget_bytes,
                                               ServingCase("full-exact", "full"), progress=progress("the 4-bit full "
                                                                                                   "width (reference)"))
        return references[mode]

    def over_bound(scores) -> bool:  # asked after each decoded window; answers at the looks only
        n = scores.correct.shape[0]
        return n % look == 0 and \
            relative_loss(reference("decode").correct[:n], scores.correct).lower(z) > goal.max_accuracy_loss

    def window_of(v: PackVariant):  # per storage row of the variant (a tail's rows map onto the layout's rows)
        return target_window(get_profile(goal.profile), shape if v.layout.is_plain else mapped_target(v.layout, shape),
                             next(iter(v.layers.values())).intermediate_size)

    by_label = {c.label: c for c in cands}
    for r in sims:  # a baseline's record says what it served
        c = by_label[r["candidate"]]
        if c.baseline is not None:
            served = c.plan_for(plan)
            what = ({"uniform_width": served.uniform_width} if c.baseline is PolicyKind.UNIFORM
                    else {"skip_threshold": served.skip_threshold, "num_dominant": served.num_dominant})
            r.update(kind=c.baseline.value, **what)
    packs: dict[str, CrispPack] = {}

    def scored(r: dict) -> bool:
        """Score ``r``'s candidate on the accuracy windows into ``r``; whether it is accepted."""
        c, v = by_label[r["candidate"]], variant_of[id(r)]
        pack = packs.setdefault(v.layout.name, CrispPack(v.layers, plan))
        mode = "batch" if c.exact else "decode"
        full = reference(mode)
        if c.exact:
            scores = score_plan(model, pack, c.plan_for(plan), accuracy_windows)
        else:
            prefetch = c.prefetch_policy()
            case = ServingCase(f"crisp-{c.label}", "crisp", c.serving(), None if prefetch is None
                               else replace(prefetch, window=window_of(v)), eviction=goal.eviction)
            scores, _ = run_case(model, pack, c.plan_for(plan), accuracy_windows, budget_bytes, case, stop=over_bound,
                                 progress=progress(c.label))
        est = relative_loss(full.correct[: scores.correct.shape[0]], scores.correct)
        accepted = est.windows == total and est.upper(z) <= goal.max_accuracy_loss
        r.update(accuracy_loss=est.loss, accuracy_loss_se=finite_or_none(est.standard_error),
                 accuracy_loss_upper=finite_or_none(est.upper(z)), accuracy_windows=est.windows, accuracy_mode=mode,
                 accuracy_decision="within" if accepted else "over" if est.lower(z) > goal.max_accuracy_loss
                 else "unresolved")
        log(f"throughput: {c.label}{f' ({v.layout.name})' if several else ''}: accuracy loss {est.loss:.2%} +- "
            f"{est.standard_error:.2%} over {est.windows}/{total} windows ({r['accuracy_decision']}; "
            f"{'batch: the plan widths' if c.exact else 'decoded, runtime in the loop'})")
        return accepted

    chosen = None
    for r in sorted(sims, key=lambda r: -r["tokens_per_s"]):
        if r["candidate"] == rule_label:
            raise ValueError(f"search_throughput: no candidate faster than the default rule ({rule_label}, "
                             f"{r['tokens_per_s']:.2f} tok/s) loses <= {goal.max_accuracy_loss:.2%}; a choice stored "
                             "here would slow this budget down")
        if scored(r):
            chosen = (by_label[r["candidate"]], r, variant_of[id(r)])
            break
    if chosen is None:
        raise ValueError(f"search_throughput: no candidate loses <= {goal.max_accuracy_loss:.2%} at "
                         f"{goal.confidence:.0%} confidence on the {source}; raise the bound, the budget or the "
                         "accuracy windows, or lower the confidence")
    c, r, v = chosen
    baselines = [b for b in sims if "kind" in b]
    for b in baselines:  # their loss beside the chosen one's, also when slower (exact: one batch forward each)
        if "accuracy_loss" not in b:
            scored(b)
    kind = c.plan_for(plan).policy.value
    log(f"throughput: chose {kind} ({c.label}): {r['tokens_per_s']:.2f} tok/s, accuracy loss {r['accuracy_loss']:.2%}; "
        + ", ".join(f"{b['kind']} {b['tokens_per_s']:.2f} tok/s at {b['accuracy_loss']:.2%} ({b['accuracy_decision']})"
                    for b in baselines))
    search = {"objective": "simulated tokens/s", "profile": goal.profile, "target": shape.name,
              "tail_layout": v.layout.name, **({"tail_layouts": [x.layout.name for x in variants]} if several else {}),
              "accuracy_reference": "4-bit full width" + ("" if reference_layers is variants[0].layers
                                                          else " (the reference pack)"),
              "max_accuracy_loss": goal.max_accuracy_loss, "confidence": goal.confidence,
              "z": z, "accuracy_text": source, "accuracy_prefetch_window": window_of(v).name,
              "windows": list(windows.shape), "accuracy_windows": list(accuracy_windows.shape),
              "full_width_accuracy": next(iter(references.values())).accuracy, "full_lru_tokens_per_s": base_tps,
              "chosen_kind": kind, "chosen": r, "baselines": baselines, "candidates": sims}
    return (ServingRecord(c.serving(), c.prefetch_policy(), goal.eviction, goal.budget, search),
            _described(c, plan), v)


def _described(c: Candidate, plan: CrispPlan) -> CrispPlan:
    """The plan ``c`` serves, its knobs said in its description (the pack stores it)."""
    chosen = c.plan_for(plan)
    base = plan if c.rekeyed is None else c.rekeyed
    if chosen is plan:
        return plan
    if c.baseline is not None:
        return dataclasses.replace(chosen, description=(
            f"{baseline_description(chosen)} Served in place of the CRISP plan at its bytes per token or fewer (the "
            "throughput search for simulated tokens/s found it the fastest within the accuracy bound)."))
    said = []
    if c.tier_widths is not None:
        said.append(f"the non-dominant expert of a Hot / Warm / Cold combination runs at {c.tier_widths.hot} / "
                    f"{c.tier_widths.warm} / {c.tier_widths.cold} neurons")
    if c.aux_skip_weight is not None:
        said.append(f"auxiliaries of routing weight < {c.aux_skip_weight:g} are skipped")
    if c.aux_full_weight is not None:
        said.append(f"auxiliaries of routing weight >= {c.aux_full_weight:g} run at the dominant width")
    if c.width_cap is not None:
        said.append(f"no slot runs wider than {c.width_cap} neurons")
    what = "; ".join(said) or "no auxiliary weight, skip weight or cap"
    return dataclasses.replace(chosen, description=(
        f"{base.description} {what[0].upper()}{what[1:]} (chosen by the throughput search for simulated "
        "tokens/s).").strip())


def add_budget_choice_options(p) -> None:
    """The options of ``--gpu-budget``'s stored choices (``crisp-profile`` and ``crisp_tools.plan_throughput`` share
    them): the held-out text each choice's loss is measured on, and how wide the per-budget search is."""
    p.add_argument("--heldout-data", nargs="+", type=ca.nonempty_path, default=None, metavar="PATH",
                   help="with --gpu-budget: held-out text (never the calibration text) each stored choice is decoded "
                        "on; its loss is stored with the choice (crisp-bench simulate's crisp-default reports it)")
    p.add_argument("--heldout-windows", type=ca.positive_int, default=32, metavar="N",
                   help="with --heldout-data: windows of --throughput-seq-len tokens decoded per choice")
    p.add_argument("--budget-search", choices=BUDGET_SEARCHES, default="short",
                   help="with --gpu-budget: short = the default families (dominants whole or at 87.5%%, auxiliaries "
                        "from what is resident, prefetch; decoded with the runtime in the loop) and the plan's widths "
                        "with prefetch; exact = the plan's widths with prefetch alone (batch forwards, no decode)")


def add_search_options(p, when: str) -> None:
    """The search's options (``crisp-profile --plan-for-throughput`` and ``crisp_tools.plan_throughput`` share
    them); ``when`` prefixes each help text (e.g. "with --plan-for-throughput: ")."""
    p.add_argument("--max-accuracy-loss", type=ca.float_in(0.0, 1.0), default=0.02, metavar="FRACTION",
                   help=f"{when}the largest relative next-token accuracy loss allowed")
    p.add_argument("--hardware-profile", default="rtx4090-pcie4",
                   help=f"{when}a crisp-bench profile (rtx4090-pcie4, rtx4090-pcie4-ddr5, ...)")
    p.add_argument("--throughput-windows", type=ca.positive_int, default=16,
                   help=f"{when}held-out calibration windows the routing trace (the speed) is recorded on; "
                        "candidates served from what is resident are decoded in looks of this many windows")
    p.add_argument("--throughput-accuracy-windows", type=ca.positive_int, default=None, metavar="N",
                   help=f"{when}held-out calibration windows scored before a candidate is accepted (default "
                        f"max({DEFAULT_ACCURACY_WINDOWS}, --throughput-windows); the first --throughput-windows of "
                        "them are the traced ones)")
    p.add_argument("--accuracy-confidence", type=ca.float_in(0.5, 1.0, high_open=True), default=0.95,
                   metavar="FRACTION",
                   help=f"{when}a candidate is accepted when its loss is within --max-accuracy-loss at this one-sided "
                        "confidence (loss + z standard errors, clustered by window; 0.5: the point estimate) and "
                        "a decode is stopped early once it is over at it")
    p.add_argument("--throughput-seq-len", type=ca.int_in(2), default=EVAL_SEQ_LEN,
                   help=f"{when}tokens per scored and traced window (default: crisp-eval's --seq-len, so the bound "
                        "holds for the loss crisp-eval measures; shorter windows judge a 2-bit tail's loss larger)")
    p.add_argument("--search-tier-widths", type=tier_widths_arg, nargs="+", default=(), metavar="HOT,WARM,COLD",
                   help=f"{when}also search the whole space at these tier widths of the non-dominant expert "
                        "(neurons, e.g. 256,128,64 256,96,48; the plan's own are always searched)")
    p.add_argument("--simulation-workers", type=ca.int_in(1, 256), default=default_workers(), metavar="N",
                   help=f"{when}processes simulating the candidates (default: every CPU but one, at most 8; the "
                        "records do not depend on it)")


def accuracy_windows_of(holdout_texts, count: int, seq_len: int, seed: int, holdout_fraction: float) -> torch.Tensor:
    """The search's (count, seq_len) windows drawn from the held-out calibration text (seed + 3: the profiler's
    draw, so a profile and a later ``plan_throughput`` of its pack with the same --data and --seed score the
    same windows)."""
    return random_windows(holdout_texts, count, seq_len, seed + 3,
                          f"--data (held-out calibration part, last {holdout_fraction:.0%}; --throughput-accuracy-"
                          f"windows {count} x --throughput-seq-len {seq_len})", seq_len_option="--throughput-seq-len")


def check_hardware_profile(name: str) -> None:
    """CliError naming ``--hardware-profile`` (the search's option, shared by ``crisp-profile`` and
    ``crisp_tools.plan_throughput``) unless crisp-bench has that profile or can read that profile file."""
    try:
        get_profile(name)
    except (ProfileError, OSError) as exc:
        # crisp-bench names its own option (--profile) and the path; say them once, as this option
        why = str(exc).removeprefix("--profile: ").removeprefix(f"{name}: ")
        raise CliError(f"--hardware-profile {name}: {why}") from None


def goal_from_config(cfg) -> ThroughputGoal | None:
    """``crisp-profile --plan-for-throughput``'s goal (None without it); CliError naming the option. The
    hardware profile is checked even without it: a bad value is refused, never ignored."""
    check_hardware_profile(cfg.hardware_profile)
    try:
        if cfg.throughput_budget is None:
            return None
        accuracy_window_count(cfg.throughput_windows, cfg.throughput_accuracy_windows)
        return ThroughputGoal(cfg.throughput_budget, cfg.max_accuracy_loss, cfg.hardware_profile,
                              confidence=cfg.accuracy_confidence)
    except (ValueError, OSError) as exc:
        raise CliError(f"--plan-for-throughput: {exc}") from None


def plan_serving(inputs, goal: ThroughputGoal, packed, plan: CrispPlan, log: Callable[[str], None],
                 rekeyed: Sequence[CrispPlan] = ()) -> tuple[ServingRecord, CrispPlan]:
    """The profiler's step: :func:`search_throughput` (the serving record and the plan to store) on the
    held-out calibration windows (the last ``--holdout-fraction`` of ``--data``: disjoint from the statistics
    windows and from any evaluation text; ``inputs.throughput_windows``, ``--throughput-seq-len`` tokens each):
    all of them decoded, the first ``--throughput-windows`` of them traced."""
    cfg = inputs.cfg
    accuracy_windows = inputs.throughput_windows
    windows = accuracy_windows[: cfg.throughput_windows]
    source = (f"held-out calibration windows ({accuracy_windows.shape[0]} x {accuracy_windows.shape[1]} tokens of "
              f"the last {cfg.holdout_fraction:.0%} of --data; the first {windows.shape[0]} traced)")
    try:
        return search_throughput(inputs.model, packed, plan, windows, goal, accuracy_windows=accuracy_windows,
                                 cands=default_candidates(plan, cfg.search_tier_widths, rekeyed), source=source,
                                 workers=cfg.simulation_workers, log=log)
    except ValueError as exc:
        raise CliError(f"--plan-for-throughput: {exc}") from None


# ---------------------------------------------------------------------------- choices per budget (--gpu-budget)

# The budgets ``--gpu-budget standard`` stores a choice for (fractions of the 4-bit expert bytes): the README's
# 10 / 25 / 50% columns. Without a budget every expert is resident and the default rule runs the plan's widths.
STANDARD_BUDGETS = (0.10, 0.25, 0.50)
_BUDGET_HELP = "a percentage ('25%'), a fraction ('0.25'), bytes ('6GiB', '512 MB'), or 'standard' (10%, 25%, 50%)"


def gpu_budget_arg(text: str):
    """``--gpu-budget``'s argparse type: a fraction in (0, 1] (from '25%' or '0.25'), bytes as an int (from
    '6GiB', '512 MB' or '1000000', ``crisp_runtime.hf.handle.parse_budget``), or the string 'standard'."""
    import argparse

    from crisp_runtime.hf.handle import parse_budget

    value = text.strip()
    if value == "standard":
        return value
    try:
        if value.endswith("%"):
            fraction = float(value[:-1]) / 100
        elif "." in value and value.replace(".", "", 1).isdigit():
            fraction = float(value)
        else:
            return parse_budget(value)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} ({exc}); expected {_BUDGET_HELP}") from None
    if not 0.0 < fraction <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a budget in (0%, 100%]; expected {_BUDGET_HELP}")
    return fraction


def budget_fractions(specs, base_bytes: int) -> list[float]:
    """The fractions of ``base_bytes`` (``serving_record.budget_base_bytes``) that ``--gpu-budget`` values name,
    sorted, each once; ValueError naming ``--gpu-budget`` for bytes beyond the experts (nothing to offload)."""
    out = []
    for spec in specs:
        if spec == "standard":
            out += STANDARD_BUDGETS
        elif isinstance(spec, float):
            out.append(spec)
        else:
            if spec > base_bytes:
                raise ValueError(f"--gpu-budget {spec} bytes holds every expert ({base_bytes} bytes at full width): "
                                 "nothing is offloaded, and without a budget every expert is resident already")
            out.append(spec / base_bytes)
    return sorted(set(out))


BUDGET_SEARCHES = ("short", "exact")


def bounded_candidates(plan: CrispPlan, search: str = "short") -> list[Candidate]:
    """``--gpu-budget``'s short search: the families ``crisp_runtime.planning.defaults`` measured best, served from the
    pack's own plan (no plan knob: the plan stays the pack's, so one plan serves every stored budget): dominants
    whole with auxiliaries from what is resident, with and without plan-width prefetch; a missed dominant at an
    87.5% prefix with plan-width prefetch, and topped up ahead with serving-width prefetch; the plan's widths with
    plan-width prefetch (exact). ``search="exact"``: that last one alone (scored by batch forwards, no decode:
    minutes where the short search's decodes take hours on a 2-core machine)."""
    if search not in BUDGET_SEARCHES:
        raise ValueError(f"budget search: expected one of {', '.join(BUDGET_SEARCHES)}, got {search!r}")
    exact = Candidate(prefetch=PrefetchWidth.PLAN, kind=CandidateServing.PLAN)
    if search == "exact":
        return [exact]
    return [Candidate(1.0, prefetch=PrefetchWidth.PLAN), Candidate(1.0),
            Candidate(0.875, prefetch=PrefetchWidth.PLAN),
            Candidate(0.875, DominantWiden.AHEAD, PrefetchWidth.SERVING), exact]


def rule_candidate(plan: CrispPlan, goal: ThroughputGoal) -> Candidate | None:
    """The configuration ``crisp_runtime.planning.defaults`` runs on the GPU for a pack of ``plan`` without a stored
    choice, as a search candidate; None when the goal's eviction is not the rule's (no like-for-like speed)."""
    from crisp_runtime.planning.defaults import default_family, pack_facts

    gpu, _, _ = default_family(pack_facts({}, plan, plan.top_k))
    if gpu.eviction != goal.eviction:
        return None
    width = None if gpu.prefetch is None else gpu.prefetch.width
    if gpu.serving == SERVING_POLICIES["plan"]:
        cand = Candidate(prefetch=width, kind=CandidateServing.PLAN)
    else:
        cand = Candidate(gpu.serving.dominant_floor, gpu.serving.dominant_widen, width)
    if cand.serving() != gpu.serving or cand.prefetch_policy() != gpu.prefetch:
        raise ValueError(f"rule_candidate: the default rule's serving {gpu.serving.name!r} is no search candidate")
    return cand


def search_budgets(model, layers, plan: CrispPlan, windows: torch.Tensor, goals: Sequence[ThroughputGoal], *,
                   accuracy_windows: torch.Tensor | None = None, heldout_windows: torch.Tensor | None = None,
                   heldout_source: str = "", source: str = "held-out calibration windows", workers: int = 1,
                   search: str = "short", log: Callable[[str], None] = lambda msg: None):
    """One stored choice per goal's budget (:func:`search_throughput` over :func:`bounded_candidates`), as
    ``crisp_runtime.storage.serving_record.ServingChoices`` (None when no budget had a candidate within its bound: the
    default rule then applies at every budget). A budget whose candidates all lose too much is left out (said in
    ``log``), and so is one where the default rule (:func:`rule_candidate`, simulated beside the candidates) is
    faster than every candidate within the bound: without a choice the rule runs there. ``heldout_windows``: also
    decode each choice on these windows of held-out text (not the calibration text) against the 4-bit full width,
    with the search's prefetch window, and store that loss in the choice (``search["accuracy_loss_heldout"]``: what
    ``crisp-bench simulate``'s ``crisp-default`` record reports)."""
    from crisp_runtime.storage.serving_record import ServingChoices

    cands = bounded_candidates(plan, search)
    chosen = []
    for i, goal in enumerate(goals):
        log(f"gpu budget {i + 1}/{len(goals)}: {goal.budget:.0%} of the expert bytes, {len(cands)} candidates on "
            f"{goal.profile}")
        try:
            record, served = search_throughput(model, layers, plan, windows, goal, accuracy_windows=accuracy_windows,
                                               cands=cands, source=source, workers=workers,
                                               rule=rule_candidate(plan, goal), log=log)
        except ValueError as exc:
            log(f"gpu budget {goal.budget:.0%}: no stored choice ({exc}); the default rule applies there")
            continue
        assert served == plan, "bounded candidates carry no plan knob"
        if heldout_windows is not None:
            record = _with_heldout_loss(model, layers, plan, record, goal, heldout_windows, heldout_source, log)
        chosen.append(record)
    return ServingChoices(tuple(chosen)) if chosen else None


def _with_heldout_loss(model, layers, plan: CrispPlan, record: ServingRecord, goal: ThroughputGoal,
                       windows: torch.Tensor, source: str, log) -> ServingRecord:
    """``record`` with its loss decoded on held-out text (runtime in the loop, the search's prefetch window)."""
    first = next(iter(layers.values()))
    shape = TARGETS.get(record.search.get("target")) or ModelShape(
        "native", len(layers), first.num_experts, plan.top_k, first.hidden_size, first.intermediate_size)
    window = target_window(get_profile(goal.profile), shape, first.intermediate_size)
    pack = CrispPack(layers, plan)
    budget_bytes = int(goal.budget * total_expert_bytes(layers))
    full = score_plan(model, CrispPack(layers, full_plan(plan)), full_plan(plan), windows)
    if record.policy.follows_plan and record.policy.placement is Placement.GPU:
        scores = score_plan(model, pack, plan, windows)  # the plan's widths: a batch forward is its decode
        how = "batch forward (the plan's widths: outputs independent of the cache)"
    else:
        prefetch = None if record.prefetch is None else replace(record.prefetch, window=window)
        scores, _ = run_case(model, pack, plan, windows, budget_bytes,
                             ServingCase("crisp-stored", "crisp", record.policy, prefetch, eviction=record.eviction),
                             progress=lambda n, count: log(f"gpu budget {goal.budget:.0%}: held-out text: decoded "
                                                           f"{n}/{count} windows") if n % 8 == 0 or n == count
                             else None)
        how = f"decoded, runtime in the loop, prefetch window {window.name}"
    est = relative_loss(full.correct, scores.correct)
    log(f"gpu budget {goal.budget:.0%}: held-out loss {est.loss:.2%} +- {est.standard_error:.2%} over {est.windows} "
        f"windows of {source}")
    search = {**record.search, "accuracy_loss_heldout": est.loss,
              "accuracy_loss_heldout_se": finite_or_none(est.standard_error),
              "accuracy_heldout_source": f"{est.windows} x {windows.shape[1]} tokens of {source}, {how}"}
    return replace(record, search=search)


def check_gpu_budget_config(cfg) -> None:
    """``crisp-profile --gpu-budget``'s settings checked before any work (CliError naming the option)."""
    if cfg.gpu_budget is None:
        if cfg.heldout_data is not None:
            raise CliError("--heldout-data: only with --gpu-budget")
        return
    if cfg.throughput_budget is not None:
        raise CliError("--gpu-budget and --plan-for-throughput: give one (--gpu-budget keeps the plan and stores a "
                       "choice per budget; --plan-for-throughput searches the whole space at one budget)")
    if cfg.search_tier_widths:
        raise CliError("--search-tier-widths: only with --plan-for-throughput (--gpu-budget keeps the plan)")
    check_hardware_profile(cfg.hardware_profile)
    try:
        for fraction in (s for s in cfg.gpu_budget if isinstance(s, float)):
            ThroughputGoal(fraction, cfg.max_accuracy_loss, cfg.hardware_profile, confidence=cfg.accuracy_confidence)
    except (ValueError, OSError) as exc:
        raise CliError(f"--gpu-budget: {exc}") from None


def plan_budgets(inputs, packed, plan: CrispPlan, log: Callable[[str], None]):
    """The profiler's ``--gpu-budget`` step: :func:`search_budgets` on the held-out calibration windows (as
    :func:`plan_serving`), and on ``--heldout-data`` windows when given; the ``ServingChoices`` or None."""
    from crisp_runtime.storage.serving_record import budget_base_bytes

    from ..calibration import load_texts

    cfg = inputs.cfg
    try:
        goals = [ThroughputGoal(f, cfg.max_accuracy_loss, cfg.hardware_profile, confidence=cfg.accuracy_confidence)
                 for f in budget_fractions(cfg.gpu_budget, budget_base_bytes(packed))]
    except ValueError as exc:
        raise CliError(f"--gpu-budget: {exc}") from None
    accuracy_windows = inputs.throughput_windows
    windows = accuracy_windows[: cfg.throughput_windows]
    heldout = None
    if cfg.heldout_data is not None:
        heldout = random_windows(load_texts(list(cfg.heldout_data)), cfg.heldout_windows, cfg.throughput_seq_len,
                                 cfg.seed, "--heldout-data", seq_len_option="--throughput-seq-len")
    source = (f"held-out calibration windows ({accuracy_windows.shape[0]} x {accuracy_windows.shape[1]} tokens of "
              f"the last {cfg.holdout_fraction:.0%} of --data; the first {windows.shape[0]} traced)")
    choices = search_budgets(inputs.model, packed, plan, windows, goals, accuracy_windows=accuracy_windows,
                             heldout_windows=heldout, heldout_source=" ".join(map(str, cfg.heldout_data or ())),
                             source=source, workers=cfg.simulation_workers, search=cfg.budget_search, log=log)
    if choices is None:
        log("--gpu-budget: no budget had a candidate within the bound; the pack stores no choice (the default rule "
            "applies)")
    return choices
