"""Dense layers with bf16 weights and fp32 activations (crisp_kernels.dense_bf16, RuntimeConfig(dense="bf16")).

The kernel against its float64 reference (``dense_bf16_ref``, the bf16 weight's exact values): 1e-6 in relative
norm over the (T, O) output, an fp32 dot per output (one rounding per term: ~H^0.5 x 2^-24 = 4e-6 at worst for
H = 4100 in the rare worst case, ~1e-7 typically, measured 0.9-1.1e-7); a weight changed by one bf16 step in one
element moves a 203-wide dot by ~2^-8 / 203^0.5 = 3e-4, far outside. Weights bf16 does not hold are refused (the
format never rounds them), and ``dense="bf16"`` keeps those layers as they are.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_cpu_native import NARROWER_BUILDS, narrower_kernel
from torch import nn

from crisp_kernels import cpu_native
from crisp_kernels.dense_bf16 import DenseBf16, bf16_exact, dense_bf16, dense_bf16_ref, pack_dense_bf16
from crisp_runtime.cpu.dense import Bf16Linear, DenseWeights, attention_linears, dense_linears, swap_dense

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernel does not build here")

ROOT = Path(__file__).resolve().parents[1]
OWN_TOL = 1e-6
# (O, H, bias): H = 203 and 4100 leave a scalar tail after the 8-wide vectors; O = 1, 7, 33 leave rows after the
# 4-row passes; (7, 2048) and (96, 256) are even
SHAPES = [(96, 256, True), (33, 203, False), (7, 2048, True), (1, 8, False), (5, 4100, True), (130, 64, False)]


def _packed(o, h, bias, seed=0) -> tuple[DenseBf16, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(o, h, generator=gen) / h**0.5).to(torch.bfloat16).float()  # a bf16 checkpoint in fp32
    b = torch.randn(o, generator=gen) if bias else None
    return pack_dense_bf16(w, b), w, b


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 4, 5, 64, 65, 130])
def test_equals_its_reference_and_the_fp32_layer(shape, tokens):
    packed, w, b = _packed(*shape)
    x = torch.randn(tokens, shape[1], generator=torch.Generator().manual_seed(tokens))
    got = dense_bf16(x, packed)
    assert got.dtype == torch.float32 and got.shape == (tokens, shape[0])
    assert rel(got, dense_bf16_ref(x, packed)) <= OWN_TOL
    fp32 = torch.nn.functional.linear(x, w, b)  # the layer it replaces: the same values, another summation order
    assert rel(got, fp32) <= 2 * OWN_TOL


def test_one_changed_weight_is_seen():
    packed, w, _ = _packed(33, 203, False)
    x = torch.randn(3, 203)
    bumped = w.clone()
    bumped[5, 100] = (bumped[5, 100].to(torch.bfloat16) + 2**-8).float()  # about one bf16 step of a 0.07 weight
    assert rel(dense_bf16(x, packed), dense_bf16_ref(x, pack_dense_bf16(bumped))) > 10 * OWN_TOL


def test_leading_dimensions_dtype_and_threads():
    packed, _, _ = _packed(*SHAPES[0])
    x = torch.randn(2, 3, SHAPES[0][1]).to(torch.bfloat16)
    got = dense_bf16(x, packed, threads=2)
    assert got.shape == (2, 3, SHAPES[0][0]) and got.dtype == torch.bfloat16
    assert torch.equal(got, dense_bf16(x, packed, threads=1))  # one row's dot per output: threads change nothing


# The portable C build sums each dot in one sequential fp32 chain, where the vector builds keep 8 partial sums: its
# error is nearer the module docstring's worst case (H^0.5 x 2^-24 = 3.8e-6 at H = 4100; measured up to 1.3e-6 over
# 40 inputs, against 3.7e-7 for AVX2), and still ~100x under a one-step change of one weight (3e-4).
SEQUENTIAL_TOL = 4e-6


@pytest.mark.parametrize("build", sorted(NARROWER_BUILDS))
def test_narrower_builds_equal_the_reference(tmp_path, build, monkeypatch):
    kernel = narrower_kernel(tmp_path, build)
    monkeypatch.setattr(cpu_native, "load", lambda: kernel)
    tol = SEQUENTIAL_TOL if kernel.vector_bits == 0 else OWN_TOL
    gen = torch.Generator().manual_seed(3)
    for shape in (SHAPES[1], SHAPES[4]):
        packed, _, _ = _packed(*shape)
        x = torch.randn(5, shape[1], generator=gen)
        assert rel(dense_bf16(x, packed), dense_bf16_ref(x, packed)) <= tol


def test_bad_inputs_are_refused():
    packed, w, _ = _packed(*SHAPES[0])
    assert bf16_exact(w) and not bf16_exact(w + 1e-4)
    with pytest.raises(ValueError, match="not every value is a bf16"):
        pack_dense_bf16(w + 1e-4)
    with pytest.raises(ValueError, match="bias"):
        pack_dense_bf16(w, bias=torch.randn(5))
    with pytest.raises(ValueError, match="float"):
        pack_dense_bf16(torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="x: expected"):
        dense_bf16(torch.randn(2, 100), packed)
    with pytest.raises(TypeError, match="DenseBf16"):
        dense_bf16(torch.randn(2, 256), "weights")
    kernel = cpu_native.load()
    with pytest.raises(ValueError, match="out"):
        kernel.dense_bf16(torch.randn(2, 256), packed.weight, torch.empty(3, 96), 1)
    with pytest.raises(ValueError, match="weight"):
        kernel.dense_bf16(torch.randn(2, 256), packed.weight.float(), torch.empty(2, 96), 1)


class _Attention(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=True)
        with torch.no_grad():
            for lin in (self.q_proj, self.o_proj):
                lin.weight.copy_(lin.weight.to(torch.bfloat16).float())


class TinyBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.self_attn = _Attention(h)
        self.mlp = nn.Linear(h, h)  # not attention's: left alone


def test_swap_keeps_weights_bf16_cannot_hold_and_restores_the_same_objects():
    torch.manual_seed(0)
    model = nn.Sequential(TinyBlock(100), TinyBlock(100))  # 100: no 4-bit group divides it; bf16 needs none
    with torch.no_grad():
        model[1].self_attn.o_proj.weight.add_(1e-4)  # no longer bf16 values: kept as it is
    before = {name: m for name, m in model.named_modules()}
    x = torch.randn(3, 100)
    with torch.no_grad():
        want = [lin(x) for _, _, lin in attention_linears(model)]
    swap = swap_dense(model, "bf16", threads=1)
    assert swap.info() == {"layers": 3, "bytes": swap.nbytes, "original_bytes": swap.original_nbytes, "kept": 1,
                           "chosen": "bf16", "shared_qkv": 0,  # only 8-bit blocks share q, k and v calls
                           "roles": {"attention": 3}, "role_bytes": {"attention": swap.nbytes}}
    assert swap.nbytes < 0.6 * swap.original_nbytes
    layers = attention_linears(model)  # nn.Linear only: the kept one
    assert [name for _, name, _ in layers] == ["o_proj"] and layers[0][0] is model[1].self_attn
    assert isinstance(model[0].self_attn.q_proj, Bf16Linear) and type(model[0].mlp) is nn.Linear
    with torch.no_grad():
        got = [model[0].self_attn.q_proj(x), model[0].self_attn.o_proj(x), model[1].self_attn.q_proj(x)]
    for g, w in zip(got, [want[0], want[1], want[2]], strict=True):
        assert rel(g, w) <= 2 * OWN_TOL
    swap.restore()
    assert {name: m for name, m in model.named_modules()} == before


def test_auto_takes_q8_or_bf16_where_it_can_and_otherwise_replaces_nothing(monkeypatch):
    torch.manual_seed(1)
    model = nn.Sequential(TinyBlock(64))
    swap = swap_dense(model, "auto", threads=1)  # the CPU experts' default 8-bit activations: Q8_0 attention
    assert swap.info()["chosen"] == "q8" and swap.info()["layers"] == 2 and "8-bit" in swap.info()["reason"]
    swap.restore()
    swap = swap_dense(model, "auto", threads=1, exact_reason="exact experts")  # the caller asks exact attention
    assert swap.info()["chosen"] == "bf16" and swap.info()["layers"] == 2
    assert swap.info()["reason"] == "exact experts: bf16, exact"
    swap.restore()
    # in_features off the 8-bit blocks of 32: those layers alone in bf16, which needs no blocks
    odd = nn.Sequential(TinyBlock(64), TinyBlock(100))
    swap = swap_dense(odd, "auto")
    assert swap.info()["chosen"] == "q8" and swap.info()["layers"] == 4
    assert "2 with in_features [100], not a multiple of the 8-bit block 32, in bf16" in swap.info()["reason"]
    kinds = [type(m).__name__ for block in odd for m in block.self_attn.children()]
    assert kinds == ["Int8Linear"] * 2 + ["Bf16Linear"] * 2
    swap.restore()
    fp32 = nn.Sequential(TinyBlock(64))
    with torch.no_grad():
        for _, _, lin in attention_linears(fp32):
            lin.weight.add_(1e-4)  # an fp32-trained model: bf16 holds none of its weights
    swap = swap_dense(fp32, "auto", exact_reason="exact experts")
    assert swap.info()["layers"] == 0 and swap.info()["kept"] == 2
    swap = swap_dense(fp32, "auto")  # Q8 rounds any weight
    assert swap.info()["layers"] == 2 and swap.info()["kept"] == 0
    swap.restore()
    none = swap_dense(nn.Sequential(nn.Linear(8, 8)), "auto")  # where "bf16" or "q4" would refuse
    assert none.info()["chosen"] == "keep" and "no nn.Linear" in none.info()["reason"]
    monkeypatch.setattr(cpu_native, "available", lambda: False)
    unbuilt = swap_dense(model, "auto")
    assert unbuilt.info()["chosen"] == "keep" and "does not build" in unbuilt.info()["reason"]
    assert all(type(m) is nn.Linear for _, _, m in attention_linears(model)) and len(attention_linears(model)) == 2


def test_without_keep_original_the_fp32_weights_are_freed_and_restored_exactly():
    torch.manual_seed(2)
    model = nn.Sequential(TinyBlock(64))
    linears = [lin for _, _, lin in attention_linears(model)]
    values = [lin.weight.detach().clone() for lin in linears]
    swap = swap_dense(model, "bf16", keep_original=False)
    assert all(lin.weight.numel() == 0 for lin in linears)  # freed while applied
    biases = sum(lin.bias.nbytes for lin in linears if lin.bias is not None)
    assert swap.original_nbytes == sum(v.nbytes for v in values) + biases  # counted before they were freed
    swap.restore()
    assert [lin for _, _, lin in attention_linears(model)] == linears
    assert all(torch.equal(lin.weight, v) and lin.weight.dtype == torch.float32
               for lin, v in zip(linears, values, strict=True))


@pytest.mark.parametrize("dense", ["bf16", "q4", "q8"])
def test_state_dict_while_swapped_is_the_models_own(dense):
    """save_pretrained while applied writes the original attention weights, never none or rounded ones."""
    torch.manual_seed(3)
    model = nn.Sequential(TinyBlock(128), TinyBlock(128))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    linears = [lin for _, _, lin in attention_linears(model)]
    swap = swap_dense(model, dense, keep_original=False)  # bf16-valued fp32 originals freed: rebuilt exactly
    assert all(lin.weight.numel() == 0 for lin in linears)
    got = model.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    swap.restore()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_runtime_config_takes_bf16():
    from crisp_runtime import RuntimeConfig

    assert RuntimeConfig(dense="bf16").dense is DenseWeights.BF16


def tiny_model(name: str = "tiny-mixtral"):
    """A committed tiny model in fp32 and its pack's folder (skips where transformers or the model is absent)."""
    transformers = pytest.importorskip("transformers")
    if not (ROOT / "models" / name / "config.json").is_file():
        pytest.skip("committed tiny model absent")
    model = transformers.AutoModelForCausalLM.from_pretrained(ROOT / "models" / name, dtype=torch.float32).eval()
    return model, ROOT / "models" / f"{name}-crisp"


