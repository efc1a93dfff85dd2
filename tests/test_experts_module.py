"""CrispExperts: the transformers v5 experts contract over packed experts at per-expert widths."""

import pytest
import torch

import crisp_kernels.experts_module as experts_module
from crisp_kernels import CrispExperts, QuantFormat, dequantize_expert, dequantize_layer, pack_layer

E, H, I, TOP_K = 4, 128, 48, 2
FP32_TOL = 1e-5  # as in test_expert_mlp.py: fp32 output, fp32 accumulation
BF16_TOL = 2 * 2.0**-8  # output rounding (<= u) plus margin, see test_expert_mlp.py


def _dense(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5)


def _layer(symmetric=False, permuted=True):
    gate_up, down = _dense()
    gen = torch.Generator().manual_seed(1)
    order = torch.stack([torch.randperm(I, generator=gen) for _ in range(E)]) if permuted else None
    return pack_layer(gate_up, down, QuantFormat(group_size=32, symmetric=symmetric), neuron_order=order)


def _routing(num_tokens, device, seed=2, invalid=True):
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, TOP_K, generator=gen), dim=-1)
    if invalid and num_tokens > 1:
        index[1, 1] = E  # a dropped slot, as transformers' routers mark it
    return index.to(device), weights.to(device)


def _reference(module, x, index, weights, token_widths=None):
    """A plain float64 loop over tokens and routed slots, each expert dequantized."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(index.shape[1]):
            e = int(index[t, s])
            if not 0 <= e < module.num_experts:
                continue
            width = module.widths[e]
            if token_widths is not None:
                width = max(0, min(width, int(token_widths[t, s])))
            gate, up, down = dequantize_expert(module.expert(e).to("cpu"), width, dtype=torch.float64)
            xt = x[t].cpu().double()
            h = torch.nn.functional.silu(gate @ xt) * (up @ xt)
            out[t] += float(weights[t, s]) * (down @ h)
    return out


def _check(out, ref, tol):
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_matches_loop_over_dequantized_experts(device, kernel_backend, symmetric):
    module = CrispExperts(_layer(symmetric), widths=[I, 20, 0, 33], backend=kernel_backend).to(device)
    x = torch.randn(6, H).to(device)
    index, weights = _routing(6, device)
    out = module(x, index, weights)
    assert out.shape == x.shape and out.dtype == x.dtype
    _check(out, _reference(module, x, index, weights), FP32_TOL)


def test_per_token_widths(device, kernel_backend):
    module = CrispExperts(_layer(), widths=[I, 40, 30, 20], backend=kernel_backend).to(device)
    x = torch.randn(20, H).to(device)  # 20 tokens: some experts get > 16 (the prefill path)
    index, weights = _routing(20, device, seed=3)
    gen = torch.Generator().manual_seed(4)
    token_widths = torch.randint(-3, I + 10, (20, TOP_K), generator=gen).to(device)
    ref = _reference(module, x, index, weights, token_widths)
    _check(module(x, index, weights, token_widths=token_widths), ref, FP32_TOL)
    # the same widths from a token_width_fn
    module.token_width_fn = lambda idx, w: token_widths
    _check(module(x, index, weights), ref, FP32_TOL)
    assert not torch.allclose(module(x, index, weights, token_widths=torch.full_like(token_widths, I)).cpu().double(),
                              ref.float().double(), rtol=1e-3)  # fmt: skip


def test_bf16_activations(device, kernel_backend):
    module = CrispExperts(_layer(), widths=[I, 24, 12, I], backend=kernel_backend).to(device)
    x = torch.randn(5, H).to(torch.bfloat16).to(device)
    index, weights = _routing(5, device, seed=5)
    out = module(x, index, weights.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    _check(out, _reference(module, x, index, weights.to(torch.bfloat16)), BF16_TOL)


def test_matches_transformers_mixtral_experts():
    """Full widths: the same function as transformers' eager MixtralExperts on the dequantized
    weights (in their original neuron order), whatever order the pack stores them in."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=TOP_K)
    layer = _layer(permuted=True)
    reference = MixtralExperts(config)
    gate_up, down = dequantize_layer(layer)
    with torch.no_grad():
        reference.gate_up_proj.copy_(gate_up)
        reference.down_proj.copy_(down)
    x = torch.randn(7, H)
    index, weights = _routing(7, "cpu", seed=6)
    expected = reference(x, index, weights)
    for module in (CrispExperts(layer), CrispExperts.from_dense(*_dense(), QuantFormat(group_size=32))):
        out = module(x, index, weights)  # default backend: the interpreter under the test env
        err = ((out - expected).norm() / expected.norm()).item()
        assert err <= FP32_TOL, err


