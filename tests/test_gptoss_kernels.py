"""gpt-oss's expert math in the packed format and the kernels: per-neuron gate/up biases, a per-expert
down bias and the clamped SwiGLU, against a float64 reference on the same packed weights.

The reference's activation is itself checked against transformers' ``GptOssExperts._apply_gate``
(the source of truth), and the layout conversion against ``GptOssExperts.forward`` on dequantized
weights, so a wrong clamp, alpha or de-interleave fails here rather than agreeing with itself.
Tolerances are those of tests/test_expert_mlp.py (fp32 1e-5; fp16 / bf16 2u of the output dtype).
Pre-activations are scaled (x ~ N(0, 9)) so that both clamps at limit 7 are hit.
"""

import pytest
import torch

import crisp_kernels.expert_mlp_triton as kernels
from crisp_kernels import (
    GPT_OSS_SWIGLU,
    SILU_GLU,
    Activation,
    ActivationKind,
    CrispExperts,
    expert_mlp,
    expert_mlp_accumulate_,
    expert_mlp_ref,
    gpt_oss_to_v5,
    layer_biases,
    load_packed,
    pack_layer,
    save_packed,
)
from crisp_kernels.format import apply_activation, dequantize_layer
from crisp_kernels.io import ACTIVATION_KEY, HAS_BIAS_KEY, read_packed_metadata

FP32_TOL = 1e-5
HALF_TOL = {torch.float16: 2 * 2.0**-11, torch.bfloat16: 2 * 2.0**-8}
HIDDEN, INTER, EXPERTS = 128, 72, 3  # I = 72: not a multiple of any block (16, 32, 64)


