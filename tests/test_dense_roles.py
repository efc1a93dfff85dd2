"""Which of a model's dense layers ``RuntimeConfig.dense`` replaces, family by family (attention's projections, the
shared experts and dense MLP layers, the lm head; never a router or a routed expert), and what becomes of the lm
head: 8-bit blocks where the rest take 4-bit rows, its original kept where the input embeddings share it."""

from __future__ import annotations

import pytest
import torch
from test_dense_bf16 import ROOT, tiny_model
from test_dense_int8 import FP32_TOL, OWN_TOL, rel
from test_hf_dropin import make_model

from crisp_kernels import QuantFormat
from crisp_kernels.dense_int8 import dense_int8_ref
from crisp_runtime.cpu.dense import DenseRole, Int8Linear, Q4Linear, dense_linears, swap_dense

# (family, config overrides) -> layers of each role; make_model's models have 2 layers (DeepSeek 3, its first dense)
ROLES = {
    "mixtral": {"head": 1, "attention": 8},
    "olmoe": {"head": 1, "attention": 8},
    "qwen2_moe": {"head": 1, "attention": 8, "mlp": 6},  # a shared expert's 3 a layer; not shared_expert_gate
    "deepseek_v3": {"head": 1, "attention": 12, "mlp": 9},  # MLA's 4 a layer; layer 0's MLP, 2 shared experts
}
ROUTERS = {"gate", "router", "shared_expert_gate"}


def _paths(model, found) -> dict[str, DenseRole]:
    ids = {id(linear): role for _, _, linear, role in found}
    return {path: ids[id(module)] for path, module in model.named_modules() if id(module) in ids}


@pytest.mark.parametrize("family", sorted(ROLES))
def test_dense_layers_are_attention_mlps_outside_the_experts_and_the_head(family):
    model = make_model(family)
    found = dense_linears(model)
    counts: dict[str, int] = {}
    for _, _, _, role in found:
        counts[role.value] = counts.get(role.value, 0) + 1
    assert counts == ROLES[family]
    paths = _paths(model, found)
    assert len(paths) == len(found)  # each layer once
    assert paths["lm_head"] is DenseRole.HEAD
    for path, role in paths.items():
        parts = path.split(".")
        assert parts[-1] not in ROUTERS and "experts" not in parts
        if role is DenseRole.MLP:  # a shared expert's, or a dense layer's MLP (DeepSeek's layer 0)
            assert parts[-2] in ("shared_expert", "shared_experts") or path.startswith("model.layers.0.mlp.")


@pytest.mark.parametrize("dense", ["q8", "q4"])
def test_swap_rounds_shared_experts_and_head_and_q4_keeps_the_head_in_8_bits(dense):
    # shared expert 64 wide (in_features of its down_proj): on the 4-bit rows' groups of 32 and the 8-bit blocks
    model = make_model("qwen2_moe", shared_expert_intermediate_size=64)
    x = torch.randn(3, model.config.hidden_size)
    shared = model.model.layers[1].mlp.shared_expert
    with torch.no_grad():
        want = model.lm_head(x)
    head, down = model.lm_head, shared.down_proj
    swap = swap_dense(model, dense, fmt=QuantFormat(group_size=32), threads=1)
    info = swap.info()
    assert info["roles"] == {"head": 1, "attention": 8, "mlp": 6} and sum(info["role_bytes"].values()) == swap.nbytes
    assert info["role_bytes"]["head"] == model.lm_head.packed.nbytes
    assert isinstance(model.lm_head, Int8Linear)  # Q8 under q4 too
    assert isinstance(shared.down_proj, Int8Linear if dense == "q8" else Q4Linear)
    assert type(model.model.layers[1].mlp.shared_expert_gate) is torch.nn.Linear  # the gate stays
    with torch.no_grad():
        got = model.lm_head(x)
    assert rel(got, dense_int8_ref(x, model.lm_head.packed)) <= OWN_TOL and rel(got, want) <= FP32_TOL
    swap.restore()
    assert model.lm_head is head and shared.down_proj is down
    assert swap.info()["roles"] == swap.info()["role_bytes"] == {}


def test_a_tied_head_is_replaced_and_its_weight_stays_for_the_embeddings():
    model = make_model("mixtral", tie_word_embeddings=True)
    model.tie_weights()
    embeddings = model.get_input_embeddings()
    assert model.lm_head.weight is embeddings.weight
    with torch.no_grad():  # bf16 values, so keep_original=False would free an untied original
        embeddings.weight.copy_(embeddings.weight.to(torch.bfloat16).float())
    before = embeddings.weight.clone()
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    head = model.lm_head
    swap = swap_dense(model, "q8", keep_original=False, threads=1)
    assert isinstance(model.lm_head, Int8Linear) and swap.info()["roles"]["head"] == 1
    assert torch.equal(embeddings.weight, before)  # not freed: the embeddings read it
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert rel(got, want) < 1.5e-2  # 8-bit inputs and weights in 2 layers' attention and the head: ~0.5%
    swap.restore()
    assert model.lm_head is head and head.weight is embeddings.weight


def test_applys_default_rounds_deepseeks_dense_layers_and_head_in_8_bits():
    from crisp_runtime import RuntimeConfig, apply

    model, pack = tiny_model("tiny-deepseek")
    found = dense_linears(model)
    ids = torch.tensor(list((ROOT / "data" / "stdlib-calib.txt").read_bytes()[:128])).unsqueeze(0)  # byte tokens
    with apply(model, pack, config=RuntimeConfig(dense="keep")), torch.no_grad():
        want = model(input_ids=ids).logits  # the same experts, every dense layer as loaded
    with apply(model, pack) as handle:
        info = handle.stats()["dense"]
        assert handle.stats()["cpu"]["placement"] == "cpu_only" and info["chosen"] == "q8"
        roles = {role.value for _, _, _, role in found}
        assert set(info["roles"]) == roles == {"attention", "mlp", "head"}
        assert info["layers"] == len(found) and info["kept"] == 0
        with torch.no_grad():
            got = model(input_ids=ids).logits
    # every dense layer's inputs and weights in 8 bits (3 layers' attention, 2 shared experts, layer 0's MLP, the
    # head): measured 0.84% relative on these logits, 99.2% of the argmaxes kept; ~3x room
    assert rel(got, want) < 2.5e-2 and (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.97
    assert [linear for _, _, linear, _ in dense_linears(model)] == [linear for _, _, linear, _ in found]


@pytest.mark.parametrize("dense", ["q8", "q4"])
def test_training_a_replaced_layers_own_weight_is_refused_not_silently_zero(dense):
    from crisp_runtime import RuntimeConfig, apply

    model, pack = tiny_model("tiny-mixtral")
    model.requires_grad_(False)
    weight = model.model.layers[0].self_attn.q_proj.weight
    weight.requires_grad_(True)  # only this layer trains: its input needs no gradient, its weight does
    ids = torch.tensor([[3, 7, 11, 19, 23]])
    with apply(model, pack, serving="cpu_only", cpu="on", gpu_budget="64MiB", config=RuntimeConfig(dense=dense)):
        logits = model(input_ids=ids).logits
        assert logits.requires_grad
        loss = logits.float().pow(2).mean() + 1e-3 * weight.pow(2).sum()  # the regulariser alone would backprop
        with pytest.raises(RuntimeError, match=r"dense layers \(RuntimeConfig.dense\) do not support gradients"):
            loss.backward()
    logits = model(input_ids=ids).logits  # restored: the layer trains
    logits.float().pow(2).mean().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0
