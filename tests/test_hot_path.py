"""The runtime's hot path (per-call overhead and the planner's time per step): a decode step planned on Python
lists and run with buffers kept across steps gives exactly what the tensor rules and fresh buffers give.

- the plan's per-token rules on lists equal its vectorized rules (an independent implementation);
- a step planned on lists (``serving.plan_served_step``) equals the same step composed from the
  tensor APIs (``token_widths_and_roles`` -> ``serve_slots`` -> ``plan_step`` on tensors);
- the executor's decode inputs (a shared row index, views of a kept weights buffer, no per-token
  widths) give bit-identical kernel outputs to the general inputs;
- outputs returned to the caller are never overwritten by a later step, and a kept accumulator
  starts every step at zero (outputs bit-identical to a fresh runtime per step).
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import random_layers

from crisp_kernels import Backend, QuantFormat, pack_layer
from crisp_kernels._triton import interpreter_enabled
from crisp_kernels.expert_mlp import expert_mlp_accumulate_unchecked_, experts_mlp_accumulate_unchecked_
from crisp_runtime import CrispPlan, RuntimeConfig, Tier, TierWidths
from crisp_runtime.execution.runtime import CrispRuntime
from crisp_runtime.planning.plan import LayerPlan
from crisp_runtime.planning.serving import SERVING_POLICIES, plan_served_step, serve_slots
from crisp_runtime.residency.device_cache import PrefixCache
from crisp_runtime.residency.host_store import HostStore
from crisp_runtime.residency.ledger import Decision, ResidencyLedger
from crisp_runtime.scheduling.scheduler import TaskOrder, plan_step

E, INTER, HIDDEN = 8, 16, 64


def _plans(k: int) -> dict[str, CrispPlan]:
    g = torch.Generator().manual_seed(7)
    tiers, dominant = {}, {}
    for a in range(E):
        for b in range(a + 1, E):
            if torch.rand(1, generator=g) < 0.8:  # some pairs unseen
                tiers[(a, b)] = list(Tier)[int(torch.randint(0, 3, (1,), generator=g))]
                if torch.rand(1, generator=g) < 0.7:  # some without a fixed dominant
                    dominant[(a, b)] = a if torch.rand(1, generator=g) < 0.5 else b
    layers = {0: LayerPlan(tiers, dominant)}
    out = {
        "full": CrispPlan.full(E, k, INTER, [0]),
        "uniform": CrispPlan.uniform(E, k, INTER, [0], INTER // 2),
        "skip_aux": CrispPlan.skip_aux(E, k, INTER, [0]),
        "skip_aux_thr": CrispPlan.skip_aux(E, k, INTER, [0], threshold=0.3),
        "crisp": CrispPlan.crisp(E, k, INTER, layers, TierWidths(INTER, INTER // 2, 0)),
    }
    if k >= 2:
        out["crisp_dom2"] = CrispPlan.crisp(E, k, INTER, layers, TierWidths(INTER, 4, 2), num_dominant=2,
                                            unseen_tier=Tier.COLD)
    # heavy auxiliaries at the dominant width, under a cap (what AuxNarrower.NARROW_ONLY keeps is the cap)
    out["crisp_aux_cap"] = CrispPlan.crisp(E, k, INTER, layers, TierWidths(INTER, INTER // 2, 3), width_cap=12,
                                           aux_full_weight=0.2)
    return out


def _routing(tokens: int, k: int, case: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    weights, index = torch.softmax(torch.randn(tokens, E, generator=g), -1).topk(k, -1)
    if case == "invalid":  # padding sentinels get width 0
        index[0, -1] = -1
        index[-1, 0] = E
    elif case == "duplicate" and k > 1:  # an expert twice in a token, equal weights
        index[:, 1] = index[:, 0]
        weights[:, 1] = weights[:, 0]
    elif case == "ties" and k > 1:
        weights[:] = 0.5
    return index, weights


CASES = ("plain", "invalid", "duplicate", "ties")
DTYPES = ((torch.int64, torch.float32), (torch.int32, torch.bfloat16), (torch.int16, torch.float16),
          (torch.int64, torch.float64), (torch.float32, torch.float32))  # float ids: converted, as the tensor rules do


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("index_dtype", "weight_dtype"), DTYPES)
def test_list_rules_equal_the_vectorized_rules(k, tokens, case, index_dtype, weight_dtype):
    index, weights = _routing(tokens, k, case, seed=tokens * 10 + k)
    index, weights = index.to(index_dtype), weights.to(weight_dtype)
    for name, plan in _plans(k).items():
        experts, wanted, dominant = plan.widths_and_roles_lists(0, index, weights, roles=True)
        ref_w, ref_d = plan._token_widths_tensor(0, index.to(torch.int64), weights.to(torch.float32), roles=True)
        assert experts == index.to(torch.int64).reshape(-1).tolist(), name
        assert all(type(e) is int for e in experts), name
        assert wanted == ref_w.reshape(-1).tolist(), name
        assert dominant == ref_d.reshape(-1).tolist(), name
        assert all(type(v) is int for v in wanted) and all(type(v) is bool for v in dominant), name
        _, wanted_only, none = plan.widths_and_roles_lists(0, index, weights, roles=False)
        assert wanted_only == wanted and none is None, name


@pytest.mark.parametrize("serving", ["plan", "resident", "resident-floor75", "resident-floor75-widen", "hybrid",
                                     "hybrid_split", "resident-narrow-aux"])
@pytest.mark.parametrize("order", list(TaskOrder))
@pytest.mark.parametrize(("tokens", "k"), [(1, 2), (1, 4), (3, 2), (8, 8)])
@pytest.mark.parametrize("case", CASES)
def test_step_planned_on_lists_equals_the_tensor_composition(serving, order, tokens, k, case):
    from crisp_runtime.scheduling.scheduler import CostModel

    policy = SERVING_POLICIES[serving]
    cost = CostModel(cpu_bytes_per_s=60e9, cpu_latency_s=2e-6, h2d_bytes_per_s_cpu_busy=15e9, join_s=5e-6)
    resident = {e: (0, INTER, INTER // 2, 3, 0, INTER)[e % 6] for e in range(E)}
    index, weights = _routing(tokens, k, case, seed=100 + tokens * 10 + k)
    for name, plan in _plans(k).items():
        served, step = plan_served_step(policy, plan, 0, index, weights, num_experts=E, neuron_nbytes=40,
                                        resident_width=resident.get, cost=cost, order=order)
        wanted, dominant = plan._token_widths_tensor(0, index, weights, roles=not policy.follows_plan)
        ref = serve_slots(policy, index, wanted, dominant, num_experts=E, full_width=INTER,
                          resident_width=resident.get, whole_width=plan.dominant_width)
        ref_step = plan_step(index, ref.widths, num_experts=E, neuron_nbytes=40, resident_width=resident.get,
                             cost=cost, order=order, placement=policy.placement)
        assert torch.equal(served.widths, ref.widths) and served.widths.shape == (tokens, k), name
        assert torch.equal(served.wanted, wanted), name
        assert (served.dominant is None) == (ref.dominant is None), name
        if ref.dominant is not None:
            assert torch.equal(served.dominant, ref.dominant) and served.dominant.dtype == torch.bool, name
        assert served[3:] == ref[3:], name  # the counters
        assert step.tasks == ref_step.tasks, name
        assert torch.equal(step.flat_pos, ref_step.flat_pos) and torch.equal(step.flat_widths, ref_step.flat_widths)
        assert step.pos_list == ref_step.flat_pos.tolist() and step.widths_list == ref_step.flat_widths.tolist()
        assert step[3:] == ref_step[3:], name  # tokens, k, bytes, skipped, extra


def _biased_layer(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return pack_layer(torch.randn(E, 2 * INTER, HIDDEN, generator=g) * 0.1,
                      torch.randn(E, HIDDEN, INTER, generator=g) * 0.1, QuantFormat(group_size=64),
                      gate_up_bias=torch.randn(E, 2 * INTER, generator=g) * 0.1,
                      down_bias=torch.randn(E, HIDDEN, generator=g) * 0.1)


# The Triton interpreter (~4 s a case) on one serving policy; the torch reference on both.
KERNEL_CASES = [(Backend.TORCH, bias, serving) for bias in (False, True) for serving in ("plan", "resident-floor75")]
if interpreter_enabled():
    KERNEL_CASES += [(Backend.TRITON_INTERPRET, bias, "resident-floor75") for bias in (False, True)]


@pytest.mark.parametrize(("backend", "bias", "serving"), KERNEL_CASES)
def test_decode_inputs_give_the_general_inputs_kernel_output(backend, bias, serving):
    layers = {0: _biased_layer()} if bias else random_layers(layer_ids=(0,), num_experts=E, inter=INTER,
                                                              hidden=HIDDEN)
    plan = _plans(4)["crisp"]
    rt = CrispRuntime(layers, plan, device="cpu", gpu_budget=3 * INTER * layers[0].neuron_nbytes,
                      config=RuntimeConfig(serving=serving))
    g = torch.Generator().manual_seed(1)
    for step_no in range(12):
        index, weights = _routing(1, 4, CASES[step_no % 4], seed=step_no)
        x = torch.randn(1, HIDDEN, generator=g)
        rt.forward(0, x, index, weights)  # makes the step's prefixes resident
        step = rt.last_step[0]
        if not step.tasks:
            continue
        fast = rt._task_inputs(step, step.tasks, weights, gpu_placement=True)
        general = rt._task_inputs(step, step.tasks, weights, gpu_placement=False)
        one_slot_each = step.tasks[-1].stop == len(step.tasks)
        assert (fast[2][0] is None) == one_slot_each  # the decode inputs are taken exactly then
        outs = []
        for rows_s, weights_s, widths_s in (fast, general):
            out = torch.zeros(1, HIDDEN)
            for i, task in enumerate(step.tasks):
                got = rt.cache.acquire(0, task.expert, task.width)
                expert_mlp_accumulate_unchecked_(out, x, got.resident, task.width, rows_s[i], weights_s[i],
                                                 widths_s[i], backend)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), step_no


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("serving", ["plan", "resident-floor75"])
def test_outputs_are_never_overwritten_and_buffers_start_at_zero(dtype, serving):
    layers = random_layers(layer_ids=(0, 1), num_experts=E, inter=INTER, hidden=HIDDEN)
    plan = _plans(2)["crisp"]
    plan = CrispPlan.crisp(E, 2, INTER, {0: plan.layers[0], 1: plan.layers[0]}, plan.tier_widths)
    config = RuntimeConfig(serving=serving, order=TaskOrder.ROUTER)  # the order, so the sums, cache-independent
    budget = 3 * INTER * layers[0].neuron_nbytes
    rt = CrispRuntime(layers, plan, device="cpu", gpu_budget=budget, config=config)
    g = torch.Generator().manual_seed(2)
    kept = []
    for step_no in range(14):
        tokens = (1, 1, 1, 4, 1, 2, 70)[step_no % 7]  # decode, batches and one beyond the kept accumulator
        layer_id = step_no % 2
        x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
        weights, index = torch.softmax(torch.randn(tokens, E, generator=g), -1).topk(2, -1)
        out = rt.forward(layer_id, x, index, weights)
        # A fresh runtime whose cache holds what this step's widths need: no buffer carried over.
        fresh = CrispRuntime(layers, plan, device="cpu", gpu_budget=None, config=config)
        if serving == "plan":
            expected = fresh.forward(layer_id, x, index, weights)
            assert torch.equal(out, expected), step_no
        assert out.dtype == dtype and out.shape == x.shape
        for old, copy in kept:
            assert torch.equal(old, copy)  # earlier outputs untouched
            assert old.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
        kept.append((out, out.clone()))
    assert rt.stats.layers[0].expert_runs > 0


# ----------------------------------------------------------------- hits and grouped kernel calls

GROUP_BACKENDS = [Backend.TORCH] + ([Backend.TRITON_INTERPRET] if interpreter_enabled() else [])


@pytest.mark.parametrize("backend", GROUP_BACKENDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 5])
def test_grouped_kernel_entry_equals_the_calls_one_by_one(backend, bias, tokens):
    layer = _biased_layer() if bias else random_layers(layer_ids=(0,), num_experts=E, inter=INTER,
                                                        hidden=HIDDEN)[0]
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g)
    experts = [layer.expert(e) for e in (3, 0, 5, 1)]
    widths = [INTER, 5, 1, INTER // 2]
    rows, weights, token_widths = [], [], []
    for i in range(len(experts)):
        n = 1 if tokens == 1 else 2 + i % 3  # a token may repeat (rows index x and out alike)
        rows.append(torch.randint(0, tokens, (n,), generator=g))
        weights.append(torch.rand(n, generator=g))
        token_widths.append(None if i % 2 else torch.randint(0, INTER + 3, (n,), generator=g))  # clamped
    start = torch.randn(tokens, HIDDEN, generator=g)  # accumulated into, not overwritten
    one_by_one = start.clone()
    for args in zip(experts, widths, rows, weights, token_widths, strict=True):
        expert_mlp_accumulate_unchecked_(one_by_one, x, *args, backend)
    grouped = start.clone()
    experts_mlp_accumulate_unchecked_(grouped, x, experts, widths, rows, weights, token_widths, backend)
    assert torch.equal(grouped, one_by_one)
    assert not torch.equal(grouped, start)


def test_a_hit_decision_is_a_value_and_a_hit_never_returns_dropped_buffers():
    layers = random_layers(layer_ids=(0,), num_experts=E, inter=INTER, hidden=HIDDEN)
    nb = layers[0].neuron_nbytes
    ledger = ResidencyLedger(4 * INTER * nb, {0: nb}, {0: INTER})
    assert ledger.request(0, 1, INTER // 2).kind == "miss"
    for width in (INTER // 2, 3, INTER // 2, 3):  # reused or rebuilt: always the value a new one has
        assert ledger.request(0, 1, width) == Decision((0, 1), "hit", width, INTER // 2, INTER // 2, 0)
    assert ledger.request(0, 1, INTER).kind == "widen"
    assert ledger.request(0, 1, 3) == Decision((0, 1), "hit", 3, INTER, INTER, 0)  # the old width: not reused
    assert ledger.prefetch(0, 2, 4) is not None
    assert ledger.request(0, 2, 4).from_prefetch and not ledger.request(0, 2, 4).from_prefetch
    with pytest.raises(ValueError, match="width 0"):
        ledger.request(0, 1, 0)  # a hit is checked first, an invalid width still refused
    assert ledger.counters.hits == 7 and ledger.counters.prefetch_hits == 1

    cache = PrefixCache(HostStore(layers), 2 * INTER * nb, "cpu")
    cache.acquire(0, 1, INTER)
    first = cache.acquire(0, 1, INTER)
    assert first.kind == "hit" and cache.acquire(0, 1, INTER) is first  # reused while the buffers stay
    narrower = cache.acquire(0, 1, 3)  # another width on the same buffers: its own width and decision
    assert narrower.width == 3 and narrower.decision.width == 3 and narrower.resident is first.resident
    assert cache.acquire(0, 1, INTER).width == INTER
    cache.evict((0, 1))
    cache.acquire(0, 1, INTER)  # the same width again: new buffers
    again = cache.acquire(0, 1, INTER)
    assert again.decision == first.decision and again.resident is not first.resident
    assert again.resident is cache.acquire_resident(0, [1], [INTER])[0][0]


def test_acquire_resident_refuses_a_missing_prefix_and_keeps_the_cache_consistent():
    layers = random_layers(layer_ids=(0,), num_experts=E, inter=INTER, hidden=HIDDEN)
    cache = PrefixCache(HostStore(layers), 3 * INTER * layers[0].neuron_nbytes, "cpu")
    cache.acquire(0, 2, INTER)
    got, from_prefetch = cache.acquire_resident(0, [2, 2], [INTER, 4])
    assert got[0] is got[1] and got[0].width == INTER and from_prefetch == 0
    with pytest.raises(RuntimeError, match="expert 5 of layer 0 was not resident at width 4"):
        cache.acquire_resident(0, [2, 5], [INTER, 4])
    assert cache.resident() == {(0, 2): INTER, (0, 5): 4}  # the ledger's miss was applied: buffers follow
    assert cache.acquire(0, 5, 4).kind == "hit" and cache.acquire(0, 5, 4).resident.width == 4


def _serving_cases():
    from crisp_runtime.scheduling.scheduler import CostModel

    cpu = CostModel(cpu_bytes_per_s=60e9, cpu_latency_s=2e-6, h2d_bytes_per_s_cpu_busy=15e9, join_s=5e-6)
    return [("plan", None, CostModel()), ("resident-floor75", None, CostModel()),
            ("plan", "none-budget", CostModel()), ("hybrid_split_transient", None, cpu), ("hybrid", None, cpu)]


@pytest.mark.parametrize(("serving", "variant", "cost"), _serving_cases())
def test_steps_that_copy_nothing_run_as_the_general_loop_runs_them(monkeypatch, serving, variant, cost):
    """The executor's path for a step that copies nothing (one ``acquire_resident``, one grouped kernel entry)
    against its general loop (taken with ``record_timings``): the same outputs bit for bit, the same
    statistics and the same ledger requests in the same order, prefetch hits included."""
    from crisp_runtime.cpu.experts import EXACT

    log: dict[int, list] = {}
    for name in ("request", "request_transient"):
        original = getattr(ResidencyLedger, name)

        def logged(self, layer_id, expert, width, *args, _original=original, _name=name, **kw):
            d = _original(self, layer_id, expert, width, *args, **kw)
            log.setdefault(id(self), []).append((_name, layer_id, expert, width, d))
            return d

        monkeypatch.setattr(ResidencyLedger, name, logged)
    ran = {"resident": 0}
    resident_path = CrispRuntime._run_resident

    def counting_resident(self, *a, **kw):
        ran["resident"] += 1
        return resident_path(self, *a, **kw)

    monkeypatch.setattr(CrispRuntime, "_run_resident", counting_resident)
    layers = random_layers(layer_ids=(0, 1), num_experts=E, inter=INTER, hidden=HIDDEN)
    plan = _plans(4)["crisp"]  # 4 experts a token: their order changes the sums (two would commute)
    plan = CrispPlan.crisp(E, 4, INTER, {0: plan.layers[0], 1: plan.layers[0]}, plan.tier_widths)
    budget = None if variant == "none-budget" else 7 * INTER * layers[0].neuron_nbytes
    runtimes = [CrispRuntime(layers, plan, device="cpu", gpu_budget=budget,
                             config=RuntimeConfig(serving=serving, cost=cost, cpu_experts=EXACT, record_timings=t))
                for t in (False, True)]
    g = torch.Generator().manual_seed(4)
    prefetched = None
    try:
        for step_no in range(40):
            layer_id = step_no % 2
            hot = (step_no // 8) % 3  # the same pair for a few steps: steps that copy nothing
            other = prefetched if prefetched is not None else hot + 4 if step_no % 8 < 6 else 7
            index = torch.tensor([[hot, hot + 3, hot + 1, other]])
            weights = torch.softmax(torch.randn(1, 4, generator=g), -1)
            x = torch.randn(1, HIDDEN, generator=g)
            outs = [rt.forward(layer_id, x, index, weights) for rt in runtimes]
            assert torch.equal(outs[0], outs[1]), step_no
            prefetched = None
            if step_no % 8 == 4:  # the next step (the other layer) runs what this one prefetches: a prefetch hit
                prefetched = 6
                for rt in runtimes:
                    rt.prefetch(1 - layer_id, [(prefetched, INTER)])
    finally:
        for rt in runtimes:
            rt.close()
    stats = [rt.stats.as_dict() for rt in runtimes]
    for s in stats:
        s.pop("copy_ms")
        for layer in s["layers"].values():
            layer.pop("copy_ms")
    assert stats[0] == stats[1]
    assert stats[0]["expert_runs"] > 0
    if budget is not None:
        logs = [log[id(rt.cache.ledger)] for rt in runtimes]
        assert logs[0] == logs[1]
        kinds = {d.kind for *_, d in logs[0]}
        assert "hit" in kinds and "miss" in kinds
        assert stats[0]["prefetch_hits"] > 0
    assert ran["resident"] > 0  # the path under test ran, and with a budget so did the loop (steps that copied)
    assert budget is None or stats[0]["misses"] > 0


@pytest.mark.parametrize(("case", "error", "match"), [
    ("layer", KeyError, "no layer 5"),
    ("list", ValueError, r"must be \(T, H=64\), got list"),
    ("3d", ValueError, r"must be \(T, H=64\), got \(1, 1, 64\)"),
    ("hidden", ValueError, r"must be \(T, H=64\), got \(1, 32\)"),
    ("int", ValueError, "fp16, bf16 or fp32"),
    ("index_1d", ValueError, r"must both be \(T=1, k\), got \(2,\) and \(1, 2\)"),
    ("mismatch", ValueError, r"must both be \(T=1, k\), got \(1, 2\) and \(1, 3\)"),
    ("tokens", ValueError, r"must both be \(T=1, k\), got \(2, 2\) and \(2, 2\)"),
])
def test_the_step_boundary_refuses_bad_inputs(case, error, match):
    layers = random_layers(layer_ids=(0,), num_experts=E, inter=INTER, hidden=HIDDEN)
    rt = CrispRuntime(layers, CrispPlan.full(E, 2, INTER, [0]), device="cpu", gpu_budget=None)
    x, index, weights = torch.randn(1, HIDDEN), torch.tensor([[0, 1]]), torch.tensor([[0.6, 0.4]])
    layer_id = 5 if case == "layer" else 0
    x = {"list": [[0.0] * HIDDEN], "3d": x[None], "hidden": x[:, :32], "int": x.long()}.get(case, x)
    index = {"index_1d": index[0], "tokens": index.repeat(2, 1)}.get(case, index)
    weights = {"mismatch": torch.rand(1, 3), "tokens": weights.repeat(2, 1)}.get(case, weights)
    with pytest.raises(error, match=match):
        rt.forward(layer_id, x, index, weights)


def _policy(name: str):
    from crisp_runtime.residency.eviction import POLICIES, PinnedPolicy
    if name.endswith("+pinned"):
        return PinnedPolicy(POLICIES[name.split("+")[0]](), [(0, 1), (1, 3)])
    return POLICIES[name]()


@pytest.mark.parametrize("name", ["lru", "frequency", "tier", "next_use", "lru+pinned", "frequency+pinned"])
def test_the_ledgers_use_hook_orders_keys_as_on_use(name):
    """``use_hook()`` (the ledger's hit call) leaves the policy in the state ``on_use`` leaves it in: the same
    victim after every event of a random insert/use/remove stream, with and without protected keys."""
    g = torch.Generator().manual_seed(11)
    by_hook, by_method = _policy(name), _policy(name)
    hook = by_hook.use_hook()
    resident: list[tuple[int, int]] = []
    for _ in range(400):
        key = (int(torch.randint(0, 2, (1,), generator=g)), int(torch.randint(0, 6, (1,), generator=g)))
        op = int(torch.randint(0, 4, (1,), generator=g))
        if key not in resident:
            by_hook.on_insert(key), by_method.on_insert(key)
            resident.append(key)
        elif op == 0:
            by_hook.on_remove(key), by_method.on_remove(key)
            resident.remove(key)
        else:
            hook(key)
            by_method.on_use(key)
        for protected in (set(), {key}, set(resident[:2])):
            assert by_hook.victim(protected) == by_method.victim(protected)


def test_use_hook_bypasses_only_the_base_on_use():
    from crisp_runtime.residency.eviction import FrequencyPolicy, LRUPolicy, PinnedPolicy
    lru = LRUPolicy()
    assert lru.use_hook() == lru._recency.move_to_end  # no Python frame per hit
    assert PinnedPolicy(lru, []).use_hook() == lru._recency.move_to_end
    freq = FrequencyPolicy()
    assert freq.use_hook() == freq.on_use
    uses = []
    patched = LRUPolicy()
    patched.on_use = uses.append  # an instance override is what the hook calls
    patched.use_hook()((0, 0))
    assert uses == [(0, 0)]

    class Counting(LRUPolicy):
        def on_use(self, key):
            uses.append(key)
            super().on_use(key)

    counting = Counting()
    counting.on_insert((0, 1))
    counting.use_hook()((0, 1))
    assert uses == [(0, 0), (0, 1)]


def test_the_ledgers_layer_width_reads_the_ledger_live():
    ledger = ResidencyLedger(256, {0: 4, 1: 4}, {0: INTER, 1: INTER})  # 4 full prefixes: evictions happen
    widths = {layer: ledger.layer_width(layer) for layer in (0, 1)}
    g = torch.Generator().manual_seed(5)
    for _ in range(60):
        layer, e = int(torch.randint(0, 2, (1,), generator=g)), int(torch.randint(0, E, (1,), generator=g))
        ledger.request(layer, e, int(torch.randint(1, INTER + 1, (1,), generator=g)))
        for lay in (0, 1):
            assert [widths[lay](x) for x in range(E)] == [ledger.width(lay, x) for x in range(E)]
