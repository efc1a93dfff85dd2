"""The transformers MoE families beyond test_hf_dropin's four, on tiny ``from_config`` models: every family of the
installed transformers whose experts module takes CRISP's experts implementation (fused ``gate_up_proj`` /
``down_proj``, SiLU gating), hybrid ones included (Mamba, linear attention, short convolutions beside attention).

Per family: the device path (``cpu="off"``) and the CPU kernel's exact path at full width give the logits of the
eager model with the dequantized 4-bit experts (the same bound as test_hf_dropin's exactness test), and ``restore()``
gives back the original model bitwise; the CPU default (``apply(model)`` alone) rounds the dense layers expected of
that family's architecture, never a router or a routed expert; ``load_model`` streams the checkpoint that
``save_pretrained`` wrote (each family's own names for its experts) into the logits ``apply`` gives. ``crisp-profile``
on three of them (routers with softmax and with a sigmoid and bias, two hybrids) writes a pack whose neuron order
leaves the model's function as it was."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from profile_helpers import PROFILE_ARGS, reorder_changes_nothing, write_text  # noqa: E402
from test_hf_dropin import _restored_twin as restored_twin  # noqa: E402
from test_hf_dropin import dequantized_copy, scale_experts  # noqa: E402
from test_streaming_load import streamed_and_applied  # noqa: E402

from crisp_runtime import RuntimeConfig, apply, load_pack, pack_model  # noqa: E402
from crisp_runtime.cpu.dense import dense_linears  # noqa: E402
from crisp_runtime.cpu.experts import EXACT  # noqa: E402
from crisp_runtime.hf.moe_layers import UnsupportedModelError, find_moe_layers, record_routing  # noqa: E402
from crisp_runtime.scheduling.prefetch import NextLayerPredictor, block_routing, find_routers  # noqa: E402

# the fields a family's config has among these are set (2 layers, 4 experts top-2, H 64): what makes each tiny
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=64, num_experts=4,
             num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_topk=2,
             shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=32,
             q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
             pad_token_id=0, eos_token_id=None, bos_token_id=None)
# MLA families: the rotary embedding spans qk_rope_head_dim, which their configs read as head_dim
MLA = dict(head_dim=8, num_key_value_heads=4)

# model_type -> (config fields beyond SMALL, the dense layers the CPU default rounds by role). Roles from each
# architecture: 4 attention projections per attention layer (MLA: q, kv_a, kv_b, o); a hybrid's Mamba,
# linear-attention or convolution layer's in_proj* and out_proj; a shared expert's or a dense layer's gate/up/down
# (Granite's shared MLP: input_linear, output_linear); the lm head.
FAMILIES = {
    "qwen3_moe": ({}, {"head": 1, "attention": 8}),
    # one linear-attention layer (gated delta rule), one full-attention layer; a shared expert per MoE layer
    "qwen3_next": (dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
                   {"head": 1, "attention": 4, "mixer": 3, "mlp": 6}),  # in_proj_qkvz, in_proj_ba, out_proj
    "glm4_moe": ({}, {"head": 1, "attention": 8, "mlp": 6}),  # a shared expert per layer
    "glm4_moe_lite": (MLA, {"head": 1, "attention": 8, "mlp": 6}),
    # MLA; layer 0 dense (its MLP), layers 1-2 MoE with a shared expert each
    "deepseek_v2": (dict(MLA, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
                         num_experts_per_tok=3, n_group=2), {"head": 1, "attention": 12, "mlp": 9}),
    "ernie4_5_moe": ({}, {"head": 1, "attention": 8, "mlp": 6}),  # layer 0 dense, layer 1 with shared experts
    "granitemoe": ({}, {"head": 1, "attention": 8}),
    "granitemoeshared": (dict(shared_intermediate_size=32), {"head": 1, "attention": 8, "mlp": 4}),  # shared_mlp's 2
    "granitemoehybrid": (dict(layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=16,
                              mamba_d_state=8, mamba_n_groups=1, mamba_expand=2),
                         {"head": 1, "attention": 4, "mixer": 2, "mlp": 4}),  # Mamba's in_proj and out_proj
    "phimoe": ({}, {"head": 1, "attention": 8}),
    "minimax": ({}, {"head": 1, "attention": 7}),  # layer 0 lightning attention: qkv_proj, output_gate, out_proj
    "minimax_m2": ({}, {"head": 1, "attention": 8}),
    "hunyuan_v1_moe": ({}, {"head": 1, "attention": 8, "mlp": 6}),  # shared_mlp
    "dots1": ({}, {"head": 1, "attention": 8, "mlp": 6}),
    "flex_olmo": ({}, {"head": 1, "attention": 8}),
    "exaone_moe": ({}, {"head": 1, "attention": 8, "mlp": 6}),
    "afmoe": ({}, {"head": 1, "attention": 10, "mlp": 6}),  # attention's output gate a fifth projection
    "cohere2_moe": ({}, {"head": 1, "attention": 8}),
    "solar_open": ({}, {"head": 1, "attention": 8, "mlp": 6}),
    "mimo_v2_flash": ({}, {"head": 1, "attention": 8, "mlp": 3}),  # layer 0 dense
    "laguna": ({}, {"head": 1, "attention": 10, "mlp": 6}),
    "jamba": (dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
                   mamba_d_state=8, mamba_expand=2),
              {"head": 1, "attention": 4, "mixer": 2}),  # layer 0 Mamba: its x_proj and dt_proj kept
    # layer 0 a short convolution; its experts hold torch.nn.functional.silu itself, not a module
    "lfm2_moe": (dict(layer_types=["conv", "full_attention"], num_dense_layers=0),
                 {"head": 1, "attention": 4, "mixer": 2}),
}
ROUTER_NAMES = {"gate", "router", "wg", "shared_expert_gate"}
TOKENS = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(0))
# exact paths against the dequantized eager model: fp32 sums in another order (test_hf_dropin: 1e-5; measured
# 1.3e-7 - 5.0e-7 here)
EXACT_TOL = 1e-5
# the CPU default against the original model with from_config's init: 4-bit experts, 8-bit activations and 8-bit
# dense layers; measured 0.007-0.086 over these families (routing flips on near ties move a token's logits whole).
# A wrong dense layer or a rounded router is off by ~1
DEFAULT_TOL = 0.15


def make_family_model(family: str, expert_std: float | None = 0.1, vocab_size: int = 96):
    """A tiny model of ``family`` (random weights); its experts scaled to std ``expert_std`` to dominate the logits
    (None: from_config's init)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    extra, _ = FAMILIES[family]
    defaults = AutoConfig.for_model(family)
    fields = {k: v for k, v in SMALL.items() if hasattr(defaults, k)} | extra | {"vocab_size": vocab_size}
    torch.manual_seed(0)
    return scale_experts(AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields)).eval(), expert_std)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_width_is_the_dequantized_model_on_both_paths_and_restores(family):
    model = make_family_model(family)
    original = logits(model)
    layers = pack_model(model)
    handle = apply(model, gpu_budget=None, cpu="off")  # the device path (a GPU's), on this CPU
    device = logits(model)
    want = logits(dequantized_copy(restored_twin(model, handle), layers))
    handle.restore()
    assert torch.equal(logits(model), original)
    assert rel(device, want) <= EXACT_TOL
    # every expert on the CPU kernel's exact path, the dense layers as loaded
    with apply(model, layers, gpu_budget=None, cpu="auto",
               config=RuntimeConfig(dense="keep", cpu_experts=EXACT)) as handle:
        on_cpu = logits(model)
        assert handle.stats()["cpu"]["placement"] == "cpu_only"
    assert rel(on_cpu, want) <= EXACT_TOL
    assert torch.equal(logits(model), original)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cpu_default_rounds_the_dense_layers_of_the_architecture(family):
    model = make_family_model(family, expert_std=None)
    original = logits(model)
    paths = {id(linear): role for _, _, linear, role in dense_linears(model)}
    for path, module in model.named_modules():
        if id(module) in paths:
            parts = path.split(".")
            assert parts[-1] not in ROUTER_NAMES and "experts" not in parts, path
    with apply(model) as handle:  # what a user without a GPU gets
        got = logits(model)
        stats = handle.stats()
    assert stats["cpu"]["placement"] == "cpu_only" and stats["dense"]["chosen"] == "q8"
    assert stats["dense"]["roles"] == FAMILIES[family][1]
    assert rel(got, original) <= DEFAULT_TOL
    assert torch.equal(logits(model), original)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_load_model_streams_the_saved_checkpoint(family, tmp_path):
    got, expected, handle = streamed_and_applied(make_family_model(family), tmp_path, logits)
    assert torch.equal(got, expected)
    assert handle.stats()["tokens"] == TOKENS.numel()


