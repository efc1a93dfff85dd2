"""MoE layer discovery and routing recording on tiny transformers models."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from crisp_runtime.hf.moe_layers import UnsupportedModelError, find_moe_layers, model_top_k, record_routing  # noqa: E402


def _tiny_mixtral(num_layers=3):
    cfg = transformers.MixtralConfig(
        vocab_size=64, hidden_size=64, intermediate_size=48, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).eval()


def test_finds_every_layer_with_its_shapes():
    model = _tiny_mixtral()
    refs = find_moe_layers(model)
    assert [r.layer_id for r in refs] == [0, 1, 2]
    assert all(r.name == f"model.layers.{r.layer_id}.mlp.experts" for r in refs)
    assert {(r.num_experts, r.intermediate_size, r.hidden_size) for r in refs} == {(6, 48, 64)}
    assert model_top_k(model) == 2


def test_recorded_routing_is_the_routers_choice():
    model = _tiny_mixtral(num_layers=2)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), record_routing(model) as trace:
        model(ids)
    index, weights = trace.layer(1)
    assert index.shape == (14, 2) and weights.shape == (14, 2)
    # Recompute layer 1's router on its own input and compare.
    captured = {}
    block = model.model.layers[1].mlp
    handle = block.register_forward_pre_hook(lambda m, args: captured.setdefault("x", args[0]))
    with torch.no_grad():
        model(ids)
    handle.remove()
    _, ref_weights, ref_index = block.gate(captured["x"].reshape(-1, 64))
    assert torch.equal(index, ref_index.long())
    assert torch.allclose(weights, ref_weights.float())
    # The hooks are gone after the context: nothing more is recorded.
    with torch.no_grad():
        model(ids)
    assert len(trace.index[1]) == 1


def test_refuses_models_without_supported_experts():
    with pytest.raises(UnsupportedModelError, match="no MoE experts module"):
        find_moe_layers(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    cfg = transformers.GptOssConfig(
        vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, head_dim=16,
    )
    model = transformers.GptOssForCausalLM(cfg)
    assert [r.layout.value for r in find_moe_layers(model)] == ["gpt-oss"]  # supported (tests/test_gptoss_dropin.py)
    # the same layout with another gating function (the only math CRISP runs is gpt-oss's own) is refused
    experts = model.model.layers[0].mlp.experts
    experts.__class__ = type("OtherGateExperts", (type(experts),), {"_apply_gate": lambda self, gate_up: gate_up})
    with pytest.raises(UnsupportedModelError, match="OtherGateExperts.*biases"):
        find_moe_layers(model)


@pytest.mark.parametrize(("act", "refused"), [
    (torch.nn.SiLU(), None),
    (torch.nn.functional.silu, None),  # the function itself, as LFM2-MoE's experts hold it
    (torch.nn.GELU(), "GELU"),
    (torch.nn.functional.gelu, "gelu"),
    (torch.tanh, "tanh"),
    (None, "missing"),
])
def test_experts_activation_must_be_silu(act, refused):
    model = _tiny_mixtral(num_layers=1)
    experts = model.model.layers[0].mlp.experts
    del experts.act_fn  # a registered module: a function takes its place as a plain attribute
    experts.act_fn = act
    if refused is None:
        assert len(find_moe_layers(model)) == 1
        return
    with pytest.raises(UnsupportedModelError, match=f"its activation is {refused}, CRISP's kernels implement SiLU"):
        find_moe_layers(model)
