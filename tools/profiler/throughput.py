"""Plan for throughput: the serving configuration with the most simulated tokens/s at a GPU budget on a
hardware profile whose accuracy loss, measured with the runtime in the loop, stays within a bound.

The plan's widths (tiers, Warm width) are chosen before, by bytes (``search.py``); this search chooses
how the pack is *served* at a budget, from a small stated space (:func:`candidates`):

- the dominant floor (``ServingPolicy.dominant_floor``): 1.0, 0.75, 0.625, 0.5 of the full width;
- prefetch of the next layer's predicted experts: none, at the plan's widths (PLAN), or at the
  serving policy's widths (SERVING: a missed dominant at its floor);
- widening a floor-loaded dominant (``ServingPolicy.dominant_widen``): never, or ahead of demand
  (AHEAD, with SERVING prefetch: the prefetcher's second phase); on demand (HIT) is left out: on the
  simulated RTX 4090 it ran 2.03x against 2.42x without (docs/residency-and-serving.md);
- auxiliaries served from what is resident (wider for free, narrower without a copy), eviction fixed
  by the goal (default next-use, the runtime's best online policy there);
- the one plan knob: auxiliaries of routing weight >= w at the dominant width
  (``CrispPlan.aux_full_weight``), none or w in :data:`SEARCH_AUX_WEIGHTS` (issue 10, session 11: on the
  tiny Mixtral's held-out text the weight picked the auxiliaries that matter better than the pair tiers
  below 1% loss). The chosen weight is stored in the pack's plan.

Speed: each candidate replays a routing trace recorded on the held-out calibration windows (with
the next layer's predictions) through the simulator's library API (``crisp_bench.simulate``, the
runtime's own serving / residency / eviction / prefetch code), mapped onto a target model's sizes
(default: Mixtral-8x7B when the expert count and top-k match, else the model itself) on a hardware
profile (``crisp_bench.profiles``); tokens/s relative to full-width LRU on the same trace and budget.

Accuracy: teacher-forced decoding through ``crisp_runtime.apply`` with its cache at the budget
(``crisp_tools.serving_eval.run_case``, what ``crisp-eval --mode decode`` runs) on the same held-out
*calibration* windows (the last ``--holdout-fraction`` of the calibration text: never the evaluation
text), relative to 4-bit full width, with the prefetch window of the same profile and target
(``crisp_runtime.copy_window``: the decode admits only the prefetch rows the simulated copy engine delivers
before the next layer's demand, so the accuracy belongs to the simulated widths; without it every prefetch
completed and the loss was 1-2 points lower, docs/residency-and-serving.md). Candidates are evaluated
fastest first and the search stops at the first within ``max_accuracy_loss``: the fastest feasible candidate.

Package graph: ``crisp_tools`` imports ``crisp_bench.simulate`` / ``.profiles`` / ``.traces`` (the
simulator's library, which imports only ``crisp_runtime`` and ``crisp_kernels``); the bench CLIs import
``crisp_tools.text`` only. No module imports back into this one, so the module graph is acyclic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist

import torch
from crisp_bench.profiles import get_profile
from crisp_bench.shapes import TARGETS, ModelShape
from crisp_bench.simulate import SimPolicy, simulate_decode, target_window
from crisp_bench.traces import record_trace

from crisp_runtime.baselines import full_plan
from crisp_runtime.eviction import POLICIES as EVICTION_POLICIES
from crisp_runtime.pack import CrispPack
from crisp_runtime.plan import CrispPlan, PolicyKind
from crisp_runtime.prefetch import PrefetchPolicy, PrefetchWidth
from crisp_runtime.serving import SERVING_POLICIES, DominantWiden, ServingPolicy
from crisp_runtime.serving_record import SERVING_KEY, ServingRecord

from ..calibration import CliError
from ..loss_estimate import finite_or_none, relative_loss
from ..serving_eval import ServingCase, run_case, total_expert_bytes

__all__ = ["SERVING_KEY", "Candidate", "ThroughputGoal", "candidates", "goal_from_config", "plan_serving",
           "search_throughput", "simulate_candidates", "target_shape"]

SEARCH_FLOORS = (1.0, 0.75, 0.625, 0.5)
# None: the tiers alone; the weights: two of the frontier's (crisp_bench.sim_policies.PROMOTE_WEIGHTS), which
# lost 0.78% / 1.06% at 48% / 45% of the 4-bit bytes on the Warm 64 / Cold 32 tail pack (plan widths, session 11)
SEARCH_AUX_WEIGHTS = (None, 0.3, 0.4)


@dataclass(frozen=True)
class ThroughputGoal:
    """What the search optimises: tokens/s at ``budget`` (fraction of all expert bytes at full width) on
    ``profile``, subject to a relative accuracy loss <= ``max_accuracy_loss`` (a fraction) with one-sided
    ``confidence`` (0.5: the point estimate alone, as before session 13)."""

    budget: float
    max_accuracy_loss: float = 0.02
    profile: str = "rtx4090-pcie4"
    target: str = "auto"  # a crisp_bench.profiles.TARGETS name, "native", or "auto" (see the module docstring)
    eviction: str = "next_use"
    # 0.95: z = 1.645. Session 11's choice lost 1.74% on 16 x 128 calibration windows and 2.44% held out
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


@dataclass(frozen=True)
class Candidate:
    """One serving configuration of the search space."""

    dominant_floor: float
    widen: DominantWiden = DominantWiden.NEVER
    prefetch: PrefetchWidth | None = None
    aux_full_weight: float | None = None  # the plan's CrispPlan.aux_full_weight (None: the tiers alone)

    @property
    def label(self) -> str:
        pf = "" if self.prefetch is None else f"+prefetch-{self.prefetch.value}"
        widen = "" if self.widen is DominantWiden.NEVER else f"-{self.widen.value}"
        aux = "" if self.aux_full_weight is None else f"-aux{self.aux_full_weight:g}"
        return f"floor{self.dominant_floor:g}{widen}{aux}{pf}"

    def plan_for(self, plan: CrispPlan) -> CrispPlan:
        """The plan this candidate serves: ``plan`` with its auxiliary weight (``plan`` itself without one)."""
        return plan if self.aux_full_weight is None else plan.promoted(self.aux_full_weight)

    def serving(self) -> ServingPolicy:
        return replace(SERVING_POLICIES["resident"], name=f"resident-floor{self.dominant_floor:g}"
                       + ("" if self.widen is DominantWiden.NEVER else f"-{self.widen.value}"),
                       dominant_floor=self.dominant_floor, dominant_widen=self.widen)

    def prefetch_policy(self) -> PrefetchPolicy | None:
        return None if self.prefetch is None else PrefetchPolicy(width=self.prefetch)


def candidates(floors: Sequence[float] = SEARCH_FLOORS,
               aux_full_weights: Sequence[float | None] = SEARCH_AUX_WEIGHTS) -> list[Candidate]:
    """The search space (module docstring): per auxiliary weight and floor, no prefetch, PLAN prefetch, and
    below full width SERVING prefetch without and with AHEAD widening (at full width those equal PLAN): 14 per
    weight, 42 by default."""
    out = []
    for w in aux_full_weights:
        for f in floors:
            out += [Candidate(f, aux_full_weight=w), Candidate(f, prefetch=PrefetchWidth.PLAN, aux_full_weight=w)]
            if f < 1.0:
                out += [Candidate(f, prefetch=PrefetchWidth.SERVING, aux_full_weight=w),
                        Candidate(f, DominantWiden.AHEAD, PrefetchWidth.SERVING, aux_full_weight=w)]
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


def simulate_candidates(trace, plan: CrispPlan, goal: ThroughputGoal, shape: ModelShape, cands: Sequence[Candidate],
                        *, warmup: int, log: Callable[[str], None] = lambda msg: None) -> tuple[float, list[dict]]:
    """(full-width LRU tokens/s in router order, one record per candidate) on ``trace`` at ``goal.budget``;
    ``log`` gets one line per candidate as it is simulated (42 by default: minutes on a small CPU)."""
    profile = get_profile(goal.profile)
    budget = int(goal.budget * shape.total_expert_nbytes)
    predicted = trace.predicted
    base = simulate_decode(trace, SimPolicy("full", full_plan(plan)), profile, shape, budget, orders=["router"],
                           warmup=warmup)
    base_tps = base.tokens_per_s("router")
    out = []
    for c in cands:
        sim = SimPolicy("crisp", c.plan_for(plan), c.serving(), goal.eviction, c.prefetch is not None,
                        c.prefetch or PrefetchWidth.PLAN)
        res = simulate_decode(trace, sim, profile, shape, budget, orders=["widest_first"], warmup=warmup,
                              predicted=predicted if c.prefetch is not None else None)
        s = res.summary("widest_first")
        out.append({"candidate": c.label, "tokens_per_s": s["tokens_per_s"], "x_full_lru": s["tokens_per_s"] / base_tps,
                    "bytes_per_token": s["bytes_per_token"], "hit_rate": s["hit_rate"]})
        log(f"throughput: simulated {len(out)}/{len(cands)} {c.label}: {s['tokens_per_s']:.2f} tok/s "
            f"({s['tokens_per_s'] / base_tps:.2f}x full-width LRU)")
    return base_tps, out


def search_throughput(model, layers, plan: CrispPlan, windows: torch.Tensor, goal: ThroughputGoal, *,
                      accuracy_windows: torch.Tensor | None = None, cands: Sequence[Candidate] | None = None,
                      source: str = "held-out calibration windows",
                      log: Callable[[str], None] = lambda msg: None) -> tuple[ServingRecord, CrispPlan]:
    """The fastest candidate within the accuracy bound (see the module docstring): its :class:`ServingRecord`
    and the plan it serves (``plan``, or ``plan`` with the candidate's auxiliary weight: the pack stores that).

    windows: (N, L) held-out calibration token windows the routing trace is recorded on (the speed).
    accuracy_windows: (M, L) windows decoded for the accuracy (default ``windows``), their first N
    ``windows`` themselves when the profiler draws them (``plan_serving``). A candidate is decoded in looks of
    N windows; it is accepted when, over all M, its loss + z standard errors <= ``goal.max_accuracy_loss``
    (z of ``goal.confidence``, one-sided; :mod:`crisp_tools.loss_estimate`), and stopped at a look where its
    loss - z standard errors is already over the bound. Raises ValueError when no candidate is accepted.
    """
    if cands is None:  # the auxiliary weight is a CRISP plan's knob: other plans search the serving alone
        weights = SEARCH_AUX_WEIGHTS if plan.policy is PolicyKind.CRISP else (None,)
        skip = plan.aux_skip_weight  # a three-band plan: only weights >= its skip weight (below: refused)
        cands = candidates(aux_full_weights=[w for w in weights if w is None or skip is None or w >= skip])
    cands = list(cands)
    if not cands:
        raise ValueError("search_throughput: no candidates")
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"search_throughput: windows must be (N, L >= 2) token ids, got {tuple(windows.shape)}")
    if accuracy_windows is None:
        accuracy_windows = windows
    if accuracy_windows.dim() != 2 or accuracy_windows.shape[1] < 2:
        raise ValueError(f"search_throughput: accuracy_windows must be (M, L >= 2) token ids, got "
                         f"{tuple(accuracy_windows.shape)}")
    trace = record_trace(model, windows, source=source)
    first = next(iter(layers.values()))
    shape = target_shape(goal, trace, first.hidden_size)
    warmup = min(32, trace.num_tokens // 4)
    base_tps, sims = simulate_candidates(trace, plan, goal, shape, cands, warmup=warmup, log=log)
    pack = CrispPack(layers, plan)
    budget_bytes = int(goal.budget * total_expert_bytes(layers))
    full, _ = run_case(model, pack, full_plan(plan), accuracy_windows, budget_bytes, ServingCase("full-exact", "full"))
    window = target_window(get_profile(goal.profile), shape, first.intermediate_size)
    z = goal.z
    look = windows.shape[0]
    total = accuracy_windows.shape[0]

    def over_bound(scores) -> bool:  # asked after each decoded window; answers at the looks only
        n = scores.correct.shape[0]
        return n % look == 0 and \
            relative_loss(full.correct[:n], scores.correct).lower(z) > goal.max_accuracy_loss

    by_label = {c.label: c for c in cands}
    chosen = None
    for r in sorted(sims, key=lambda r: -r["tokens_per_s"]):
        c = by_label[r["candidate"]]
        prefetch = c.prefetch_policy()
        case = ServingCase(f"crisp-{c.label}", "crisp", c.serving(),
                           None if prefetch is None else replace(prefetch, window=window), eviction=goal.eviction)
        scores, _ = run_case(model, pack, c.plan_for(plan), accuracy_windows, budget_bytes, case, stop=over_bound)
        est = relative_loss(full.correct[: scores.correct.shape[0]], scores.correct)
        accepted = est.windows == total and est.upper(z) <= goal.max_accuracy_loss
        r.update(accuracy_loss=est.loss, accuracy_loss_se=finite_or_none(est.standard_error),
                 accuracy_loss_upper=finite_or_none(est.upper(z)), accuracy_windows=est.windows,
                 accuracy_decision="within" if accepted else "over" if est.lower(z) > goal.max_accuracy_loss
                 else "unresolved")
        log(f"throughput: {c.label}: accuracy loss {est.loss:.2%} +- {est.standard_error:.2%} over {est.windows}/"
            f"{total} windows ({r['accuracy_decision']}; runtime in the loop)")
        if accepted:
            chosen = (c, r)
            break
    if chosen is None:
        raise ValueError(f"search_throughput: no candidate loses <= {goal.max_accuracy_loss:.2%} at "
                         f"{goal.confidence:.0%} confidence on the {source}; raise the bound, the budget or the "
                         "accuracy windows, or lower the confidence")
    c, r = chosen
    search = {"objective": "simulated tokens/s", "profile": goal.profile, "target": shape.name,
              "max_accuracy_loss": goal.max_accuracy_loss, "confidence": goal.confidence, "z": z,
              "accuracy_text": source, "accuracy_prefetch_window": window.name,
              "windows": list(windows.shape), "accuracy_windows": list(accuracy_windows.shape),
              "full_width_accuracy": full.accuracy, "full_lru_tokens_per_s": base_tps, "chosen": r,
              "candidates": sims}
    chosen_plan = c.plan_for(plan)
    if c.aux_full_weight is not None:
        chosen_plan = dataclasses.replace(chosen_plan, description=(
            f"{plan.description} Auxiliaries of routing weight >= {c.aux_full_weight:g} run at the dominant width "
            f"(chosen by --plan-for-throughput for simulated tokens/s).").strip())
    return ServingRecord(c.serving(), c.prefetch_policy(), goal.eviction, goal.budget, search), chosen_plan


def goal_from_config(cfg) -> ThroughputGoal | None:
    """``crisp-profile --plan-for-throughput``'s goal (None without it); CliError naming the option. The
    hardware profile is checked even without it: a bad value is refused, never ignored."""
    try:
        get_profile(cfg.hardware_profile)
        if cfg.throughput_budget is None:
            return None
        if cfg.throughput_accuracy_windows is not None and cfg.throughput_accuracy_windows < cfg.throughput_windows:
            raise ValueError(f"--throughput-accuracy-windows ({cfg.throughput_accuracy_windows}) must be at least "
                             f"--throughput-windows ({cfg.throughput_windows}): the traced windows are decoded too")
        return ThroughputGoal(cfg.throughput_budget, cfg.max_accuracy_loss, cfg.hardware_profile,
                              confidence=cfg.accuracy_confidence)
    except (ValueError, OSError) as exc:
        raise CliError(f"--plan-for-throughput / --hardware-profile: {exc}") from None


def plan_serving(inputs, goal: ThroughputGoal, packed, plan: CrispPlan, log: Callable[[str], None]
                 ) -> tuple[ServingRecord, CrispPlan]:
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
                                 source=source, log=log)
    except ValueError as exc:
        raise CliError(f"--plan-for-throughput: {exc}") from None
