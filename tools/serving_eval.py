"""Accuracy with the runtime in the loop: teacher-forced decoding through CRISP's device cache.

Once serving depends on what is resident, a batch forward over whole windows (``score_windows``)
no longer measures what a user gets: the widths served depend on the cache state, which depends
on every token before. Here every window is decoded *in order, one new token per forward with
the model's KV cache*, through one applied model whose expert cache (``gpu_budget``) is carried
across tokens and across windows, exactly as a server decoding that text would run. The next
token is the text's (teacher forcing), so the figures compare with the batch evaluation: for the
default serving policy (``"plan"``, outputs independent of the cache) they are equal to floating
point tolerance (tests/test_evaluate.py checks it).

A run is one :class:`ServingCase` (plan, serving policy, prefetch) at one budget (fraction of the
pack's total expert bytes). :func:`write_serving_json` documents the JSON records.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from crisp_runtime.execution.runtime import RuntimeConfig, plan_for_layers
from crisp_runtime.hf.dropin import apply
from crisp_runtime.hf.moe_layers import record_routing
from crisp_runtime.planning.baselines import equal_bytes_plans, full_plan
from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.planning.serving import SERVING_POLICIES, ServingPolicy, make_serving
from crisp_runtime.residency.eviction import POLICIES as EVICTION_POLICIES
from crisp_runtime.scheduling.copy_window import PrefetchWindow
from crisp_runtime.scheduling.prefetch import PrefetchPolicy
from crisp_runtime.storage.serving_record import budget_base_bytes

from .calibration import TokenScores, dump_json, score_windows
from .loss_estimate import finite_or_none, relative_loss

SERVING_EVAL_FORMAT = "crisp-eval-serving"
SERVING_EVAL_VERSION = 1
FLOOR_UNIT = "neurons"


@torch.no_grad()
def decode_windows(model, windows: torch.Tensor, progress: Callable | None = None,
                   stop: Callable[[TokenScores], bool] | None = None) -> TokenScores:
    """Teacher-forced decoding of each window (N, L): position t is fed alone, with the KV cache of
    positions < t, and predicts t+1. Same :class:`TokenScores` as ``score_windows`` ((N, L-1)).

    ``stop`` is asked after each window with the scores of the windows decoded so far; when it answers True
    the decode ends there and returns those windows' scores only ((n, L-1), n <= N): the throughput search
    stops a candidate already known to be over its bound."""
    device = next(p for p in model.parameters() if not p.is_meta).device
    nll = torch.zeros(windows.shape[0], windows.shape[1] - 1)
    correct = torch.zeros(windows.shape[0], windows.shape[1] - 1, dtype=torch.bool)
    for n, window in enumerate(windows):
        past = None
        ids = window.to(device)
        for t in range(windows.shape[1] - 1):
            out = model(input_ids=ids[t : t + 1].view(1, 1), cache=past)  # transformers 5: a DynamicCache
            past = out.cache
            logits = out.logits[0, -1].float()
            nll[n, t] = F.cross_entropy(logits.unsqueeze(0), ids[t + 1 : t + 2]).cpu()
            correct[n, t] = bool(logits.argmax() == ids[t + 1])
        if progress is not None:
            progress(n + 1, windows.shape[0])
        if stop is not None and n + 1 < windows.shape[0] and stop(TokenScores(nll[: n + 1], correct[: n + 1])):
            return TokenScores(nll[: n + 1].clone(), correct[: n + 1].clone())
    return TokenScores(nll, correct)


def total_expert_bytes(layers: Mapping) -> int:
    """Bytes of every expert of a pack at full width in 4-bit rows (what a budget fraction is a fraction of:
    ``crisp_runtime.storage.serving_record.budget_base_bytes``)."""
    return budget_base_bytes(layers)


@dataclass(frozen=True)
class ServingCase:
    """One evaluated configuration: which plan, how it is served, whether it prefetches.

    plan: "crisp" (the pack's plan), "uniform" / "skip_aux" (matched to CRISP's bytes, exact
    serving), "full" (4-bit full width). serving: a ``crisp_runtime.planning.serving`` policy spec (name, dict
    or instance) or None for the runtime's default (exact: the plan's widths). prefetch: a
    ``crisp_runtime.scheduling.prefetch.PrefetchPolicy`` or None (no prefetch). eviction: the runtime's eviction
    policy by name (``crisp_runtime.residency.eviction.POLICIES``; default its default, LRU); a record names it
    only when it is not LRU (records written before it was a field ran LRU).
    """

    name: str
    plan: str = "crisp"
    serving: ServingPolicy | str | None = None
    prefetch: PrefetchPolicy | None = None
    extra: dict = field(default_factory=dict)
    eviction: str = "lru"

    def __post_init__(self) -> None:
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"ServingCase {self.name!r}: eviction must be one of {', '.join(EVICTION_POLICIES)}, "
                             f"got {self.eviction!r}")
        if self.plan not in ("crisp", "uniform", "skip_aux", "full"):
            raise ValueError(f"ServingCase {self.name!r}: plan must be crisp, uniform, skip_aux or full, "
                             f"got {self.plan!r}")


def default_cases() -> list[ServingCase]:
    """What ``crisp-eval --mode decode`` evaluates: CRISP exact first (the baselines match its bytes),
    uniform and skip-aux exact at CRISP's bytes, then residency-aware CRISP (the runtime's "resident"
    policy and its dominant floor at 1.0 / 0.75 / 0.625 of the full width), each without and with
    next-layer prefetch."""
    cases = [ServingCase("crisp-exact"), ServingCase("uniform-exact", "uniform"),
             ServingCase("skip_aux-exact", "skip_aux")]
    resident = SERVING_POLICIES["resident"]
    for floor in (1.0, 0.75, 0.625):
        policy = replace(resident, name=f"resident-floor{floor:g}", dominant_floor=floor)
        for prefetch in (None, PrefetchPolicy()):
            suffix = "" if prefetch is None else "+prefetch"
            cases.append(ServingCase(f"crisp-{policy.name}{suffix}", "crisp", policy, prefetch))
    return cases


def format_table(records: Sequence[dict]) -> str:
    head = (f"{'policy':<36} {'budget':>6} {'accuracy':>9} {'acc. loss':>9} {'perplexity':>10} {'copied kB/tok':>13} "
            f"{'hit rate':>8}")
    lines = [head, "-" * len(head)]
    for r in records:
        loss = "" if r["accuracy_loss"] is None else f"{r['accuracy_loss']:.2%}"
        hit = "" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        lines.append(f"{r['policy']:<36} {r['budget_fraction']:>6.0%} {r['accuracy']:>9.4f} {loss:>9} "
                     f"{r['perplexity']:>10.4f} {r['bytes_copied_per_token'] / 1e3:>13.1f} {hit:>8}")
    return "\n".join(lines)


def _serving_dict(spec) -> dict:
    policy = make_serving("plan" if spec is None else spec)
    return {**policy.to_dict(), "exact": policy.follows_plan}


@contextlib.contextmanager
def applied(model, pack, plan: CrispPlan, budget_bytes: int | None, case: ServingCase):
    """``crisp_runtime.apply`` for one case (restored on exit)."""
    config = RuntimeConfig(serving="plan" if case.serving is None else case.serving, prefetch=case.prefetch,
                           eviction=case.eviction)
    handle = apply(model, pack, plan=plan, gpu_budget=budget_bytes, config=config)
    try:
        yield handle
    finally:
        handle.restore()


def run_case(model, pack, plan: CrispPlan, windows: torch.Tensor, budget_bytes: int | None,
             case: ServingCase, *, stop: Callable[[TokenScores], bool] | None = None,
             progress: Callable[[int, int], None] | None = None) -> tuple[TokenScores, dict]:
    """Decode ``windows`` through CRISP at ``budget_bytes`` under ``case``: (scores, handle.stats()); ``stop``
    and ``progress`` as in :func:`decode_windows` (the scores then cover the windows decoded)."""
    with applied(model, pack, plan, budget_bytes, case) as handle:
        scores = decode_windows(model, windows, progress=progress, stop=stop)
        return scores, handle.stats()


def score_plan(model, pack, plan: CrispPlan, windows: torch.Tensor, batch_size: int = 16) -> TokenScores:
    """``windows`` scored by batch forwards through CRISP serving ``plan`` at its own widths (the default serving
    policy, every expert resident): what decoding them under a serving policy that follows the plan gives, at any
    budget, with or without a prefetch at the plan's widths (outputs independent of the cache; tests/
    test_evaluate.py checks batch = decode), at a fraction of a decode's cost (one forward per window)."""
    handle = apply(model, pack, plan=plan, cpu="off")  # the device path on any machine: the decode's numerics
    try:
        return score_windows(model, windows, batch_size)
    finally:
        handle.restore()