def rel_err(out, ref) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def gpt_oss_layer(seed=0, experts=EXPERTS, inter=INTER, hidden=HIDDEN, order=None):
    """A layer in gpt-oss's own layout (interleaved, transposed, biased), and its pack."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, hidden, 2 * inter, generator=gen) / hidden**0.5 * 3
    gate_up_bias = torch.randn(experts, 2 * inter, generator=gen)
    down = torch.randn(experts, inter, hidden, generator=gen) / inter**0.5
    down_bias = torch.randn(experts, hidden, generator=gen)
    raw = (gate_up, gate_up_bias, down, down_bias)
    gu, gub, dn, db = gpt_oss_to_v5(*raw)
    return raw, pack_layer(gu, dn, neuron_order=order, gate_up_bias=gub, down_bias=db, activation=GPT_OSS_SWIGLU)


def make_x(num_tokens, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype).to(device)


@pytest.fixture(scope="module")
def layer():
    return gpt_oss_layer()[1]


def _gpt_oss_experts(num_experts=2, inter=8, hidden=16):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts)
    return GptOssExperts(config), config


def test_activation_is_transformers_apply_gate():
    module, config = _gpt_oss_experts()
    assert (GPT_OSS_SWIGLU.alpha, GPT_OSS_SWIGLU.limit) == (module.alpha, module.limit) == (1.702, config.swiglu_limit)
    gate_up = torch.randn(40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 10
    assert (gate_up[:, ::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any()  # both clamps are exercised
    expected = module._apply_gate(gate_up)
    got = apply_activation(gate_up[:, ::2], gate_up[:, 1::2], GPT_OSS_SWIGLU)
    assert torch.equal(got, expected)


def test_pack_matches_gpt_oss_forward_on_dequantized_weights():
    """De-interleave + transpose + biases: GptOssExperts.forward with the pack's dequantized weights
    (put back into gpt-oss's layout) equals the reference over the pack, expert by expert."""
    module, _ = _gpt_oss_experts(num_experts=EXPERTS, inter=INTER, hidden=HIDDEN)
    order = torch.stack([torch.randperm(INTER, generator=torch.Generator().manual_seed(e)) for e in range(EXPERTS)])
    _, layer = gpt_oss_layer(order=order)
    gate_up, down = dequantize_layer(layer, torch.float64)  # (E, 2I, H), (E, H, I) original order
    gate_up_bias, down_bias = layer_biases(layer)
    interleaved = torch.empty(EXPERTS, HIDDEN, 2 * INTER, dtype=torch.float64)
    interleaved[..., 0::2], interleaved[..., 1::2] = gate_up[:, :INTER].mT, gate_up[:, INTER:].mT
    bias = torch.empty(EXPERTS, 2 * INTER, dtype=torch.float64)
    bias[:, 0::2], bias[:, 1::2] = gate_up_bias[:, :INTER], gate_up_bias[:, INTER:]
    module = module.double()
    with torch.no_grad():
        module.gate_up_proj.copy_(interleaved)
        module.gate_up_proj_bias.copy_(bias)
        module.down_proj.copy_(down.mT)
        module.down_proj_bias.copy_(down_bias)
    x = make_x(6, torch.float64, "cpu")
    for e in range(EXPERTS):
        index = torch.full((6, 1), e)
        eager = module(x, index, torch.ones(6, 1, dtype=torch.float64))
        ref = expert_mlp_ref(x, layer.expert(e), compute_dtype=torch.float64)
        assert rel_err(ref, eager) <= 1e-12


@pytest.mark.parametrize("num_tokens", [1, 5, 17])
def test_widths_match_reference(device, kernel_backend, layer, num_tokens):
    packed = layer.expert(1).to(device)
    x = make_x(num_tokens, torch.float32, device) * 3
    bn = kernels.select_config(num_tokens).block_n
    for width in (0, 1, bn - 1, bn + 1, INTER):
        out = expert_mlp(x, packed, width, backend=kernel_backend)
        ref = expert_mlp_ref(x, packed, width, compute_dtype=torch.float64)
        if width == 0:  # an expert at width 0 is not run: nothing, not its down bias
            assert torch.count_nonzero(out) == 0
        else:
            assert rel_err(out, ref) <= FP32_TOL, width


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens", [3, 17])
def test_dtypes(device, kernel_backend, layer, dtype, num_tokens):
    packed = layer.expert(0).to(device)
    x = make_x(num_tokens, dtype, device)
    out = expert_mlp(x, packed, 50, backend=kernel_backend)
    assert out.dtype == dtype
    assert rel_err(out, expert_mlp_ref(x, packed, 50, compute_dtype=torch.float64)) <= HALF_TOL[dtype]


@pytest.mark.parametrize("num_tokens, split", [(4, 3), (20, 2)], ids=["decode-split3", "prefill-split2"])
def test_down_bias_added_once_with_token_widths(device, kernel_backend, layer, num_tokens, split):
    """Split-K over neurons (several programs add into one output) adds the down bias once; a token
    at width 0 gets nothing, a token at width >= 1 the whole down bias."""
    if kernel_backend.value == "torch":
        pytest.skip("the stage-2 split exists in the Triton kernels only")
    packed = layer.expert(2).to(device)
    x = make_x(num_tokens, torch.float32, device) * 3
    token_widths = torch.randint(0, INTER + 5, (num_tokens,), generator=torch.Generator().manual_seed(num_tokens))
    token_widths[0], token_widths[1] = 0, 1
    token_widths = token_widths.to(device)
    plan = kernels.make_plan(kernels.select_config(num_tokens), INTER, split)
    assert plan.split > 1
    out = kernels.expert_mlp_triton(x, packed, INTER, token_widths, plan=plan)
    ref = expert_mlp_ref(x, packed, INTER, token_widths=token_widths, compute_dtype=torch.float64)
    assert torch.count_nonzero(out[0]) == 0
    assert rel_err(out, ref) <= FP32_TOL
    rows = torch.arange(num_tokens, device=device)
    weights = torch.rand(num_tokens, generator=torch.Generator().manual_seed(7)).to(device)
    acc = torch.zeros(num_tokens, HIDDEN, device=device)
    kernels.expert_mlp_accumulate_triton_(acc, x, packed, INTER, rows, weights, token_widths, plan=plan)
    assert rel_err(acc, ref * weights.double()[:, None]) <= FP32_TOL


@pytest.mark.parametrize("num_tokens", [3, 18])
def test_accumulate_and_prefix_copy(device, kernel_backend, layer, num_tokens):
    """A width-k call on an exact copy of the k-neuron prefix (biases included) equals the call on the
    full expert bit for bit: nothing past row k (of qweight, scales, zeros or bias) is read."""
    full = layer.expert(0).to(device)
    width = 37
    prefix = full.prefix(width)
    exact = type(prefix)(prefix.fmt, *(None if t is None else t.clone() for t in
                                       (prefix.qweight, prefix.scales, prefix.zeros, prefix.bias)),
                         prefix.down_bias.clone(), prefix.activation)  # fmt: skip
    x = make_x(40, torch.float32, device) * 3
    rows = torch.randperm(40, generator=torch.Generator().manual_seed(1))[:num_tokens].to(device)
    weights = torch.rand(num_tokens, generator=torch.Generator().manual_seed(2)).to(device)
    outs = []
    for packed in (full, exact):
        out = torch.zeros(40, HIDDEN, device=device)
        expert_mlp_accumulate_(out, x, packed, width, rows=rows, weights=weights, backend=kernel_backend)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    ref = torch.zeros(40, HIDDEN, dtype=torch.float64, device=device).index_add(
        0, rows, expert_mlp_ref(x[rows], full, width, compute_dtype=torch.float64) * weights.double()[:, None])
    assert rel_err(outs[0], ref) <= FP32_TOL


def test_ops_take_biases_and_activation(layer):
    packed = layer.expert(1)
    x = make_x(4, torch.float32, "cpu")
    act = packed.activation
    out = torch.ops.crisp.expert_mlp(x, packed.qweight, packed.scales, packed.zeros, 64, 30, None, packed.bias,
                                     packed.down_bias, act.kind.value, act.alpha, act.limit)
    assert torch.equal(out, expert_mlp(x, packed, 30))
    silu = torch.ops.crisp.expert_mlp(x, packed.qweight, packed.scales, packed.zeros, 64, 30, None)
    assert not torch.allclose(silu, out)  # the defaults are the SiLU family's: no biases, silu(gate) * up


def test_crisp_experts_carry_biases(layer):
    module = CrispExperts(layer)
    assert module.layer.activation == GPT_OSS_SWIGLU and torch.equal(module.layer.bias, layer.bias)
    x = make_x(5, torch.float32, "cpu")
    index = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 1], [2, 2]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(0))
    out = module(x, index, weights)
    ref = torch.stack([sum(expert_mlp_ref(x[t:t + 1], layer.expert(int(index[t, s])), compute_dtype=torch.float64)[0]
                           * weights[t, s].double() for s in range(2)) for t in range(5)])
    assert rel_err(out, ref) <= FP32_TOL