# softmax routing with a shared expert beside linear attention; sigmoid routing with a correction bias; short
# convolutions with torch.nn.functional.silu experts
PROFILED = ["qwen3_next", "glm4_moe", "lfm2_moe"]


@pytest.mark.parametrize("family", PROFILED)
def test_crisp_profile_writes_a_pack_whose_order_keeps_the_function(family, tmp_path):
    from crisp_tools import profiler
    from crisp_tools.calibration import load_model

    make_family_model(family, expert_std=None, vocab_size=256).save_pretrained(tmp_path / "ckpt")  # byte tokens
    text = write_text(tmp_path / "calib.txt")
    assert profiler.main(["--model", str(tmp_path / "ckpt"), "--data", str(text), "--out", str(tmp_path / "pack"),
                          *PROFILE_ARGS]) == 0
    pack = load_pack(tmp_path / "pack")
    model, layers = load_model(tmp_path / "ckpt")
    pack.check_model(model)
    assert pack.plan is not None and sorted(pack.layers) == [ref.layer_id for ref in layers]
    ids = torch.tensor(list(text.read_bytes()[:64]), dtype=torch.long).view(2, 32)
    assert reorder_changes_nothing(tmp_path / "ckpt", pack, ids) <= 1e-12  # float64: the order of the sums alone