def record(case: ServingCase, budget_fraction: float | None, budget_bytes: int | None, scores: TokenScores,
           stats: dict, full: TokenScores, plan: CrispPlan, seconds: float,
           neurons: Callable[[int], int] = lambda width: width) -> dict:
    """One JSON record (see :func:`write_serving_json`); ``neurons`` maps a width of ``plan`` to neurons (a 2-bit
    tail pack's plans count storage rows: ``plan_detail.uniform_width`` is recorded in neurons)."""
    tokens = max(1, stats.get("tokens", 0))
    served = {k: stats[k] for k in ("fallbacks", "serving_skips", "served_wider", "served_dominant_slots",
                                    "served_dominant_neurons", "served_aux_slots", "served_aux_neurons")
              if k in stats}
    for role in ("dominant", "aux"):
        slots = served.get(f"served_{role}_slots", 0)
        if slots:
            served[f"{role}_width_mean"] = served[f"served_{role}_neurons"] / slots
    prefetch = {k: stats[k] for k in ("prefetches", "prefetch_bytes", "prefetch_rejected", "prefetch_hits",
                                      "prefetch_cut", "prefetch_cut_rows") if k in stats}
    runs = stats.get("hits", 0) + stats.get("misses", 0) + stats.get("widenings", 0)
    return {
        "policy": case.name,
        "plan": case.plan,
        "plan_detail": {"uniform_width": None if plan.uniform_width is None else neurons(plan.uniform_width),
                        "skip_threshold": plan.skip_threshold,
                        "num_dominant": plan.num_dominant,
                        # a capped CRISP plan's cap in neurons (absent: uncapped, as in records before it)
                        **({} if plan.width_cap is None else {"width_cap": neurons(plan.width_cap)}),
                        # a weight-promoted CRISP plan's threshold (absent: none)
                        **({} if plan.aux_full_weight is None else {"aux_full_weight": plan.aux_full_weight}),
                        # a three-band CRISP plan's skip threshold (absent: none)
                        **({} if plan.aux_skip_weight is None else {"aux_skip_weight": plan.aux_skip_weight})},
        "budget_fraction": budget_fraction,
        "budget_bytes": budget_bytes,
        "serving": _serving_dict(case.serving),
        # the dominant floor counts neurons on a tail pack too (crisp_runtime.planning.serving.floor_in_rows); a record
        # without this unit counted storage rows there, and bench.sim_policies.read_accuracy skips it
        "floor_unit": FLOOR_UNIT,
        "prefetch": None if case.prefetch is None else case.prefetch.to_dict(),
        "accuracy": scores.accuracy,
        "perplexity": scores.perplexity,
        "loss": scores.loss,
        "accuracy_loss": (full.accuracy - scores.accuracy) / full.accuracy if full.accuracy else None,
        # its standard error, paired with the reference and clustered by window (crisp_tools.loss_estimate)
        "accuracy_loss_se": _loss_se(full, scores),
        "tokens_evaluated": int(scores.nll.numel()),
        "bytes_routed_per_token": stats.get("bytes_routed", 0) / tokens,
        "bytes_h2d_per_token": stats.get("bytes_h2d", 0) / tokens,
        # demanded copies (bytes_h2d) plus prefetched ones: everything that crossed to the device
        "bytes_copied_per_token": (stats.get("bytes_h2d", 0) + stats.get("prefetch_bytes", 0)) / tokens,
        "hit_rate": stats.get("hits", 0) / runs if runs else None,
        "served": served,
        "prefetch_stats": prefetch,
        "elapsed_s": round(seconds, 1),
        **({} if case.eviction == "lru" else {"eviction": case.eviction}),
        **case.extra,
    }


