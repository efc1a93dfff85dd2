"""Session 4 (issue 10) simulation study: eviction and floor variants at 25%, rtx4090-pcie4, Mixtral-8x7B sizes.

A study script, not project code: the variants (trim instead of evict, auxiliary-first eviction, a floor that
depends on the dominant's routing-weight share) are prototypes patched around the runtime's own ledger and
serving rule, to rank them by simulated speed and served width before building any of them. Records ->
docs/bench-simulate-s4-eviction-25.json. Run: OMP_NUM_THREADS=1 PYTHONPATH=. python docs/sim-s4-eviction-study.py
(``--frontier OUT``: uniform / skip-auxiliary / CRISP at the plan's widths with next-use eviction and plan-width
prefetch, the same window, for the frontier comparison -> docs/bench-simulate-s4-frontier-25.json.)
"""
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import crisp_bench.simulate as bs
import torch
from crisp_bench.profiles import get_profile
from crisp_bench.shapes import TARGETS
from crisp_bench.traces import Trace

import crisp_runtime.planning.serving as sv
from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.planning.serving import SERVING_POLICIES, AuxMissing, AuxNarrower, DominantWiden
from crisp_runtime.residency.ledger import MISS, WIDEN, CacheBudgetError, Decision, ResidencyLedger
from crisp_runtime.storage.outputs import write_json

torch.set_num_threads(1)
TRACE = "docs/bench-trace-heldout-predicted.npz"


class TrimLedger(ResidencyLedger):
    """Trim-first: before evicting any key, cut the policy's victim among keys wider than ``trim`` of the full
    width to that prefix (its tail rows dropped); evict whole only when every unprotected key is that narrow."""

    trim = 0.75

    def _tw(self, key):
        return math.ceil(self.trim * self._full[key[0]])

    def _free_one(self, keep):
        v = self.policy.victim(_Or(keep, lambda k: self._widths[k] <= self._tw(k)))
        if v is not None:
            old = self._widths[v]
            self._widths[v] = self._tw(v)
            self.used -= self._nb[v[0]] * (old - self._widths[v])
            return None
        v = self.policy.victim(keep)
        if v is None:
            return False
        w = self._widths[v]
        self.evict(v)
        return (v, w)

    def _make_room(self, extra, key, protected, weak_protected):
        if self.used + extra <= self.budget:
            return ()
        out = []
        for keep in ({*protected, key}, {*weak_protected, key}):
            while self.used + extra > self.budget:
                r = self._free_one(keep)
                if r is False:
                    break
                if r:
                    out.append(r)
        if self.used + extra > self.budget:
            raise CacheBudgetError("no room")
        return tuple(out)

    def prefetch(self, layer_id, expert, width, *, protected=()):
        key = (layer_id, expert)
        old = self._widths.get(key, 0)
        if old >= width:
            return None
        extra = self._nb[layer_id] * (width - old)
        keep = {*protected, key}
        held = sum(self._nb[k[0]] * w for k, w in self._widths.items() if k in keep)
        if held + extra > self.budget:
            self.counters.prefetch_rejected += 1
            return None
        while self.used + extra > self.budget:
            self._free_one(keep)
        self._grow(key, old, width, extra)
        self._prefetched.add(key)
        self.counters.prefetches += 1
        self.counters.prefetch_bytes += extra
        return Decision(key, WIDEN if old else MISS, width, old, width, extra, (), prefetch=True)


class AuxFirstLedger(ResidencyLedger):
    """Role-aware: a demand evicts keys whose last demand was an auxiliary's (narrower than 100 of 256 rows)
    before keys last demanded as a dominant (the policy's order within each group)."""

    def request(self, layer_id, expert, width, **kw):
        self.__dict__.setdefault("dom", {})[(layer_id, expert)] = width >= 100
        return super().request(layer_id, expert, width, **kw)

    def _make_room(self, extra, key, protected, weak_protected):
        if self.used + extra <= self.budget:
            return ()
        dom = self.__dict__.get("dom", {})
        strong, weak, out = {*protected, key}, {*weak_protected, key}, []
        while self.used + extra > self.budget:
            v = (self.policy.victim(_Or(strong, lambda k: dom.get(k, False))) or self.policy.victim(strong)
                 or self.policy.victim(weak))
            if v is None:
                raise CacheBudgetError("no room")
            out.append((v, self._widths[v]))
            self.evict(v)
        return tuple(out)


class _Or:
    def __init__(self, keys, pred):
        self.keys, self.pred = keys, pred

    def __contains__(self, k):
        return k in self.keys or self.pred(k)

    def __iter__(self):
        return iter(self.keys)


