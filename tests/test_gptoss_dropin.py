"""gpt-oss through the transformers drop-in, on tiny from_config models, with the v5 families' tests:
logits against the eager model with the dequantized 4-bit weights (rel. err <= 1e-5 in fp32), restore
bit for bit, a budgeted (offloaded) run equal to the unbudgeted one, and a pack folder round trip.

gpt-oss's experts differ from the v5 families in layout (``gate_up_proj (E, H, 2I)`` transposed with gate
and up interleaved, ``down_proj (E, I, H)``), biases and activation (clamped SwiGLU); one model lowers
``swiglu_limit`` to 1.0 so that the clamps are active in the logits (the module's own alpha / limit
travel into the pack, not crisp's defaults).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from crisp_kernels import dequantize_layer, layer_biases  # noqa: E402
from crisp_runtime import PackMismatchError, UnsupportedModelError, apply, pack_model, save_pack  # noqa: E402
from crisp_runtime.execution.runtime import min_budget_bytes  # noqa: E402
from crisp_runtime.hf.moe_layers import ExpertsLayout, find_moe_layers  # noqa: E402
from crisp_runtime.storage.pack import model_info  # noqa: E402

TOKENS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))


def make_model(seed=0, swiglu_limit=7.0, expert_std=0.1):
    from transformers import AutoModelForCausalLM, GptOssConfig

    cfg = GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                       layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                       swiglu_limit=swiglu_limit, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    # Experts scaled up (and biases non-zero: from_config zeroes them) so that they dominate the logits and any
    # error in the experts path, biases included, shows in the tight comparison.
    with torch.no_grad():
        for ref in find_moe_layers(model):
            m = ref.module
            for p in (m.gate_up_proj, m.down_proj, m.gate_up_proj_bias, m.down_proj_bias):
                p.normal_(0, expert_std)
    return model


def logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


def dequantized_copy(model, layers):
    """The eager model with its expert weights replaced by the dequantized 4-bit weights, written back in
    gpt-oss's own layout (interleaved, transposed); the biases are stored exactly (float32)."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for ref in find_moe_layers(twin):
            layer = layers[ref.layer_id]
            inter = layer.intermediate_size
            gate_up, down = dequantize_layer(layer)  # (E, 2I, H), (E, H, I)
            gate_up_bias, down_bias = layer_biases(layer)
            m = ref.module
            m.gate_up_proj[..., 0::2] = gate_up[:, :inter].mT
            m.gate_up_proj[..., 1::2] = gate_up[:, inter:].mT
            m.gate_up_proj_bias[:, 0::2] = gate_up_bias[:, :inter]
            m.gate_up_proj_bias[:, 1::2] = gate_up_bias[:, inter:]
            m.down_proj.copy_(down.mT)
            m.down_proj_bias.copy_(down_bias)
    return twin


def expert_params(model):
    return [(ref.module.gate_up_proj, ref.module.down_proj, ref.module.gate_up_proj_bias, ref.module.down_proj_bias)
            for ref in find_moe_layers(model)]


def test_layout_is_recognised():
    model = make_model(swiglu_limit=1.0)
    refs = find_moe_layers(model)
    assert [r.layout for r in refs] == [ExpertsLayout.GPT_OSS] * 2
    assert (refs[0].num_experts, refs[0].intermediate_size, refs[0].hidden_size) == (4, 48, 64)
    assert (refs[0].activation.alpha, refs[0].activation.limit) == (1.702, 1.0)
    layer = pack_model(model)[refs[0].layer_id]
    assert layer.activation == refs[0].activation and layer.bias.shape == (4, 48, 2)


@pytest.mark.parametrize("swiglu_limit", [7.0, 1.0], ids=["limit7", "limit1-clamps-active"])
def test_logits_match_dequantized_eager_budget_equals_unbudgeted_and_restore_is_bitwise(swiglu_limit):
    model = make_model(swiglu_limit=swiglu_limit)
    original = logits(model)
    params = expert_params(model)
    impl = model.get_experts_implementation()
    layers = pack_model(model)
    reference = logits(dequantized_copy(model, layers))
    runs = {}
    for budget in (None, min_budget_bytes(layers, 2)):  # the smallest budget: every step evicts
        with apply(model, gpu_budget=budget, serving="paper") as handle:  # the paper: no prefetch
            assert all(ref.module.gate_up_proj.is_meta for ref in handle.refs)
            runs[budget] = logits(model)
            stats = handle.stats()
        assert (stats["bytes_h2d"] > 0) == (budget is not None)
        if budget is not None:
            assert stats["cache"]["peak_bytes"] <= budget
        assert model.get_experts_implementation() == impl
        assert all(a is b for old, new in zip(params, expert_params(model), strict=True)
                   for a, b in zip(old, new, strict=True))
        assert torch.equal(logits(model), original)  # restored bit for bit
    unbudgeted, budgeted = runs.values()
    rel = ((unbudgeted - reference).norm() / reference.norm()).item()
    assert rel <= 1e-5, rel
    assert torch.equal(budgeted, unbudgeted)
    assert not torch.allclose(unbudgeted, original, atol=1e-3)  # the 4-bit experts do change the logits


def test_pack_folder_round_trip(tmp_path):
    model = make_model(seed=1)
    layers = pack_model(model)
    save_pack(tmp_path / "pack", layers, info=model_info(model))
    with apply(model):
        direct = logits(model)
    with apply(model, tmp_path / "pack", allow_weights_mismatch=True):
        assert torch.equal(logits(model), direct)


def test_a_silu_pack_is_refused_for_gpt_oss(tmp_path):
    model = make_model()
    silu = {i: type(layer)(layer.fmt, layer.qweight, layer.scales, layer.zeros, layer.neuron_order)
            for i, layer in pack_model(model).items()}
    with pytest.raises(PackMismatchError, match="activation"):
        apply(model, silu)


def test_other_biased_layouts_are_still_refused():
    """A gpt-oss-shaped experts module whose gating is not gpt-oss's own (e.g. remote code) is refused,
    naming the module and why: CRISP runs only the math it implements."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    class OtherGateExperts(modeling_gpt_oss.GptOssExperts):
        def _apply_gate(self, gate_up):
            return torch.relu(gate_up[..., ::2]) * gate_up[..., 1::2]

    model = make_model()
    for layer in model.model.layers:
        old = layer.mlp.experts
        layer.mlp.experts = OtherGateExperts(model.config)
        layer.mlp.experts.load_state_dict(old.state_dict())
    before = model.get_experts_implementation()
    with pytest.raises(UnsupportedModelError, match="OtherGateExperts at 'model.layers.0.mlp.experts' is not "
                                                    "supported by CRISP: .*biases"):
        apply(model)
    assert model.get_experts_implementation() == before


def test_a_budget_decodes_the_full_width_tokens_with_prefetch_from_the_blocks_routing():
    """gpt-oss's router is not a ``gate`` giving (logits, weights, index): next-layer prediction runs its MoE block up
    to the experts call (crisp_runtime.scheduling.prefetch.block_routing)."""
    from test_families import decode_unbudgeted_and_at_60

    from crisp_runtime.scheduling.prefetch import find_routers

    model = make_model()
    assert all(r.experts is not None for r in find_routers(model).values())
    full, got, stats = decode_unbudgeted_and_at_60(model, pack_model(model))
    assert torch.equal(got, full)
    assert stats["prefetches"] > 0 and stats["prefetch_hits"] > 0