def _loss_se(full: TokenScores, scores: TokenScores) -> float | None:
    if not full.accuracy or full.correct.shape != scores.correct.shape:
        return None
    return finite_or_none(relative_loss(full.correct, scores.correct).standard_error)


def write_serving_json(path, records: Sequence[dict], meta: dict) -> None:
    """Write the runtime-in-the-loop evaluation (atomically) as::

        {"format": "crisp-eval-serving", "version": 1,
         ... meta: model, crisp (pack folder), data, windows [N, L], tokens_evaluated, full_width
             {accuracy, perplexity} (the 4-bit full-width reference of every accuracy_loss), budgets,
             notes ...,
         "records": [ one per (policy, budget):
           {"policy": str            case name, e.g. "crisp-exact", "crisp-resident-floor0.75+prefetch",
            "plan": str              crisp | uniform | skip_aux | full (uniform/skip_aux matched to CRISP's bytes),
            "plan_detail": {uniform_width (neurons), skip_threshold, num_dominant, and for a capped CRISP
                            plan width_cap (neurons) and aux_full_weight},
            "budget_fraction": float  GPU expert-cache budget / all expert bytes of the pack,
            "budget_bytes": int,
            "serving": {name, hit_width, aux_narrower, aux_missing, dominant_floor, exact: bool}
                                     (crisp_runtime.planning.serving.ServingPolicy.to_dict; exact = plan's widths),
            "prefetch": dict | null  the prefetch policy (crisp_runtime.scheduling.prefetch.PrefetchPolicy.to_dict),
            "accuracy": float        next-token accuracy, teacher-forced decode through the runtime,
            "perplexity": float, "loss": float (mean nll, nats),
            "accuracy_loss": float   (full-width accuracy - accuracy) / full-width accuracy (a fraction),
            "accuracy_loss_se": float | null  its standard error, paired with the full-width decode and
                                     clustered by window (crisp_tools.loss_estimate; null from one window),
            "tokens_evaluated": int  predictions scored (N x (L - 1)),
            "bytes_routed_per_token", "bytes_h2d_per_token" (demanded copies),
            "bytes_copied_per_token" (demanded + prefetched copies): float, "hit_rate": float,
            "served": {fallbacks, serving_skips, served_wider, served_{dominant,aux}_{slots,neurons},
                       {dominant,aux}_width_mean}   (handle.stats(); absent keys: runtime without them),
            "prefetch_stats": {prefetches, prefetch_bytes, prefetch_rejected, prefetch_hits, and with a window
                               prefetch_cut, prefetch_cut_rows (requests the modeled copy engine cut, their rows)},
            "eviction": str          only when not the runtime's default LRU (ServingCase.eviction),
            "elapsed_s": float}, ...]}
    """
    dump_json(path, {"format": SERVING_EVAL_FORMAT, "version": SERVING_EVAL_VERSION, **meta,
                     "records": list(records)})


