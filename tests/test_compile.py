"""torch.compile of a patched model (crisp_runtime.execution.resident_path, docs/clients.md).

- The all-resident step (no budget) computes the runtime's layer step on the device: its widths are
  the plan's for every policy, and its outputs equal ``CrispRuntime.forward``'s (fast, no compile).
- A patched model with every expert resident compiles with ``fullgraph=True`` (any graph break
  raises), for a first and a second input length, with the uncompiled model's logits and tokens.
- With a budget, every graph break is the one host-planned layer step per MoE layer
  (``hf._run_experts``, ``torch.compiler.disable``d), and the logits are the uncompiled ones exactly.

On the CPU the compiled model runs the kernels' torch reference inside the ``torch.ops.crisp`` custom op
(the runtime's CPU backend); on CUDA the same op runs the Triton kernels: not run here (no GPU).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from runtime_helpers import random_layers  # noqa: E402

from crisp_runtime import apply  # noqa: E402
from crisp_runtime.execution.resident_path import ResidentStep  # noqa: E402
from crisp_runtime.execution.runtime import CrispRuntime  # noqa: E402
from crisp_runtime.hf.moe_layers import find_moe_layers  # noqa: E402
from crisp_runtime.planning.plan import CrispPlan, LayerPlan, Tier, TierWidths  # noqa: E402
from crisp_runtime.planning.serving import ServingPolicy  # noqa: E402

E, K, INTER, HIDDEN = 6, 2, 16, 64
LAYER_IDS = (0, 1)


def _plans() -> dict[str, CrispPlan]:
    tiers = {(0, 1): Tier.HOT, (1, 2): Tier.WARM, (2, 3): Tier.COLD, (3, 4): Tier.WARM}
    # layer 0: pair (1, 2) names expert 2 dominant (the ranks swap when 1 is heavier); layer 1 has no pairs (unseen)
    layers = {0: LayerPlan(tiers, {(1, 2): 2}), 1: LayerPlan({}, {})}
    return {
        "full": CrispPlan.full(E, K, INTER, LAYER_IDS),
        "uniform": CrispPlan.uniform(E, K, INTER, LAYER_IDS, 5),
        "skip_aux": CrispPlan.skip_aux(E, K, INTER, LAYER_IDS),
        "skip_aux_threshold": CrispPlan.skip_aux(E, K, INTER, LAYER_IDS, threshold=0.3),
        "crisp": CrispPlan.crisp(E, K, INTER, layers, TierWidths(INTER, 8, 0), unseen_tier=Tier.WARM),
        "crisp_cold_unseen": CrispPlan.crisp(E, K, INTER, layers, TierWidths(12, 4, 0), unseen_tier=Tier.COLD),
    }


PLANS = _plans()


def _routing(num_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    weights, index = torch.randn(num_tokens, E, generator=g).softmax(-1).topk(K)
    if num_tokens > 2:  # the pairs the CRISP plans name, both orders, so tiers and the dominant swap are exercised
        index[0], index[1], index[2] = torch.tensor([1, 2]), torch.tensor([2, 1]), torch.tensor([2, 3])
    return x, index, weights


@pytest.mark.parametrize("num_tokens", [1, 9, 40])  # 40 x 2 slots: past the plan's 64-slot small-step path
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_device_token_widths_are_the_plans(plan_name, num_tokens):
    plan = PLANS[plan_name]
    _, index, weights = _routing(num_tokens, seed=num_tokens)
    index[-1, 0] = E  # a dropped-slot sentinel: width 0 in both
    for layer in LAYER_IDS:
        assert torch.equal(plan.device_token_widths(layer, index, weights), plan.token_widths(layer, index, weights))


@pytest.mark.parametrize("serving", ["plan", ServingPolicy(name="wider", hit_width="resident")], ids=["plan", "wider"])
@pytest.mark.parametrize("num_tokens", [1, 9, 40])
@pytest.mark.parametrize("plan_name", ["full", "skip_aux_threshold", "crisp", "crisp_cold_unseen"])
def test_resident_step_equals_the_runtime_step(plan_name, num_tokens, serving):
    from crisp_runtime.execution.runtime import RuntimeConfig

    runtime = CrispRuntime(random_layers(LAYER_IDS, num_experts=E, inter=INTER, hidden=HIDDEN), PLANS[plan_name],
                           device="cpu", gpu_budget=None, config=RuntimeConfig(serving=serving))
    step = ResidentStep(runtime)
    for layer in LAYER_IDS:
        x, index, weights = _routing(num_tokens, seed=10 * num_tokens + layer)
        want = runtime.forward(layer, x, index, weights)
        served = runtime.last_served[layer].widths
        assert torch.equal(step.served_widths(layer, index, weights), served)
        # Same kernels, same widths; only the float32 order differs (experts added in index order, not the
        # scheduler's; a matmul over all T rows instead of the routed ones): a few ulps of values ~0.5.
        torch.testing.assert_close(step(layer, x, index, weights), want, rtol=1e-5, atol=1e-6)


def test_resident_step_refuses_a_budget():
    runtime = CrispRuntime(random_layers(LAYER_IDS, num_experts=E, inter=INTER, hidden=HIDDEN), PLANS["full"],
                           device="cpu", gpu_budget=1 << 20)
    with pytest.raises(ValueError, match="gpu_budget=None"):
        ResidentStep(runtime)


# ---------------------------------------------------------------------- whole models under torch.compile


def _model(seed: int = 0):
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=96, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                        max_position_embeddings=64, intermediate_size=32, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # experts scaled up from std 0.02 so that they matter in the logits
        for ref in find_moe_layers(model):
            ref.module.gate_up_proj.normal_(0, 0.1)
            ref.module.down_proj.normal_(0, 0.1)
    return model


class GraphCounter:
    """A torch.compile backend that runs each graph as is and counts the graphs compiled."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