def test_save_load_round_trip(tmp_path, layer):
    path = tmp_path / "experts.safetensors"
    save_packed(path, {0: layer, 3: layer})
    meta = read_packed_metadata(path)
    assert meta[HAS_BIAS_KEY] == "true" and ACTIVATION_KEY in meta
    loaded = load_packed(path)[3]
    assert loaded.activation == GPT_OSS_SWIGLU
    for name, t in layer.tensors().items():
        assert torch.equal(getattr(loaded, name), t), name


def test_silu_packs_unchanged(tmp_path):
    """A pack without biases writes no new metadata and loads as SiLU GLU without biases."""
    gen = torch.Generator().manual_seed(0)
    layer = pack_layer(torch.randn(2, 32, 64, generator=gen), torch.randn(2, 64, 16, generator=gen))
    assert layer.bias is None and layer.down_bias is None and layer.activation == SILU_GLU
    path = tmp_path / "silu.safetensors"
    save_packed(path, {0: layer})
    meta = read_packed_metadata(path)
    assert HAS_BIAS_KEY not in meta and ACTIVATION_KEY not in meta
    loaded = load_packed(path)[0]
    assert loaded.bias is None and loaded.activation == SILU_GLU


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: Activation(ActivationKind.GPT_OSS_CLAMPED_SWIGLU, 1.702, None), ValueError, "limit"),
        (lambda: Activation(ActivationKind.GPT_OSS_CLAMPED_SWIGLU, float("nan"), 7.0), ValueError, "alpha"),
        (lambda: Activation(ActivationKind.SILU_GLU, 1.0, None), ValueError, "SILU_GLU takes no"),
        (lambda: Activation("silu_glu"), TypeError, "ActivationKind"),
    ],
)
def test_bad_activation(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_bad_biases(layer):
    with pytest.raises(ValueError, match="come together"):
        type(layer)(layer.fmt, layer.qweight, layer.scales, layer.zeros, layer.neuron_order, layer.bias, None,
                    layer.activation)
    with pytest.raises(ValueError, match=r"bias: expected torch.float32 of shape \(3, 72, 2\)"):
        type(layer)(layer.fmt, layer.qweight, layer.scales, layer.zeros, layer.neuron_order, layer.bias.half(),
                    layer.down_bias, layer.activation)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="both or neither"):
        pack_layer(torch.randn(1, 8, 64, generator=gen), torch.randn(1, 64, 4, generator=gen),
                   gate_up_bias=torch.zeros(1, 8))
    with pytest.raises(ValueError, match=r"down_proj: expected gpt-oss's \(1, 4, 64\)"):
        gpt_oss_to_v5(torch.zeros(1, 64, 8), torch.zeros(1, 8), torch.zeros(1, 64, 4), torch.zeros(1, 64))
