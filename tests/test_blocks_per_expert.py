"""Per-expert MoE blocks (hf.blocks) through the drop-in: DeepSeek-MoE remote code, v4 Mixtral, Qwen1.5-MoE.

The blocks below are faithful minimal copies of the published modeling code (their routing and expert
arithmetic line by line; training-only branches dropped): DeepSeek-MoE's modeling_deepseek.py
(MoEGate with softmax scoring, top-k, norm_topk_prob=False as in deepseek-moe-16b; DeepseekMoE with
moe_infer; shared experts as one DeepseekMLP of moe_intermediate_size * n_shared_experts; first layer
dense), transformers 4.x modeling_mixtral.py (MixtralSparseMoeBlock, w1/w3/w2 experts) and
modeling_qwen2_moe.py (Qwen2MoeSparseMoeBlock, shared_expert + sigmoid shared_expert_gate).
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from crisp_kernels import dequantize_layer
from crisp_runtime import CrispPlan, PackMismatchError, PlanError, RuntimeConfig, UnsupportedModelError, apply
from crisp_runtime.execution.runtime import min_budget_bytes
from crisp_runtime.hf.blocks import (
    BLOCK_SHAPES,
    BlockShape,
    blocks_weights_sha256,
    find_moe_blocks,
    pack_blocks,
    route_softmax_topk,
)
from crisp_runtime.scheduling.prefetch import PrefetchPolicy
from crisp_runtime.storage.pack import save_pack

HIDDEN, VOCAB = 64, 96


# ---------------------------------------------------------------------- DeepSeek-MoE (remote code)


class DeepseekMLP(nn.Module):
    def __init__(self, config, hidden_size=None, intermediate_size=None):
        super().__init__()
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_routed_experts = config.n_routed_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty((self.n_routed_experts, config.hidden_size)))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states, self.weight, None)
        scores = logits.softmax(dim=-1)  # scoring_func == "softmax"
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, topk_weight, None  # aux_loss only in training


class DeepseekMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_experts_per_tok = config.num_experts_per_tok
        self.experts = nn.ModuleList([DeepseekMLP(config, intermediate_size=config.moe_intermediate_size)
                                      for _ in range(config.n_routed_experts)])
        self.gate = MoEGate(config)
        if config.n_shared_experts is not None:
            self.shared_experts = DeepseekMLP(config, intermediate_size=config.moe_intermediate_size
                                              * config.n_shared_experts)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight, _ = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        y = self.moe_infer(hidden_states, topk_idx.view(-1), topk_weight.view(-1, 1)).view(*orig_shape)
        if self.config.n_shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y

    @torch.no_grad()
    def moe_infer(self, x, flat_expert_indices, flat_expert_weights):
        expert_cache = torch.zeros_like(x)
        idxs = flat_expert_indices.argsort()
        tokens_per_expert = flat_expert_indices.bincount().cpu().numpy().cumsum(0)
        token_idxs = idxs // self.num_experts_per_tok
        for i, end_idx in enumerate(tokens_per_expert):
            start_idx = 0 if i == 0 else tokens_per_expert[i - 1]
            if start_idx == end_idx:
                continue
            exp_token_idx = token_idxs[start_idx:end_idx]
            expert_out = self.experts[i](x[exp_token_idx])
            expert_out.mul_(flat_expert_weights[idxs[start_idx:end_idx]])
            expert_cache.scatter_reduce_(0, exp_token_idx.view(-1, 1).repeat(1, x.shape[-1]), expert_out, reduce="sum")
        return expert_cache


# ---------------------------------------------------------------------- transformers 4.x Mixtral / Qwen2-MoE


class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        return self.w2(self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states))


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP(config) for _ in range(self.num_experts)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(hidden_states.dtype))
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


class Qwen2MoeMLP(DeepseekMLP):
    pass


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList([Qwen2MoeMLP(config, intermediate_size=config.moe_intermediate_size)
                                      for _ in range(self.num_experts)])
        self.shared_expert = Qwen2MoeMLP(config, intermediate_size=config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(hidden_states.dtype))
        shared = F.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        final = final + shared
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


# ---------------------------------------------------------------------- a tiny causal LM around them


class Layer(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = mlp

    def forward(self, h):
        out = self.mlp(self.input_layernorm(h))
        return h + (out[0] if isinstance(out, tuple) else out)


class Body(nn.Module):
    def __init__(self, mlps):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Layer(m) for m in mlps])


class TinyLM(nn.Module):
    """Embedding, residual MoE layers (no attention: the experts path is what is tested), LM head."""

    def __init__(self, config, mlps):
        super().__init__()
        self.config = config
        self.model = Body(mlps)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h)
        return SimpleNamespace(logits=self.lm_head(h))


def make_model(family, seed=0, expert_std=0.1, layers=3):
    torch.manual_seed(seed)
    if family == "deepseek_moe":  # deepseek-moe-16b: 64 experts top-6, 2 shared, norm_topk_prob False, layer 0 dense
        cfg = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
                              num_experts_per_tok=6, n_shared_experts=2, norm_topk_prob=False)
        mlps = [DeepseekMLP(cfg)] + [DeepseekMoE(cfg) for _ in range(layers - 1)]
    elif family == "mixtral_v4":
        cfg = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
        mlps = [MixtralSparseMoeBlock(cfg) for _ in range(layers)]
    elif family == "qwen2_moe_v4":
        cfg = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                              num_experts_per_tok=4, norm_topk_prob=False, shared_expert_intermediate_size=48)
        mlps = [Qwen2MoeSparseMoeBlock(cfg) for _ in range(layers)]
    else:
        raise ValueError(family)
    model = TinyLM(cfg, mlps).eval()
    with torch.no_grad():  # experts scaled up so that they dominate the logits: any error in their path shows
        for ref in find_moe_blocks(model):
            for e in range(ref.num_experts):
                for p in ref.projections(e):
                    p.weight.normal_(0, expert_std)
    return model


FAMILIES = ["deepseek_moe", "mixtral_v4", "qwen2_moe_v4"]
TOKENS = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))


def logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


def dequantized_copy(model, layers):
    """The eager model with every expert's weights replaced by the dequantized 4-bit weights."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for ref in find_moe_blocks(twin):
            gate_up, down = dequantize_layer(layers[ref.layer_id], dtype=torch.float32)
            inter = ref.intermediate_size
            for e in range(ref.num_experts):
                gate, up, dn = ref.projections(e)
                gate.weight.copy_(gate_up[e, :inter])
                up.weight.copy_(gate_up[e, inter:])
                dn.weight.copy_(down[e])
    return twin