def with_window(cases: Sequence[ServingCase], window: PrefetchWindow | None) -> list[ServingCase]:
    """``cases`` with ``window`` on every prefetch (``PrefetchPolicy.window``: the runtime admits only the rows a
    modeled copy engine delivers before the next layer's demand, as the simulator does); None: unchanged."""
    if window is None:
        return list(cases)
    if not isinstance(window, PrefetchWindow):
        raise ValueError(f"window: expected a PrefetchWindow or None, got {window!r}")
    return [case if case.prefetch is None else replace(case, name=f"{case.name}+window",
                                                       prefetch=replace(case.prefetch, window=window))
            for case in cases]


def serving_sweep(model, pack, windows: torch.Tensor, budgets: Sequence[float], cases: Sequence[ServingCase], *,
                  log: Callable[[str], None] = lambda msg: None,
                  window: PrefetchWindow | None = None, reference=None) -> tuple[list[dict], dict]:
    """Every case at every budget fraction: (records, meta) for :func:`write_serving_json`.

    window: a prefetch window put on every case that prefetches (:func:`with_window`; the case's name gains
    ``+window``), e.g. ``crisp_bench.simulate.target_window(profile, shape, I)`` so that the decode serves the
    widths the simulated machine would; None (default): each case's own prefetch policy.

    The 4-bit full-width reference and the exact uniform / skip-aux baselines are served at the
    plan's widths, so their outputs do not depend on the budget: they are decoded once, at the
    middle budget. CRISP exact is decoded at every budget (its figures must agree: a check of
    that independence). Uniform and skip-aux are matched to the bytes per token CRISP exact routed
    (``crisp_runtime.planning.baselines``) on the routing of the full-width decode.

    reference: the 4-bit pack a 2-bit tail pack (``crisp_tools.tail_pack``) came from, or None. With one, the
    full-width reference of every ``accuracy_loss`` is the reference pack's full width (decoded once, at the
    middle budget), the budget fractions are fractions of ITS expert bytes (equal GPU memory: the tail pack
    fits more rows in the same bytes), and the tail pack's own full width is a record ``full_layout-exact``.
    """
    if not budgets:
        raise ValueError("budgets: expected at least one fraction")
    cases = with_window(cases, window)
    for b in budgets:
        if not 0.0 < b <= 1.0:
            raise ValueError(f"budgets: fractions of the expert bytes must lie in (0, 1], got {b}")
    plan = plan_for_layers(pack.plan, pack.layers)  # a 2-bit tail pack's widths count storage rows
    total = total_expert_bytes(pack.layers if reference is None else reference.layers)
    nb = next(iter(pack.layers.values())).fmt.neuron_nbytes(next(iter(pack.layers.values())).hidden_size)
    mid = sorted(budgets)[len(budgets) // 2]

    def budget_bytes(fraction):
        return int(fraction * total)

    to_neurons = next(iter(pack.layers.values())).neurons  # a tail pack's widths count storage rows
    t0 = time.time()
    full_case = ServingCase("full-exact", "full")
    if reference is not None:
        ref_first = next(iter(reference.layers.values()))
        ref_plan = CrispPlan.full(plan.num_experts, plan.top_k, ref_first.intermediate_size, plan.layer_ids)
        (full, full_stats), secs = _timed(run_case, model, reference, ref_plan, windows, budget_bytes(mid), full_case)
        log(f"full width (reference pack): acc {full.accuracy:.4f} ppl {full.perplexity:.4f} ({secs:.0f} s)")
        records = [record(full_case, mid, budget_bytes(mid), full, full_stats, full, ref_plan, secs)]
        full_case = ServingCase("full_layout-exact", "full")
    with record_routing(model) as routing:
        (own_full, own_stats), secs = _timed(run_case, model, pack, full_plan(plan), windows, budget_bytes(mid),
                                             full_case)
    if reference is None:
        full = own_full
    log(f"{full_case.name}: acc {own_full.accuracy:.4f} ppl {own_full.perplexity:.4f} ({secs:.0f} s)")
    own = record(full_case, mid, budget_bytes(mid), own_full, own_stats, full, full_plan(plan), secs)
    records = [own] if reference is None else [*records, own]
    route = {layer_id: routing.layer(layer_id) for layer_id in plan.layer_ids}
    matched = None
    for fraction in budgets:
        for case in cases:
            if case.plan != "crisp":
                if case.serving is not None or case.prefetch is not None:
                    raise ValueError(f"case {case.name!r}: only the CRISP plan is evaluated with a serving policy or "
                                     "prefetch here")
                if fraction != mid:
                    continue
            if case.plan == "crisp":
                case_plan = plan
            else:
                if matched is None:
                    raise ValueError(f"case {case.name!r}: put an exact 'crisp' case first (the baselines match its "
                                     "bytes)")
                case_plan = matched[case.plan]
            (scores, stats), secs = _timed(run_case, model, pack, case_plan, windows, budget_bytes(fraction), case)
            rec = record(case, fraction, budget_bytes(fraction), scores, stats, full, case_plan, secs, to_neurons)
            records.append(rec)
            rel = "n/a" if rec["accuracy_loss"] is None else f"{rec['accuracy_loss']:.2%}"
            log(f"{case.name} @ {fraction:.0%}: acc {scores.accuracy:.4f} ppl {scores.perplexity:.4f} "
                f"accuracy loss {rel} copied/token {rec['bytes_copied_per_token']:,.0f} ({secs:.0f} s)")
            if matched is None and case.plan == "crisp" and _serving_dict(case.serving)["exact"]:
                target = stats["bytes_routed"] / max(1, stats["tokens"]) / nb
                matched = equal_bytes_plans(plan, route, target=target)
    meta = {"windows": list(windows.shape), "tokens_evaluated": int(full.nll.numel()),
            "full_width": {"accuracy": full.accuracy, "perplexity": full.perplexity},
            "budgets": list(budgets), "total_expert_bytes": total, "elapsed_s": round(time.time() - t0, 1),
            "notes": ["teacher-forced decode through crisp_runtime.apply: one token per forward with the KV cache; "
                      "the expert cache is carried across tokens and windows (one applied model per record)",
                      f"full width, uniform and skip_aux are exact (outputs independent of the budget): decoded once, "
                      f"at the {mid:.0%} budget"]}
    if window is not None:
        meta["prefetch_window"] = window.to_dict()
    return records, meta


def _timed(fn, *args):
    t0 = time.time()
    out = fn(*args)
    return out, time.time() - t0