def test_runs_only_experts_that_are_hit(monkeypatch):
    calls = []
    real = experts_module.expert_mlp_accumulate_

    def spy(out, x, packed, width, **kwargs):
        calls.append((packed.qweight.data_ptr(), width, kwargs["rows"].tolist()))
        return real(out, x, packed, width, **kwargs)

    monkeypatch.setattr(experts_module, "expert_mlp_accumulate_", spy)
    module = CrispExperts(_layer(), widths=[I, 0, I, I])
    x = torch.randn(3, H)
    index = torch.tensor([[0, 1], [1, 7], [0, -1]])  # expert 1 has width 0; 7 and -1 are not experts
    weights = torch.ones(3, 2)
    out = module(x, index, weights)
    assert calls == [(module.expert(0).qweight.data_ptr(), I, [0, 2])]
    _check(out, _reference(module, x, index, weights), FP32_TOL)
    calls.clear()
    assert torch.count_nonzero(module(x, torch.full((3, 2), E), weights)) == 0
    assert calls == []


def test_buffers_follow_device_but_not_dtype():
    module = CrispExperts(_layer())
    scales = module.scales.clone()
    names = {name for name, _ in module.named_buffers()}
    assert names == {"qweight", "scales", "zeros", "neuron_order"}
    module.to(torch.bfloat16)
    module.half()
    module.float()
    assert module.scales.dtype == torch.float16 and torch.equal(module.scales, scales)
    meta = module.to("meta")
    assert all(b.device.type == "meta" for b in meta.buffers())
    assert meta.scales.dtype == torch.float16
    sym = CrispExperts(_layer(symmetric=True)).to(torch.float16)
    assert sym.zeros is None and sym.layer.fmt.symmetric
    assert "widths=[48, 48, 48, 48]" in repr(sym)


def test_state_dict_round_trip():
    module = CrispExperts(_layer(), widths=[1, 2, 3, 4])
    other = CrispExperts(_layer(symmetric=False, permuted=False))
    other.load_state_dict(module.state_dict())
    for name, buf in module.named_buffers():
        assert torch.equal(getattr(other, name), buf)


def test_widths_validation():
    layer = _layer()
    module = CrispExperts(layer, widths=torch.tensor([1, 2, 3, 4]))
    assert module.widths == (1, 2, 3, 4)
    with pytest.raises(ValueError, match="widths: expected 4 values"):
        CrispExperts(layer, widths=[1, 2])
    with pytest.raises(ValueError, match=r"widths\[2\]=49 is out of range"):
        CrispExperts(layer, widths=[1, 2, 49, 3])
    with pytest.raises(TypeError, match=r"widths\[0\]: expected an int"):
        CrispExperts(layer, widths=[1.5, 2, 3, 4])
    with pytest.raises(ValueError, match="widths: expected a 1-D integer tensor"):
        CrispExperts(layer, widths=torch.ones(4))
    with pytest.raises(TypeError, match="layer: expected a PackedLayer"):
        CrispExperts({"qweight": layer.qweight})


def test_routing_validation():
    module = CrispExperts(_layer())
    x = torch.randn(3, H)
    index, weights = _routing(3, "cpu")
    with pytest.raises(ValueError, match=r"hidden_states: expected \(T, H=128\)"):
        module(x[:, :64], index, weights)
    with pytest.raises(ValueError, match=r"top_k_index: expected \(T=3, k\)"):
        module(x, index[:2], weights)
    with pytest.raises(ValueError, match="top_k_index: expected an integer tensor"):
        module(x, index.float(), weights)
    with pytest.raises(ValueError, match="top_k_weights: expected shape"):
        module(x, index, weights[:, :1])
    with pytest.raises(ValueError, match=r"token_widths: expected an integer tensor of shape \(3, 2\)"):
        module(x, index, weights, token_widths=torch.ones(3))


@pytest.mark.parametrize("needs_grad", ["hidden_states", "top_k_weights", "both"])
def test_backward_is_refused_and_the_forward_unchanged(needs_grad):
    module = CrispExperts(_layer())
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(3))
    index, weights = _routing(6, "cpu")
    with torch.no_grad():
        expected = module(x, index, weights)
    x = x.clone().requires_grad_(needs_grad in ("hidden_states", "both"))
    weights = weights.clone().requires_grad_(needs_grad in ("top_k_weights", "both"))
    out = module(x, index, weights)  # grad mode on: the forward runs as under no_grad
    assert out.requires_grad and torch.equal(out.detach(), expected)
    with pytest.raises(RuntimeError, match="CrispExperts experts do not support gradients.*router"):
        out.sum().backward()


def test_no_autograd_node_without_inputs_that_need_grad():
    module = CrispExperts(_layer())
    index, weights = _routing(3, "cpu")
    out = module(torch.randn(3, H), index, weights)
    assert not out.requires_grad and out.grad_fn is None