# the families whose MoE block routes in its own forward (no 'gate' giving logits, weights and index): next-layer
# prediction runs the block up to its experts call (crisp_runtime.scheduling.prefetch.block_routing)
ROUTED_BY_BLOCK = {"afmoe", "granitemoe", "granitemoehybrid", "granitemoeshared", "jamba", "lfm2_moe", "minimax_m2",
                   "phimoe"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_next_layer_routing_is_the_blocks_own(family):
    model = make_family_model(family)
    routers = find_routers(model)
    assert {r.experts is not None for r in routers.values()} == {family in ROUTED_BY_BLOCK}
    h = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for ref in find_moe_layers(model):
        block = model.get_submodule(ref.name.rpartition(".")[0])
        with record_routing(model, [ref]) as trace, torch.no_grad():
            weights, index = block_routing(block, ref.module, h)
            assert len(ref.module._forward_pre_hooks) == 1  # the recorder's: the stop is removed
            block(h.unsqueeze(0))  # the block's own call, recorded: the stopped one was not
        assert len(trace.index[ref.layer_id]) == 1
        assert torch.equal(index.long(), trace.index[ref.layer_id][0])
        assert torch.equal(weights.float(), trace.weights[ref.layer_id][0])
        if family not in ROUTED_BY_BLOCK:  # the gate's own routing is the same
            _, gate_weights, gate_index = routers[ref.layer_id].route(h)
            assert torch.equal(gate_index, index) and torch.equal(gate_weights, weights)
    if family in ROUTED_BY_BLOCK:  # no logits: no extra predicted expert
        with pytest.raises(UnsupportedModelError, match="routes inside its own forward"):
            NextLayerPredictor(model, experts=model.config.num_experts_per_tok + 1)


def decode_unbudgeted_and_at_60(model, layers) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """6 greedy tokens after a 5-token prompt with every expert resident, the same at a 60% budget (the default
    serving: evictions, next-layer prefetch), and the budgeted handle's stats."""
    ids = torch.randint(1, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    with apply(model, layers, gpu_budget=None, cpu="off"):
        full = model.generate(ids, max_new_tokens=6, do_sample=False)
    with apply(model, layers, gpu_budget="60%", cpu="off") as handle:
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
        return full, got, handle.stats()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_budget_decodes_the_full_width_tokens_with_prefetch(family):
    model = make_family_model(family)
    layers = pack_model(model)
    full, got, stats = decode_unbudgeted_and_at_60(model, layers)
    assert torch.equal(got, full)
    assert stats["bytes_h2d"] > 0 and stats["serving"]["prefetch"] is not None
    if len(layers) > 1:  # a next MoE layer to predict: predicted experts were copied ahead and then used
        assert stats["prefetches"] > 0 and stats["prefetch_hits"] > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "granitemoe", "jamba", "minimax_m2"])  # a gate; routed by the block