class SharePlan:
    """The plan, its dominant mask replaced by the dominant's routing-weight share (0 = auxiliary) for the
    simulator's served widths (its first pass over the trace's layers); prefetch requests keep boolean roles."""

    def __init__(self, plan, layers):
        self.p, self.calls, self.layers = plan, 0, layers

    def __getattr__(self, n):
        return getattr(self.p, n)

    def token_widths_and_roles(self, layer_id, idx, weights, roles=True):
        w, d = self.p.token_widths_and_roles(layer_id, idx, weights, roles=roles)
        self.calls += 1
        if d is None or self.calls > self.layers:
            return w, d
        share = weights / weights.sum(-1, keepdim=True)
        return w, torch.where(d, share, torch.zeros_like(share))


def share_floor(th, lo, hi):
    """_serve_one with the dominant floor ``lo`` when the dominant's share < th, else ``hi`` (a prefetch's
    dominant has no share: ``hi``)."""
    def one(policy, wanted, dominant, resident, full):
        if resident >= wanted:
            return wanted
        if dominant:
            f = lo if (1.0 if dominant is True else float(dominant)) < th else hi
            return max(resident, min(wanted, math.ceil(f * full)))
        if resident > 0:
            return resident if policy.aux_narrower is AuxNarrower.RESIDENT else wanted
        return wanted if policy.aux_missing is AuxMissing.LOAD else 0
    return one


def full_lru(trace, plan, prof, shape) -> float:
    """The baseline, in the same run: full-width LRU in router order (mixtral-offloading), tokens/s."""
    full = CrispPlan.full(plan.num_experts, plan.top_k, plan.intermediate_size, plan.layer_ids)
    res = bs.simulate_decode(trace, bs.SimPolicy("full", full), prof, shape, int(0.25 * shape.total_expert_nbytes),
                             orders=["router"], warmup=32)
    return res.summary("router")["tokens_per_s"]


def main(out_path):
    _refuse_existing(out_path)
    trace = Trace.load(TRACE)
    plan = CrispPlan.load("models/tiny-mixtral-crisp/plan.json")
    prof, shape = get_profile("rtx4090-pcie4"), TARGETS["mixtral-8x7b"]
    base_tps = full_lru(trace, plan, prof, shape)
    base = SERVING_POLICIES["resident"]
    stats = {}
    orig_ss, orig_one, orig_led = bs.serve_slots, sv._serve_one, bs.ResidencyLedger

    def counted(policy, index, wanted, dominant, **kw):  # measurement only: served vs wanted dominant neurons
        r = orig_ss(policy, index, wanted, dominant, **kw)
        for s, w, d in zip(r.served_list, wanted.reshape(-1).tolist(), dominant.reshape(-1).tolist(), strict=True):
            if d:
                stats["n"] = stats.get("n", 0) + 1
                stats["narrower"] = stats.get("narrower", 0) + (s < w)
                stats["short"] = stats.get("short", 0) + (w - s) / w
                stats["wshort"] = stats.get("wshort", 0) + d * (w - s) / w
        return r

    cases = []
    for f in (1.0, 0.875, 0.75, 0.625):
        for ev in ("next_use", "belady"):
            cases.append((f"floor{f:g}/{ev}", f, ev, None, None))
    for f, t in ((0.875, 0.875), (0.75, 0.75), (0.75, 0.5), (0.625, 0.625)):
        cases.append((f"floor{f:g}/next_use/trim-first{t:g}", f, "next_use", ("trim", t), None))
    cases.append(("floor0.75/next_use/aux-first", 0.75, "next_use", ("aux", None), None))
    for th, lo, hi in ((0.76, 0.625, 1.0), (0.76, 0.5, 1.0), (0.87, 0.625, 1.0), (0.87, 0.5, 1.0),
                       (0.76, 0.625, 0.875), (0.87, 0.625, 0.875), (0.87, 0.5, 0.875)):
        cases.append((f"share<{th:g}:floor{lo:g},else{hi:g}/next_use", lo, "next_use", None, (th, lo, hi)))
    records = []
    for label, f, ev, ledger, share in cases:
        stats.clear()
        bs.serve_slots = counted
        if ledger is not None:
            cls = TrimLedger if ledger[0] == "trim" else AuxFirstLedger
            if ledger[0] == "trim":
                TrimLedger.trim = ledger[1]
            bs.ResidencyLedger = cls
        if share is not None:
            sv._serve_one = share_floor(*share)
        t0 = time.time()
        try:
            pol = bs.SimPolicy("crisp", SharePlan(plan, trace.num_layers),
                               replace(base, name=f"resident-floor{f:g}-ahead", dominant_floor=f,
                                       dominant_widen=DominantWiden.AHEAD), ev, True, "serving")
            res = bs.simulate_decode(trace, pol, prof, shape, int(0.25 * shape.total_expert_nbytes),
                                     orders=["widest_first"], warmup=32, predicted=trace.predicted)
        finally:
            bs.serve_slots, sv._serve_one, bs.ResidencyLedger = orig_ss, orig_one, orig_led
        s = res.summary("widest_first")
        n = stats["n"]
        rec = {"label": label, "budget_fraction": 0.25, "eviction": ev, "tokens_per_s": s["tokens_per_s"],
               "x_full_lru": s["tokens_per_s"] / base_tps, "hit_rate": s["hit_rate"],
               "bytes_per_token": s["bytes_per_token"], "prefetch_bytes_per_token": s["prefetch_bytes_per_token"],
               "dom_narrower": stats["narrower"] / n, "dom_shortfall": stats["short"] / n,
               "dom_share_weighted_shortfall": stats["wshort"] / n}
        records.append(rec)
        print(f"{label:45s} {rec['tokens_per_s']:.3f} tok/s {rec['x_full_lru']:.3f}x hit {rec['hit_rate']:.3f} "
              f"narrower {rec['dom_narrower']:.3f} shortfall {rec['dom_shortfall']:.4f} "
              f"weighted {rec['dom_share_weighted_shortfall']:.4f} ({time.time() - t0:.0f} s)", flush=True)
    doc = {"format": "crisp-bench-simulate-records", "notes": [
        "2026-12-01 (session 4), shared 2-core CPU VM, docs/sim-s4-eviction-study.py: simulate_decode on " + TRACE
        + ", rtx4090-pcie4, mixtral-8x7b, 25%, warm-up 32, widest-first, global cache, serving-width prefetch with "
        "the copy window, policies resident + dominant_widen ahead; x_full_lru over full-width LRU in router "
        f"order, {base_tps:.3f} tok/s in the same run.",
        "dom_narrower: dominant slots served below the plan's width; dom_shortfall: mean (wanted - served) / "
        "wanted over dominant slots; weighted: the same times the dominant's routing-weight share.",
        "trim-first / aux-first / share floors are prototypes patched around the runtime's ledger and serving rule "
        "(not in crisp_runtime); no accuracy is decoded for them."], "records": records}
    _write(out_path, doc)