# A skewed CRISP plan for the 2-layer model (4 experts, width 32): auxiliaries narrowed or skipped.
def _crisp_plan():
    tiers = {(0, 1): Tier.HOT, (1, 2): Tier.WARM, (0, 3): Tier.COLD}
    return CrispPlan.crisp(4, 2, 32, {0: LayerPlan(tiers, {(1, 2): 2}), 1: LayerPlan({}, {})}, TierWidths(32, 8, 0))


@pytest.mark.slow
@pytest.mark.parametrize("plan", [None, "crisp"])
def test_resident_model_compiles_fullgraph(plan):
    model = _model()
    handle = apply(model, plan=None if plan is None else _crisp_plan(), cpu="off")  # the device path, resident
    inputs = [torch.randint(0, 96, (2, n), generator=torch.Generator().manual_seed(n)) for n in (7, 12)]
    with torch.no_grad():
        eager = [model(x).logits for x in inputs]
        torch._dynamo.reset()
        counter = GraphCounter()
        compiled = torch.compile(model, backend=counter, fullgraph=True)  # any graph break raises
        got = [compiled(x).logits for x in inputs]  # the second length recompiles once (dynamic shapes)
        graphs = counter.graphs
        again = [compiled(x).logits for x in inputs]  # nothing recompiles (no guard on a changing Python value)
    assert graphs <= 2 and counter.graphs == graphs
    for a, b in zip(got, again, strict=True):
        assert torch.equal(a, b)
    for want, have in zip(eager, got, strict=True):
        # float32 summation order only (see the step test): 2 layers of ~1e-7 relative, logits of magnitude ~1
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(have.argmax(-1), want.argmax(-1))
    layers = handle.stats()["layers"]
    assert all(s["steps"] == 2 and s["positions"] == 2 * (7 + 12) for s in layers.values())  # the eager ones only
    handle.restore()


@pytest.mark.slow
def test_budget_breaks_the_graph_only_at_the_host_planned_step():
    from torch._dynamo.utils import counters

    model = _model()
    expert_bytes = apply(model).layers[0].expert(0).nbytes()
    model = _model()
    # 2.5 of the 8 experts, streamed and evicted by the device path (cpu='off': a GPU's, on this CPU)
    handle = apply(model, gpu_budget=int(2.5 * expert_bytes), cpu="off")
    x = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x).logits
        torch._dynamo.reset()
        counters.clear()
        counter = GraphCounter()
        compiled = torch.compile(model, backend=counter)
        have = compiled(x).logits
        graphs = counter.graphs
        again = compiled(x).logits  # the eager step's state changed (cache, statistics): nothing recompiles
        assert counter.graphs == graphs and torch.equal(again, want)
        with pytest.raises(Exception, match="(?i)disable"):
            torch._dynamo.reset()
            torch.compile(model, backend="eager", fullgraph=True)(x)
    assert torch.equal(have, want)  # the same eager step runs in both
    reasons = list(counters["graph_break"])
    assert reasons and all("disable" in r for r in reasons), reasons
    assert handle.stats()["bytes_h2d"] > 0
    handle.restore()


@pytest.mark.slow
def test_the_cpu_default_compiles_with_its_dense_kernels_as_ops():
    """apply's default on a CPU model (every expert on the CPU kernel, attention on the 8-bit dense kernel): the
    dense layers are ``torch.ops.crisp`` ops inside the graph, the graph breaks only at the host-planned MoE step,
    and the logits are the eager ones, bitwise (the same kernels on the same inputs)."""
    from torch._dynamo.utils import counters

    from crisp_kernels import cpu_native
    from crisp_runtime.cpu.dense import Int8Linear

    if not cpu_native.available():
        pytest.skip("the native CPU kernel does not build here")
    model = _model()
    handle = apply(model, gpu_budget=None)
    assert handle.stats()["cpu"]["placement"] == "cpu_only"
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 4 * 2 + 1  # q, k, v, o of both layers; head
    x = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x).logits
        torch._dynamo.reset()
        counters.clear()
        have = torch.compile(model, backend="eager")(x).logits
    assert torch.equal(have, want)
    reasons = list(counters["graph_break"])
    assert reasons and all("disable" in r for r in reasons), reasons
    handle.restore()


@pytest.mark.slow
def test_the_docs_compile_example(monkeypatch):
    """docs/clients.md's torch.compile block, after the doc's setup block, with backend="eager" (inductor's C++
    build takes minutes on the 2-core CI machine; inductor is not exercised here)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = root / "docs" / "clients.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.S)
    example = [b for b in blocks if b.startswith("# run by tests/test_compile.py")]
    assert len(example) == 1 and example[0].count("fullgraph=True)") == 1
    monkeypatch.chdir(root)
    namespace: dict = {"__name__": "clients_doc"}
    torch._dynamo.reset()
    for block in (blocks[0], example[0].replace("fullgraph=True)", 'fullgraph=True, backend="eager")')):
        exec(compile(block, str(doc), "exec"), namespace)  # noqa: S102 - our own documentation
    # float32 summation order only: measured 1.3e-5 on logits of magnitude ~10 (4 layers)
    torch.testing.assert_close(namespace["compiled_logits"], namespace["eager_logits"], rtol=1e-5, atol=1e-4)
    assert namespace["resident_handle"].stats()["bytes_h2d"] == 0
