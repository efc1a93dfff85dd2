"""Next-layer expert prediction (crisp_runtime.scheduling.prefetch) and its record in routing traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from crisp_bench import traces as tr  # noqa: E402
from crisp_tools.serving_eval import decode_windows  # noqa: E402

from crisp_runtime import apply  # noqa: E402
from crisp_runtime.execution.runtime import RuntimeConfig  # noqa: E402
from crisp_runtime.hf.moe_layers import find_moe_layers  # noqa: E402
from crisp_runtime.planning.plan import CrispPlan  # noqa: E402
from crisp_runtime.scheduling.prefetch import (  # noqa: E402
    NextLayerPredictor,
    Prefetcher,
    PrefetchPolicy,
    find_routers,
    prediction_accuracy,
    record_predictions,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256)
    return transformers.MixtralForCausalLM(cfg).eval()


def test_routers_are_the_gates_beside_the_experts(model):
    routers = find_routers(model)
    assert sorted(routers) == [0, 1, 2]
    for layer_id, r in routers.items():
        assert r.module is model.model.layers[layer_id].mlp.gate
        assert r.name == f"model.layers.{layer_id}.mlp.gate"


@pytest.mark.parametrize("experts", [2, 3, 5])
def test_prediction_is_next_router_top_k_then_by_logit(model, experts):
    pred = NextLayerPredictor(model, experts=experts)
    h = torch.randn(11, 64, generator=torch.Generator().manual_seed(experts))
    out = pred.predict(0, h)
    assert out.shape == (11, experts)
    gate = model.model.layers[1].mlp.gate
    logits, _, index = gate(h)
    assert torch.equal(out[:, :2], index.long())
    for t in range(11):  # brute force: the remaining experts ranked by logit
        rest = [e for e in logits[t].argsort(descending=True).tolist() if e not in index[t].tolist()]
        assert out[t, 2:].tolist() == rest[: experts - 2]
        assert len(set(out[t].tolist())) == experts
    assert pred.predict(2, h) is None and pred.next_layer(2) is None
    with pytest.raises(KeyError):
        pred.next_layer(7)


def test_predictor_refuses_a_bad_count(model):
    with pytest.raises(ValueError, match="experts"):
        NextLayerPredictor(model, experts=1)
    with pytest.raises(ValueError, match="experts"):
        NextLayerPredictor(model, experts=9)


def test_accuracy_equals_set_arithmetic():
    g = np.random.default_rng(0)
    L, T, k, n = 3, 50, 2, 3
    index = np.stack([[g.choice(8, k, replace=False) for _ in range(T)] for _ in range(L)])
    predicted = np.stack([[g.choice(8, n, replace=False) for _ in range(T)] for _ in range(L)])
    predicted[-1] = -1
    predicted[0, 3] = -1  # a token without prediction counts as nothing predicted
    for use in (2, 3):
        acc = prediction_accuracy(index, predicted, [4, 5, 6], use)
        assert [(a.layer_id, a.next_layer_id) for a in acc] == [(4, 5), (5, 6)]
        for li, a in enumerate(acc):
            hits = npred = 0
            for t in range(T):
                p = {int(e) for e in predicted[li, t, :use] if e >= 0}
                hits += len(p & {int(e) for e in index[li + 1, t]})
                npred += len(p)
            assert a.hits == hits
            assert a.precision == pytest.approx(hits / npred)
            assert a.recall == pytest.approx(hits / (T * k))
    perfect = prediction_accuracy(index, np.roll(index, -1, axis=0), [0, 1, 2])
    assert all(a.precision == 1.0 and a.recall == 1.0 for a in perfect)


def test_recorded_predictions_are_the_next_router_on_the_moe_input(model):
    refs = find_moe_layers(model)
    pred = NextLayerPredictor(model, experts=3)
    inputs = {}

    def keep(layer_id):
        def hook(module, args, kwargs):
            inputs[layer_id] = kwargs.get("hidden_states", args[0] if args else None).detach().clone()
        return hook

    handles = [r.module.register_forward_pre_hook(keep(r.layer_id), with_kwargs=True) for r in refs]
    try:
        with torch.no_grad(), record_predictions(model, pred, refs) as recorded:
            model(input_ids=torch.randint(0, 256, (1, 20)), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    for layer_id in (0, 1):
        assert torch.equal(recorded[layer_id][0], pred.predict(layer_id, inputs[layer_id]))
    assert (recorded[2][0] == -1).all()


def test_trace_records_predictions_and_round_trips(model, tmp_path):
    seqs = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    trace = tr.record_trace(model, seqs)
    assert trace.predicted.shape == (3, 48, 3)
    assert trace.meta["prediction"]["experts_per_token"] == 3
    assert (trace.predicted[-1] == -1).all() and (trace.predicted[:-1] >= 0).all()
    trace.save(tmp_path / "t.npz")
    back = tr.Trace.load(tmp_path / "t.npz")
    assert np.array_equal(back.predicted, trace.predicted) and np.array_equal(back.index, trace.index)
    assert back.head(10).predicted.shape == (3, 10, 3)
    assert tr.record_trace(model, seqs, predict_extra=None).predicted is None
    with pytest.raises(tr.TraceError, match="predicted"):
        tr.Trace(trace.index, trace.weights, trace.layer_ids, trace.meta, predicted=trace.predicted[:, :5])


def test_old_trace_files_load_without_predictions():
    old = tr.Trace.load(ROOT / "bench" / "traces" / "heldout.npz")
    assert old.predicted is None and old.num_tokens == 2048


# ------------------------------------------------ wired into the runtime (apply + RuntimeConfig.prefetch)


@pytest.mark.parametrize("extra", [0, 1])
def test_prefetch_keeps_exact_outputs_and_the_budget(model, extra):

    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    with apply(model) as handle:  # the bytes of the experts, from the packed layers
        layer = next(iter(handle.layers.values()))
        expert_bytes = layer.intermediate_size * layer.fmt.neuron_nbytes(layer.hidden_size)
    budget = 5 * expert_bytes  # 5 of 24 experts: prefetches compete with demand
    with apply(model, gpu_budget=budget, serving="paper") as handle:  # the paper's configuration: no prefetch
        plain = decode_windows(model, ids)
        plain_stats = handle.stats()
    config = RuntimeConfig(prefetch=PrefetchPolicy(extra_experts=extra))
    with apply(model, gpu_budget=budget, config=config) as handle:
        fetched = decode_windows(model, ids)
        stats = handle.stats()
    assert torch.equal(fetched.nll, plain.nll)  # exact serving: a prefetch moves bytes, never changes outputs
    assert plain_stats["prefetches"] == 0
    assert stats["prefetches"] > 0 and stats["prefetch_bytes"] > 0
    assert stats["cache"]["peak_bytes"] <= budget


def test_prefetch_requests_are_the_plans_widths_of_the_predicted_routing(model):

    h = torch.randn(5, 64, generator=torch.Generator().manual_seed(9))
    plan = CrispPlan.uniform(8, 2, 32, (0, 1, 2), 12)
    with apply(model, plan=plan) as handle:
        predictor = NextLayerPredictor(model, experts=3)
        req = Prefetcher(predictor, handle.runtime, PrefetchPolicy(extra_experts=1)).requests(0, h)
    top = predictor.predict(0, h)
    assert req[0] == 1
    assert dict(req[1]) == {int(e): 12 for e in top.reshape(-1)}  # uniform plan: every slot at 12 neurons
    with pytest.raises(ValueError, match="extra_experts"):
        PrefetchPolicy(extra_experts=-1)


def test_runtime_config_refuses_a_bad_prefetch():

    with pytest.raises(TypeError, match="prefetch"):
        RuntimeConfig(prefetch="yes")
