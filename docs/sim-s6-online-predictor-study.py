"""Session 6 (issue 10) simulation study: can an online predictor close next-use eviction's gap to Belady?

A study script, not project code: prototypes patched around the runtime's ledger and eviction policy, on the
session-4 configuration (docs/residency-and-serving.md): simulate_decode on docs/bench-trace-heldout-predicted.npz,
rtx4090-pcie4, Mixtral-8x7B sizes, 25%, resident serving with dominant floor 87.5% + `ahead`, serving-width
prefetch with the copy window, widest-first, warm-up 32. "x" divides by 2.81 tok/s, full-width LRU on the same
trace (README table). Cases:
- next_use: the runtime's NextUsePolicy (decay 0.5).
- markov*: p = P(used at the layer's next visit | used at its last two visits), learned online from counts per
  (layer, pattern) ("markov-layer") or per (key, pattern) smoothed toward the layer's table with strength a;
  expected layer steps to the next use from the resulting 2-state chain.
- bypass*: admission by predicted next use: a demanded prefix whose next use (after this one) is predicted
  further than margin x the victim's goes to a one-expert transient buffer (taken out of the budget).
Run: OMP_NUM_THREADS=1 PYTHONPATH=. python docs/sim-s6-online-predictor-study.py   (~20 s per case)
"""
import time
from dataclasses import replace

import crisp_bench.simulate as bs
import torch
from crisp_bench.profiles import get_profile
from crisp_bench.shapes import TARGETS
from crisp_bench.traces import Trace

from crisp_runtime.planning.plan import CrispPlan
from crisp_runtime.planning.serving import SERVING_POLICIES, DominantWiden
from crisp_runtime.residency.eviction import NextUsePolicy
from crisp_runtime.residency.ledger import TRANSIENT, Decision, ResidencyLedger

torch.set_num_threads(1)

class MarkovNextUse(NextUsePolicy):
    """p from an online table per key and 2-visit history pattern, smoothed toward the layer's table."""
    name = "markov"
    def __init__(self, prior_strength=4.0, per_key=True):
        super().__init__()
        self.a = prior_strength
        self.per_key = per_key
        self.uses = {}      # key -> (last use visit, previous use visit)
        self.used_at = {}   # layer -> set of experts used at the layer's current visit
        self.experts = {}   # layer -> experts seen
        self.kc = {}        # (key, pattern) -> [used, n]
        self.lc = {}        # (layer, pattern) -> [used, n]
    def _pattern(self, key, visit):
        a, b = self.uses.get(key, (-9, -9))
        h1 = a == visit
        h2 = a == visit - 1 or b == visit - 1
        return (h1, h2)
    def on_use(self, key):
        layer = key[0]
        if layer != self._last_layer:
            # finalize the previous visit of this layer: outcome at visit V for pattern at V-1
            V = self.visits.get(layer, 0)
            if V >= 1:
                used = self.used_at.get(layer, set())
                for e in self.experts.get(layer, ()):
                    k = (layer, e)
                    pat = self._pattern_at(k, V - 1)
                    out = e in used
                    for tab, kk in ((self.kc, (k, pat)), (self.lc, (layer, pat))):
                        c = tab.setdefault(kk, [0, 0])
                        c[0] += out
                        c[1] += 1
            self.used_at[layer] = set()
        EvictionPolicyOnUse(self, key)
        self.experts.setdefault(layer, set()).add(key[1])
        V = self.visits[layer]
        self.used_at[layer].add(key[1])
        a, b, c = self.uses.get(key, (-9, -9, -9))
        if a != V:
            self.uses[key] = (V, a, b)
    def _pattern_at(self, key, visit):
        hist = [u for u in self.uses.get(key, ()) if u <= visit]
        h1 = visit in hist
        h2 = (visit - 1) in hist
        return (h1, h2)
    def p(self, key, pat):
        lu, ln = self.lc.get((key[0], pat), [0, 0])
        pl = (lu + 1) / (ln + 4)
        if not self.per_key:
            return pl
        ku, kn = self.kc.get((key, pat), [0, 0])
        return (ku + self.a * pl) / (kn + self.a)
    def expected_visits(self, key):
        V = self.visits.get(key[0], 0)
        pat = self._pattern_at(key, V)
        p00 = max(self.p(key, (False, False)), 1e-6)
        x00 = 1 / p00
        x01 = 1 + (1 - self.p(key, (False, True))) * x00
        if pat == (False, False):
            return x00
        if pat == (False, True):
            return x01
        return 1 + (1 - self.p(key, pat)) * x01
    def victim(self, protected):
        current = self._current_layer(protected)
        n = max(1, len(self._layers))
        best, best_steps = None, -1.0
        for key in self._recency:
            if key in protected:
                continue
            d = n if current is None else self._distance(current, key[0])
            steps = d + n * (self.expected_visits(key) - 1)
            if steps > best_steps:
                best, best_steps = key, steps
        return best