def tiny_mixtral():
    """The committed tiny Mixtral in fp32 and its pack's folder."""
    return tiny_model("tiny-mixtral")


def test_apply_with_dense_bf16_gives_the_fp32_models_logits():
    from crisp_runtime import RuntimeConfig, apply
    from crisp_runtime.cpu.experts import EXACT

    model, pack = tiny_mixtral()
    linears = [m for _, _, m, _ in dense_linears(model)]  # attention's and the lm head
    ids = torch.arange(3, 35).unsqueeze(0)
    config = RuntimeConfig(dense="bf16")
    # the committed checkpoint is fp32 (trained here): bf16 holds none of its dense weights, all are kept
    with apply(model, pack, serving="cpu_only", cpu="on", gpu_budget="64MiB", config=config) as handle:
        info = handle.stats()["dense"]
        assert info["weights"] == "bf16" and info["layers"] == 0 and info["kept"] == len(linears)
    with torch.no_grad():  # as a bf16 checkpoint loaded in fp32 would be: every weight a bf16 value
        for m in linears:
            m.weight.copy_(m.weight.to(torch.bfloat16).float())
    runs = {}
    for dense in ("keep", "bf16"):
        # exact fp32 experts: the q8 kernel's 8-bit activations would turn the attention's last-bit differences
        # into whole rounding steps (measured 4.8e-4 relative on the logits with them)
        config = RuntimeConfig(dense=dense, cpu_experts=EXACT)
        with apply(model, pack, serving="cpu_only", cpu="on", gpu_budget="64MiB", config=config) as handle:
            if dense == "bf16":
                info = handle.stats()["dense"]
                assert info["layers"] == len(linears) and info["kept"] == 0
                assert sum(isinstance(m, Bf16Linear) for m in model.modules()) == len(linears)
            with torch.no_grad():
                runs[dense] = model(input_ids=ids).logits
    # the same weights, another summation order in the dense layers (the experts' path is the same in both runs)
    assert rel(runs["bf16"], runs["keep"]) < 1e-5
    assert [m for _, _, m, _ in dense_linears(model)] == linears  # the same objects back