def test_prediction_is_out_of_the_models_sight(family):
    """What the model records (router logits, the aux loss), the user's hooks on its MoE blocks, and another thread's
    forward of the same model see nothing of next-layer prediction."""
    import threading

    model = make_family_model(family)
    layers = pack_model(model)
    blocks = [model.get_submodule(ref.name.rpartition(".")[0]) for ref in find_moe_layers(model)]
    calls = []
    hooks = [b.register_forward_pre_hook(lambda m, a: calls.append(m)) for b in blocks]

    def run():  # one token at a time, as a decode step: what prefetch serves
        with torch.no_grad():
            return model(TOKENS[:1, :1], output_router_logits=True)

    try:
        with apply(model, layers, gpu_budget=None, cpu="off"):
            want, want_calls = run(), len(calls)
        with apply(model, layers, gpu_budget="60%", cpu="off") as handle:
            got = run()
            got = run()  # with the first step's experts resident, the second's prefetch is admitted
            assert len(calls) == 3 * want_calls  # the forwards' own block calls, no prediction's
            outs, errors = [], []

            def worker():
                try:
                    for _ in range(5):
                        outs.append(run().logits)
                except BaseException as err:  # noqa: BLE001 - the test reports what a thread raised
                    errors.append(err)

            threads = [threading.Thread(target=worker) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert handle.stats()["prefetches"] > 0
    finally:
        for h in hooks:
            h.remove()
    assert len(got.router_logits) == len(want.router_logits) == len(layers)
    assert all(torch.equal(g, w) for g, w in zip(got.router_logits, want.router_logits, strict=True))
    assert torch.equal(got.aux_loss, want.aux_loss) and torch.equal(got.logits, want.logits)
    assert not errors, errors
    assert len(outs) == 10 and all(torch.equal(o, want.logits) for o in outs)


@pytest.mark.parametrize("family", ["qwen3_moe", "jamba"])  # a gate with logits; a block routing in its forward
def test_a_trace_records_the_predictions_the_routers_allow(family):
    from crisp_bench import traces

    model = make_family_model(family)
    top_k = model.config.num_experts_per_tok
    trace = traces.record_trace(model, torch.randint(1, 96, (2, 8), generator=torch.Generator().manual_seed(2)))
    per_token = top_k + 1 if family not in ROUTED_BY_BLOCK else top_k  # no logits to rank a further expert by
    assert trace.meta["prediction"]["experts_per_token"] == per_token and trace.predicted.shape[2] == per_token
    assert (trace.predicted[:-1] >= 0).all() and (trace.predicted[-1] == -1).all()
