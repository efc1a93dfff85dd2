"""Dense layers in 4-bit rows with 8-bit activations (crisp_kernels.dense_q8, crisp_runtime.cpu.dense).

The kernel against its float64 reference of the same quantized arithmetic (``dense_q8_ref``): 1e-5 in relative
norm over the (T, O) output (fp32 accumulation of one fp32 term per 32 elements of H); against the fp32 weights
it carries the 4-bit weights' rounding (a few percent on random Gaussian weights), far from an unrelated
result's ~1.4. ``RuntimeConfig(dense="q4")``: attention's linear layers (and the lm head, in 8-bit blocks)
replaced while applied, the same objects back after ``restore()``.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_native import NARROWER_BUILDS, narrower_kernel
from torch import nn

from crisp_kernels import QuantFormat, cpu_native
from crisp_kernels.dense_q8 import DenseQ4, dense_q8, dense_q8_ref, pack_dense
from crisp_runtime.cpu.dense import DenseWeights, Int8Linear, Q4Linear, attention_linears, swap_dense

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernel does not build here")

OWN_TOL = 1e-5
# (O, H, group, symmetric, bias): H / 2 = 48 and 80 bytes leave the kernel's 16-byte tail; O odd; group 64 at
# one token reduces 128 bytes of a row at a time, then 32-byte steps (H = 448: one chunk and three steps)
SHAPES = [(96, 256, 64, False, True), (33, 96, 32, False, False), (50, 160, 32, True, True),
          (130, 384, 128, False, False), (7, 2048, 64, True, True), (11, 448, 64, False, False)]


def _packed(o, h, group, symmetric, bias, seed=0) -> tuple[DenseQ4, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(o, h, generator=gen) / h**0.5
    b = torch.randn(o, generator=gen) if bias else None
    return pack_dense(w, QuantFormat(group_size=group, symmetric=symmetric), b), w, b


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 9, 64, 65, 130])
def test_equals_its_reference_and_is_near_the_fp32_layer(shape, tokens):
    packed, w, b = _packed(*shape)
    x = torch.randn(tokens, shape[1], generator=torch.Generator().manual_seed(tokens))
    got = dense_q8(x, packed)
    assert got.dtype == torch.float32 and got.shape == (tokens, shape[0])
    assert rel(got, dense_q8_ref(x, packed)) <= OWN_TOL
    fp32 = x @ w.t() + (0 if b is None else b)
    assert 1e-3 < rel(got, fp32) < 0.2  # 4-bit weights and 8-bit activations: rounded, not wrong


def test_leading_dimensions_dtype_and_threads():
    packed, _, _ = _packed(*SHAPES[0])
    x = torch.randn(2, 3, SHAPES[0][1]).to(torch.bfloat16)
    got = dense_q8(x, packed, threads=2)
    assert got.shape == (2, 3, SHAPES[0][0]) and got.dtype == torch.bfloat16
    one = dense_q8(x, packed, threads=1)
    assert torch.equal(got, one)  # one row's dot per output: the thread count changes nothing


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_token_with_inf_or_nan_gets_nan_and_the_others_are_untouched(bad):
    """The 8-bit code of inf / nan would be a C cast's undefined value: the token's outputs are nan instead (the
    fp32 layer's are non-finite too), never finite numbers."""
    packed, _, _ = _packed(*SHAPES[2])  # H / 2 = 80 bytes: one 32-byte vector step, then the 16-byte tail
    x = torch.randn(3, SHAPES[2][1])
    clean = dense_q8(x, packed)
    for h in (3, SHAPES[2][1] - 1):
        bent = x.clone()
        bent[1, h] = bad
        got = dense_q8(bent, packed)
        assert torch.isnan(got[1]).all() and torch.equal(got[[0, 2]], clean[[0, 2]])


@pytest.mark.parametrize("build", sorted(NARROWER_BUILDS))
def test_narrower_builds_equal_the_reference(tmp_path, build, monkeypatch):
    kernel = narrower_kernel(tmp_path, build)
    monkeypatch.setattr(cpu_native, "load", lambda: kernel)
    for shape in (SHAPES[0], SHAPES[2]):
        packed, _, _ = _packed(*shape)
        x = torch.randn(5, shape[1])
        assert rel(dense_q8(x, packed), dense_q8_ref(x, packed)) <= OWN_TOL


def test_bad_inputs_are_refused():
    packed, _, _ = _packed(*SHAPES[0])
    with pytest.raises(ValueError, match="x: expected"):
        dense_q8(torch.randn(2, 100), packed)
    with pytest.raises(TypeError, match="DenseQ4"):
        dense_q8(torch.randn(2, 256), "weights")
    with pytest.raises(ValueError, match="in_features"):
        pack_dense(torch.randn(4, 100))
    with pytest.raises(ValueError, match="bias"):
        pack_dense(torch.randn(4, 64), bias=torch.randn(5))
    kernel = cpu_native.load()
    with pytest.raises(ValueError, match="out"):
        kernel.dense_q8(torch.randn(2, 256), packed.qweight, packed.scales, packed.zeros, 64, torch.empty(3, 96), 1)


class _Attention(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=True)
        self.scale = nn.Parameter(torch.ones(h))


class _Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.self_attn = _Attention(h)
        self.mlp = nn.Linear(h, h)  # not attention's: left alone


def test_swap_replaces_attention_linears_and_restores_the_same_objects():
    torch.manual_seed(0)
    model = nn.Sequential(_Block(128), _Block(128))
    before = {name: m for name, m in model.named_modules()}
    assert len(attention_linears(model)) == 4
    assert swap_dense(model, DenseWeights.KEEP) is None
    swap = swap_dense(model, "q4", threads=1)
    assert swap.info()["layers"] == 4 and swap.nbytes < swap.original_nbytes / 4
    attn = model[0].self_attn
    assert isinstance(attn.q_proj, Q4Linear) and isinstance(attn.o_proj, Q4Linear) and type(model[0].mlp) is nn.Linear
    x = torch.randn(3, 128)
    assert rel(attn.o_proj(x), dense_q8_ref(x, attn.o_proj.packed)) <= OWN_TOL
    swap.restore()
    swap.restore()  # idempotent
    assert {name: m for name, m in model.named_modules()} == before


def test_a_q4_linear_without_its_original_refuses_to_be_saved():
    packed, _, _ = _packed(*SHAPES[0])
    with pytest.raises(RuntimeError, match="restore"):
        Q4Linear(packed).state_dict()


def test_swap_refuses_before_replacing_anything():
    model = nn.Sequential(_Block(128))
    model[0].self_attn.o_proj = nn.Linear(100, 128)  # 100 is no multiple of 64
    with pytest.raises(ValueError, match="in_features 100"):
        swap_dense(model, "q4")
    assert type(model[0].self_attn.q_proj) is nn.Linear
    with pytest.raises(ValueError, match="no nn.Linear"):
        swap_dense(nn.Sequential(nn.Linear(64, 64)), "q4")
    with pytest.raises(ValueError):
        swap_dense(model, "int3")


def test_runtime_config_dense_is_checked():
    from crisp_runtime import RuntimeConfig

    assert RuntimeConfig(dense="q4").dense is DenseWeights.Q4 and RuntimeConfig().dense is DenseWeights.AUTO
    with pytest.raises(ValueError, match="RuntimeConfig.dense"):
        RuntimeConfig(dense="int3")


def test_apply_with_dense_q4_swaps_attention_and_restore_puts_it_back():
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    from crisp_runtime import RuntimeConfig, apply

    root = Path(__file__).resolve().parents[1]
    if not (root / "models" / "tiny-mixtral" / "config.json").is_file():
        pytest.skip("committed tiny model absent")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "models" / "tiny-mixtral",
                                                              dtype=torch.float32).eval()
    originals = {id(m) for _, _, m in attention_linears(model)}
    head = model.lm_head
    ids = torch.arange(3, 35).unsqueeze(0)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    config = RuntimeConfig(dense="q4")
    with apply(model, root / "models" / "tiny-mixtral-crisp", serving="cpu_only", cpu="on", gpu_budget="64MiB",
               config=config) as handle:
        assert all(isinstance(m, Q4Linear) for _, _, m in attention_linears(model))
        assert isinstance(model.lm_head, Int8Linear)  # the head in 8-bit blocks, as llama.cpp's Q4_0 keeps it higher
        dense = handle.stats()["dense"]
        assert dense["weights"] == "q4" and dense["layers"] == len(originals) + 1 and dense["bytes"] > 0
        with torch.no_grad():
            served = model(input_ids=ids).logits
    assert 0 < rel(served, plain) < 0.5  # 4-bit experts and attention: rounded, the same model
    assert {id(m) for _, _, m in attention_linears(model)} == originals and model.lm_head is head