def EvictionPolicyOnUse(self, key):
    NextUsePolicy.on_use(self, key)

def run(label, factory, floor=0.875):
    trace = Trace.load("docs/bench-trace-heldout-predicted.npz")
    plan = CrispPlan.load("models/tiny-mixtral-crisp/plan.json")
    prof, shape = get_profile("rtx4090-pcie4"), TARGETS["mixtral-8x7b"]
    orig = bs.make_policy
    bs.make_policy = lambda spec, plan=None: factory() if spec == "next_use" else orig(spec, plan)
    try:
        pol = bs.SimPolicy("crisp", plan, replace(SERVING_POLICIES["resident"], name=f"resident-floor{floor:g}-ahead",
                           dominant_floor=floor, dominant_widen=DominantWiden.AHEAD), "next_use", True, "serving")
        t0 = time.time()
        res = bs.simulate_decode(trace, pol, prof, shape, int(0.25 * shape.total_expert_nbytes),
                                 orders=["widest_first"], warmup=32, predicted=trace.predicted)
    finally:
        bs.make_policy = orig
    s = res.summary("widest_first")
    print(f"{label:34s} {s['tokens_per_s']:.3f} tok/s  x {s['tokens_per_s'] / 2.81:.3f}  hit {s['hit_rate']:.3f} "
          f"({time.time() - t0:.0f} s)", flush=True)


class BypassLedger(ResidencyLedger):
    """Admission by predicted next use: a demanded prefix whose next use (after this one) is predicted further
    than the policy's victim's is copied into a one-expert transient buffer instead of being admitted."""
    margin = 1.0
    def request(self, layer_id, expert, width, *, protected=(), weak_protected=()):
        key = (layer_id, expert)
        old = self._widths.get(key, 0)
        extra = self._nb[layer_id] * (width - old) if width > old else 0
        if old >= width or self.used + extra <= self.budget:
            return super().request(layer_id, expert, width, protected=protected, weak_protected=weak_protected)
        pol = self.policy
        strong = set(protected)
        strong.add(key)
        v = pol.victim(strong)
        if v is None:
            return super().request(layer_id, expert, width, protected=protected, weak_protected=weak_protected)
        n = max(1, len(pol._layers))
        p = pol.probability(key)
        p_after = pol._keep * p + pol.decay
        s_new = n / p_after
        s_v = pol.expected_steps(v, layer_id)
        if s_new <= self.margin * s_v:
            return super().request(layer_id, expert, width, protected=protected, weak_protected=weak_protected)
        # bypass: the rows go to the transient buffer; the use is recorded
        if old:
            pol.on_use(key)
        else:
            pol.on_insert(key)
            pol.on_use(key)
            pol.on_remove(key)
        self._prefetched.discard(key)
        c = self.counters
        c.transients += 1
        c.transient_bytes += extra
        c.bytes_copied += extra
        return Decision(key, TRANSIENT, width, old, old, extra)

def run_bypass(label, margin=1.0, floor=0.875, buffer_experts=1):
    trace = Trace.load("docs/bench-trace-heldout-predicted.npz")
    plan = CrispPlan.load("models/tiny-mixtral-crisp/plan.json")
    prof, shape = get_profile("rtx4090-pcie4"), TARGETS["mixtral-8x7b"]
    orig = bs.ResidencyLedger
    BypassLedger.margin = margin
    bs.ResidencyLedger = BypassLedger
    try:
        pol = bs.SimPolicy("crisp", plan, replace(SERVING_POLICIES["resident"], name=f"resident-floor{floor:g}-ahead",
                           dominant_floor=floor, dominant_widen=DominantWiden.AHEAD), "next_use", True, "serving")
        budget = int(0.25 * shape.total_expert_nbytes) - buffer_experts * shape.expert_nbytes
        t0 = time.time()
        res = bs.simulate_decode(trace, pol, prof, shape, budget, orders=["widest_first"], warmup=32,
                                 predicted=trace.predicted)
    finally:
        bs.ResidencyLedger = orig
    s = res.summary("widest_first")
    print(f"{label:34s} {s['tokens_per_s']:.3f} tok/s  x {s['tokens_per_s'] / 2.81:.3f}  hit {s['hit_rate']:.3f} "
          f"transient/token {s.get('transient_bytes_per_token', 0)/1e6:.0f} MB ({time.time()-t0:.0f}s)", flush=True)


def main():
    for name, factory in (("next_use", NextUsePolicy), ("markov-layer", lambda:
        MarkovNextUse(per_key=False)),
                          ("markov a=1", lambda: MarkovNextUse(1.0)), ("markov a=4", MarkovNextUse),
                          ("markov a=16", lambda: MarkovNextUse(16.0))):
        run(name, factory)
    for margin in (0.7, 1.0, 1.5):
        run_bypass(f"next_use + bypass margin {margin:g}", margin)


if __name__ == "__main__":
    main()