def expert_params(model):
    return [(ref.name, e, p.weight) for ref in find_moe_blocks(model) for e in range(ref.num_experts)
            for p in ref.projections(e)]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_dequantized_eager_budget_equals_unbudgeted_and_restore_is_bitwise(family):
    model = make_model(family)
    original = logits(model)
    before = expert_params(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    refs = find_moe_blocks(model)
    assert [r.layer_id for r in refs] == ([1, 2] if family == "deepseek_moe" else [0, 1, 2])  # layer 0 dense
    layers = pack_blocks(refs)
    reference = logits(dequantized_copy(model, layers))
    top_k = model.config.num_experts_per_tok
    runs = {}
    for budget in (None, min_budget_bytes(layers, top_k)):  # the smallest budget forces evictions
        with apply(model, gpu_budget=budget, serving="paper") as handle:  # the paper: no prefetch
            assert type(handle).__name__ == "BlockHandle"
            assert all(p.is_meta for _, _, p in expert_params(model))  # full-precision experts out of the model
            runs[budget] = logits(model)
            stats = handle.stats()
            json.dumps(stats)
            assert stats["tokens"] == TOKENS.numel()
            if budget is None:
                assert stats["bytes_h2d"] == 0
            else:
                assert stats["bytes_h2d"] > 0 and stats["cache"]["peak_bytes"] <= budget
        after = expert_params(model)
        assert [(n, e) for n, e, _ in after] == [(n, e) for n, e, _ in before]
        assert all(p1 is p2 for (_, _, p1), (_, _, p2) in zip(after, before, strict=True))  # the same Parameters
        assert list(model.state_dict()) == list(state)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
        assert "forward" not in refs[0].module.__dict__
        assert torch.equal(logits(model), original)
    for got in runs.values():
        rel = ((got - reference).norm() / reference.norm()).item()
        assert rel <= 1e-5, rel
    unbudgeted, budgeted = runs.values()
    assert torch.equal(budgeted, unbudgeted)


@pytest.mark.parametrize("family", FAMILIES)
def test_plans_narrow_the_experts_and_outputs_change(family):
    model = make_model(family)
    refs = find_moe_blocks(model)
    inter, experts, k = refs[0].intermediate_size, refs[0].num_experts, model.config.num_experts_per_tok
    ids = [r.layer_id for r in refs]
    with apply(model, plan=CrispPlan.full(experts, k, inter, ids)) as handle:
        full = logits(model)
        full_bytes = handle.stats()["bytes_read"]
        handle.reset_stats()
        handle.set_plan(CrispPlan.uniform(experts, k, inter, ids, inter // 4))
        narrow = logits(model)
        assert handle.stats()["bytes_read"] == full_bytes // 4
        assert not torch.allclose(narrow, full)
        with pytest.raises(PlanError):
            handle.set_plan(CrispPlan.full(experts + 1, k, inter, ids))


def test_router_logits_are_returned_as_the_block_returns_them():
    model = make_model("mixtral_v4")
    block = find_moe_blocks(model)[0].module
    x = torch.randn(2, 5, HIDDEN)
    with torch.no_grad():
        _, want = block(x)
        with apply(model):
            y, got = block(x)
    assert y.shape == x.shape and torch.equal(got, want)


def test_a_new_shape_is_a_few_lines():
    class MyExpert(nn.Module):
        def __init__(self):
            super().__init__()
            self.wg, self.wu = nn.Linear(HIDDEN, 32, bias=False), nn.Linear(HIDDEN, 32, bias=False)
            self.wd = nn.Linear(32, HIDDEN, bias=False)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            return self.wd(self.act_fn(self.wg(x)) * self.wu(x))

    class MyBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k, self.router = 2, nn.Linear(HIDDEN, 4, bias=False)
            self.mlps = nn.ModuleList([MyExpert() for _ in range(4)])

        def forward(self, h):
            x = h.reshape(-1, HIDDEN)
            w, i = torch.topk(torch.sigmoid(self.router(x)), 2, dim=-1)
            out = sum(w[:, j:j + 1] * torch.stack([self.mlps[int(e)](x[t]) for t, e in enumerate(i[:, j])])
                      for j in range(2))
            return out.reshape(h.shape)

    mine = BlockShape("mine", ("MyBlock",), lambda block, x: (*reversed(torch.topk(
        torch.sigmoid(block.router(x)), block.top_k, dim=-1)), None), projections=("wg", "wu", "wd"), experts="mlps")
    torch.manual_seed(0)
    model = TinyLM(SimpleNamespace(num_experts_per_tok=2), [MyBlock(), MyBlock()]).eval()
    with pytest.raises(UnsupportedModelError, match="no per-expert MoE block of a registered shape"):
        apply(model)  # not registered: not recognised
    shapes = (*BLOCK_SHAPES, mine)
    layers = pack_blocks(find_moe_blocks(model, shapes))
    reference = logits(_dequantized_custom(model, layers, shapes))
    with apply(model, shapes=shapes, cpu="off"):  # the device path (a GPU's), on this CPU
        got = logits(model)
    assert ((got - reference).norm() / reference.norm()).item() <= 1e-5


def _dequantized_custom(model, layers, shapes):
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for ref in find_moe_blocks(twin, shapes):
            gate_up, down = dequantize_layer(layers[ref.layer_id])
            for e in range(ref.num_experts):
                gate, up, dn = ref.projections(e)
                gate.weight.copy_(gate_up[e, :32])
                up.weight.copy_(gate_up[e, 32:])
                dn.weight.copy_(down[e])
    return twin


def test_pack_folder_with_fingerprint_and_mismatches(tmp_path):
    model = make_model("deepseek_moe")
    refs = find_moe_blocks(model)
    layers = pack_blocks(refs)
    info = {"top_k": 6, "model": {"weights_sha256": blocks_weights_sha256(refs)}}
    save_pack(tmp_path / "p", layers, plan=CrispPlan.uniform(16, 6, 32, [1, 2], 16), info=info)
    with apply(model, tmp_path / "p") as handle:
        assert handle.plan.policy.value == "uniform"
    other = make_model("deepseek_moe", seed=1)
    before = expert_params(other)
    with pytest.raises(PackMismatchError, match="other weights"):
        apply(other, tmp_path / "p")
    apply(other, tmp_path / "p", allow_weights_mismatch=True).restore()
    smaller = make_model("deepseek_moe", layers=2)
    with pytest.raises(PackMismatchError, match="MoE layers"):
        apply(smaller, layers)
    with pytest.raises(PlanError, match="top_k"):
        apply(other, plan=CrispPlan.full(16, 2, 32, [1, 2]))
    assert all(p1 is p2 and not p1.is_meta for (_, _, p1), (_, _, p2) in zip(expert_params(other), before,
                                                                             strict=True))


def test_refusals_leave_the_model_untouched():
    model = make_model("mixtral_v4")
    before = expert_params(model)
    with pytest.raises(ValueError, match="keep_original"):
        apply(model, config=RuntimeConfig(keep_original=False))
    with pytest.raises(ValueError, match="too small"):
        apply(model, gpu_budget=1024)
    handle = apply(model)
    with pytest.raises(RuntimeError, match="already applied"):
        apply(model)
    handle.restore()
    handle.restore()  # idempotent
    assert all(p1 is p2 for (_, _, p1), (_, _, p2) in zip(expert_params(model), before, strict=True))

    biased = make_model("mixtral_v4")
    biased.model.layers[1].mlp.experts[2].w1 = nn.Linear(HIDDEN, 32, bias=True)
    with pytest.raises(UnsupportedModelError, match="layers.1.mlp.*biases"):
        apply(biased)
    gelu = make_model("deepseek_moe")
    gelu.model.layers[2].mlp.experts[0].act_fn = nn.GELU()
    with pytest.raises(UnsupportedModelError, match="GELU"):
        apply(gelu)
    with pytest.raises(TypeError, match="BlockShape"):
        find_moe_blocks(model, shapes=("mixtral",))


def test_restore_after_model_to_bf16_while_applied_gives_the_converted_model():
    model = make_model("mixtral_v4")
    expected = copy.deepcopy(model).to(torch.bfloat16)
    handle = apply(model)
    model.to(torch.bfloat16)
    handle.restore()
    got, want = model.state_dict(), expected.state_dict()
    assert list(got) == list(want)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in want.items())
    assert torch.equal(logits(model), logits(expected))


def test_gradients_through_crisp_experts_are_refused():
    model = make_model("qwen2_moe_v4")
    # the dense layers as loaded: by default their rounded copies refuse the backward first (the lm head's is the
    # first node it reaches; tests/test_hf_misuse.py)
    with apply(model, config=RuntimeConfig(dense="keep")):
        out = model(TOKENS).logits
        with pytest.raises(RuntimeError, match="CRISP experts"):
            out.sum().backward()


def test_route_softmax_topk_is_the_v4_routing():
    block = make_model("qwen2_moe_v4").model.layers[0].mlp
    x = torch.randn(7, HIDDEN)
    index, weights, logits_ = route_softmax_topk(block, x, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(7))
    assert torch.equal(logits_, block.gate(x))
    assert index.shape == (7, 4)


# ---------------------------------------------------------------------- the runtime knobs: cpu= and prefetch


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cpu", ["off", "on", "auto"])
def test_cpu_knob_as_for_v5_models(family, cpu):
    """cpu= through the same decide_cpu and CPU worker as the v5 path: off keeps the GPU placement; on with a CPU
    placement, and auto on this machine without a GPU, run the experts on the worker, each layer step within the
    CPU's precision contract of the float64 reference at the widths served (crisp_bench.e2e.StepCheck's bound),
    and with the exact fp32 path the logits equal the dequantized eager model's (1e-5, as above)."""
    from crisp_bench.e2e import StepCheck

    from crisp_runtime.cpu.experts import EXACT
    from crisp_runtime.scheduling.scheduler import CostModel

    model = make_model(family)
    layers = pack_blocks(find_moe_blocks(model))
    reference = logits(dequantized_copy(model, layers))
    budget = min_budget_bytes(layers, model.config.num_experts_per_tok)
    runs = {}
    for exact in (False, True) if cpu == "on" else (False,):
        config = RuntimeConfig(cost=CostModel(cpu_bytes_per_s=1e9), cpu_experts=EXACT) if exact else None
        serving = "cpu_only" if cpu == "on" else None  # on: a CPU placement that surely runs experts on the CPU
        with apply(model, gpu_budget=budget, cpu=cpu, serving=serving, config=config) as handle:
            check = StepCheck(handle.runtime)
            runs[exact] = logits(model)
            check.close()
            stats = handle.stats()
            assert stats["cpu"]["mode"] == cpu
            if cpu in ("on", "auto"):  # auto: the model is on the CPU, so every expert runs on the CPU kernel
                assert stats["cpu"]["placement"] == "cpu_only" and stats["cpu_runs"] > 0 and stats["bytes_h2d"] == 0
                assert stats["cpu"]["experts"]["precision"] == ("fp32" if exact else "q8")
                assert check.record()["within_tolerance"] and check.steps == len(layers)  # one batched forward
            else:
                assert stats["cpu"]["placement"] == "gpu" and stats["cpu_runs"] == 0
                assert stats["cpu"]["experts"] is None
            runtime = handle.runtime
        assert not runtime._cpu.started  # restore() stopped the worker
    if cpu != "auto":  # auto ran the 8-bit CPU kernel only: its steps were checked against their bound above
        exact_run = runs[cpu == "on"]
        rel = ((exact_run - reference).norm() / reference.norm()).item()
        assert rel <= 1e-5, rel


def test_cpu_on_needs_a_budget_for_blocks():
    model = make_model("mixtral_v4")
    with pytest.raises(ValueError, match="needs a gpu_budget"):
        apply(model, cpu="on")
    with pytest.raises(ValueError, match="cpu: expected 'off', 'on' or 'auto'"):
        apply(model, gpu_budget=10**6, cpu="yes")
    assert all(not p.is_meta for _, _, p in expert_params(model))  # refused before the model was touched


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("extra", [0, 1])
def test_prefetch_keeps_exact_outputs_and_the_budget(family, extra):
    """As tests/test_prefetch.py for v5 models: a prefetch moves bytes, never changes outputs (the plan's
    serving is independent of the cache), and the budget holds with it."""
    model = make_model(family)
    layers = pack_blocks(find_moe_blocks(model))
    budget = min_budget_bytes(layers, model.config.num_experts_per_tok) + 2 * next(iter(layers.values())).nbytes() // (
        next(iter(layers.values())).num_experts)
    def one_token_steps():  # decode-sized steps (one token each): room in the budget beside a step's experts
        with torch.no_grad():
            return torch.cat([model(TOKENS[:1, t:t + 1]).logits for t in range(TOKENS.shape[1])])

    with apply(model, gpu_budget=budget, serving="paper") as handle:  # no prefetch
        plain = one_token_steps()
        assert handle.stats()["prefetches"] == 0
    config = RuntimeConfig(prefetch=PrefetchPolicy(extra_experts=extra))
    if extra and family == "deepseek_moe":  # its gate returns only its top-k: nothing to rank extra experts by
        with pytest.raises(ValueError, match="deepseek-moe block routing gives no router logits"):
            apply(model, gpu_budget=budget, config=config)
        assert all(not p.is_meta for _, _, p in expert_params(model))
        return
    with apply(model, gpu_budget=budget, config=config) as handle:
        fetched = one_token_steps()
        stats = handle.stats()
    # The plan's serving is independent of the cache, but Johnson's order (resident experts first) is not: the fp32
    # sum of a step's experts (6 of them for DeepSeek) runs in another order, which moves it by a few ulp.
    rel = ((fetched - plain).norm() / plain.norm()).item()
    assert rel <= 1e-6, rel
    assert stats["prefetches"] > 0 and stats["prefetch_bytes"] > 0
    assert stats["cache"]["peak_bytes"] <= budget


@pytest.mark.parametrize("family", FAMILIES)
def test_block_prediction_is_the_next_blocks_routing(family):
    from crisp_runtime.hf.blocks import BlockRoutePredictor

    model = make_model(family)
    refs = find_moe_blocks(model)
    k = model.config.num_experts_per_tok
    lacks_logits = family == "deepseek_moe"
    predictor = BlockRoutePredictor(refs, top_k=k, experts=k if lacks_logits else k + 1)
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))
    first, second = refs[0], refs[1]
    nxt, index, weights = predictor.predict_routing(first.layer_id, h)
    want_index, want_weights, want_logits = second.shape.route(second.module, h)
    assert nxt == second.layer_id and torch.equal(index, want_index.long())
    assert torch.equal(weights, want_weights.float())
    pred = predictor.predict(first.layer_id, h)
    assert torch.equal(pred[:, :k], want_index.long())
    if not lacks_logits:  # the extra expert: the best by router logit among those not routed
        rest = want_logits.float().scatter(1, want_index.long(), -float("inf"))
        assert torch.equal(pred[:, k], rest.argmax(dim=1))
    assert predictor.predict(refs[-1].layer_id, h) is None and predictor.predict_routing(refs[-1].layer_id, h) is None
    with pytest.raises(ValueError, match="experts: expected a count"):
        BlockRoutePredictor(refs, top_k=k, experts=k - 1)