def frontier(out_path):
    """Families served at their plan's widths (outputs independent of the cache: the batch evaluation's accuracy
    holds), next-use eviction, plan-width prefetch with the window; CRISP residency-aware at floor 100% too."""
    _refuse_existing(out_path)
    trace = Trace.load(TRACE)
    plan = CrispPlan.load("models/tiny-mixtral-crisp/plan.json")
    prof, shape = get_profile("rtx4090-pcie4"), TARGETS["mixtral-8x7b"]
    base_tps = full_lru(trace, plan, prof, shape)
    e, k, inter, ids = plan.num_experts, plan.top_k, plan.intermediate_size, plan.layer_ids
    exact = SERVING_POLICIES["plan"]
    cases = [("uniform", f"w{w}", CrispPlan.uniform(e, k, inter, ids, w), exact, "plan")
             for w in (96, 128, 138, 160, 192)]
    cases += [("skip_aux", f"t{th}", CrispPlan.skip_aux(e, k, inter, ids, threshold=th, num_dominant=1), exact, "plan")
              for th in (0.3, 0.456, None)]
    cases += [("crisp", "", plan, exact, "plan"), ("crisp", "", plan, SERVING_POLICIES["resident"], "plan"),
              ("crisp", "", plan, SERVING_POLICIES["resident"], "serving")]
    records = []
    for name, variant, pl, serving, width in cases:
        pol = bs.SimPolicy(name, pl, serving, "next_use", True, width, variant=variant)
        res = bs.simulate_decode(trace, pol, prof, shape, int(0.25 * shape.total_expert_nbytes),
                                 orders=["widest_first"], warmup=32, predicted=trace.predicted)
        s = res.summary("widest_first")
        rec = {"label": pol.label, "budget_fraction": 0.25, "tokens_per_s": s["tokens_per_s"],
               "x_full_lru": s["tokens_per_s"] / base_tps, "hit_rate": s["hit_rate"],
               "bytes_per_token": s["bytes_per_token"]}
        records.append(rec)
        print(f"{pol.label:50s} {rec['tokens_per_s']:.3f} tok/s {rec['x_full_lru']:.3f}x", flush=True)
    _write(out_path, {"format": "crisp-bench-simulate-records", "notes": [
        "2026-12-01 (session 4), docs/sim-s4-eviction-study.py --frontier: simulate_decode on " + TRACE
        + ", rtx4090-pcie4, mixtral-8x7b, 25%, warm-up 32, widest-first, next-use eviction, prefetch with the "
        "copy window; x_full_lru over full-width LRU in router order, "
        f"{base_tps:.3f} tok/s in the same run."], "records": records})


def _refuse_existing(out_path):
    if Path(out_path).exists():
        sys.exit(f"error: {out_path}: exists; refusing to overwrite it")


def _write(out_path, doc):
    _refuse_existing(out_path)
    write_json(out_path, doc)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--frontier"]:
        frontier(sys.argv[2])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "docs/bench-simulate-s4-eviction-25.json")
