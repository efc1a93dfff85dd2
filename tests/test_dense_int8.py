"""Dense layers in 8-bit blocks with 8-bit activations (crisp_kernels.dense_int8, RuntimeConfig(dense="q8")).

The kernel against its float64 reference (``dense_int8_ref``: the same codes and the same quantized x): each
block's integer dot is exact, so what differs is the fp32 product of the two scales and the fp32 sum over the
blocks (one rounding each, ~B^0.5 x 2^-24 relative for B blocks: 1e-7 at B = 129, measured 0.4-2.1e-7); 1e-6 in
relative norm over the (T, O) output. One code changed by one step moves a 64-wide row's output by ~1/127 of a
block's largest product, ~1e-3 of the output's norm: far outside. Against the fp32 layer the error is the two
roundings (weights and x each ~0.3-0.5% relative on Gaussian data, measured 0.6-0.8% together): 2% bounds it.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_native import NARROWER_BUILDS, narrower_kernel
from test_dense_bf16 import ROOT, TinyBlock, tiny_mixtral
from torch import nn

from crisp_kernels import cpu_native
from crisp_kernels.dense_int8 import BLOCK, CODE_MAX, DenseInt8, dense_int8, dense_int8_ref, pack_dense_int8
from crisp_kernels.dense_q8 import dense_q8, pack_dense
from crisp_runtime.cpu.dense import (
    DenseWeights,
    Int8Linear,
    SharedProjections,
    attention_linears,
    dense_linears,
    swap_dense,
)

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernel does not build here")

OWN_TOL = 1e-6
FP32_TOL = 2e-2
# (O, H, bias): H = 4128 (129 blocks) and 96 (3) leave blocks after the 8-block vector steps; O = 1, 7, 33, 130
# leave rows after the 4-row passes; (7, 2048) and (96, 256) are even; H = 4096, 14336: Mixtral's
SHAPES = [(96, 256, True), (33, 64, False), (7, 2048, True), (1, 32, False), (5, 4128, True), (130, 96, False),
          (9, 4096, False), (2, 14336, True)]


def _packed(o, h, bias, seed=0) -> tuple[DenseInt8, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(o, h, generator=gen) / h**0.5
    b = torch.randn(o, generator=gen) if bias else None
    return pack_dense_int8(w, b), w, b


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 4, 5, 64, 65])
def test_equals_its_reference_and_nears_the_fp32_layer(shape, tokens):
    packed, w, b = _packed(*shape)
    x = torch.randn(tokens, shape[1], generator=torch.Generator().manual_seed(tokens))
    got = dense_int8(x, packed)
    assert got.dtype == torch.float32 and got.shape == (tokens, shape[0])
    assert rel(got, dense_int8_ref(x, packed)) <= OWN_TOL
    fp32 = torch.nn.functional.linear(x, w)  # without the bias, which would hide the rounding
    assert rel(got - (0 if b is None else b), fp32) <= FP32_TOL


@pytest.mark.parametrize("shape", [(7, 64), (3, 4128)])
def test_packing_rounds_each_weight_to_its_blocks_nearest_code(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    w[0, :BLOCK] = 0.0  # an all-zero block: scale 0, codes 0
    packed = pack_dense_int8(w)
    codes = packed.qweight.float().view(shape[0], -1, BLOCK)
    scales = packed.scales.float()
    assert int(packed.qweight.abs().max()) <= CODE_MAX and scales[0, 0] == 0 and not codes[0, 0].any()
    back = codes * scales[..., None]
    # within half a step of the (fp16-rounded) scale: the nearest code
    assert ((back - w.view_as(back)).abs() <= scales[..., None] / 2 * (1 + 1e-6)).all()
    blocks = w.view_as(back)
    live = scales > 0  # each block's largest weight lands on +-127 or one step below (the fp16 rounding of the scale)
    peak = codes.abs().amax(-1)
    assert ((peak[live] >= CODE_MAX - 1) & (peak[live] <= CODE_MAX)).all()
    assert torch.equal(blocks[~live], torch.zeros_like(blocks[~live]))


def test_one_changed_code_is_seen():
    packed, _, _ = _packed(33, 64, False)
    x = torch.randn(3, 64)
    codes = packed.qweight.clone()
    codes[5, 10] += 1 if codes[5, 10] < CODE_MAX else -1
    bumped = DenseInt8(codes, packed.scales)
    assert rel(dense_int8(x, packed), dense_int8_ref(x, bumped)) > 10 * OWN_TOL


def test_zero_input_blocks_and_leading_dimensions_dtype_and_threads():
    packed, _, _ = _packed(130, 96, False)  # 130 rows: two threads' ranges (65 each) split the 4-row passes
    x = torch.randn(2, 3, 96)
    x[0, 0, :BLOCK] = 0.0  # an all-zero block of x: scale 0, codes 0
    got = dense_int8(x.to(torch.bfloat16), packed, threads=2)
    assert got.shape == (2, 3, 130) and got.dtype == torch.bfloat16
    one = dense_int8(x, packed, threads=1)
    # one row's dot per output, in the same order whichever pass holds the row: threads change no bit
    assert torch.equal(dense_int8(x, packed, threads=2), one)
    assert rel(one, dense_int8_ref(x, packed)) <= OWN_TOL
    assert torch.equal(dense_int8(torch.zeros(1, 96), packed), torch.zeros(1, 130))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_token_with_inf_or_nan_gets_nan_and_the_others_are_untouched(bad):
    """The 8-bit code of inf / nan would be a C cast's undefined value: the token's outputs are nan instead (the
    fp32 layer's are non-finite too), never finite numbers."""
    packed, _, _ = _packed(33, 4128, True)
    x = torch.randn(3, 4128)
    clean = dense_int8(x, packed)
    for h in (5, 4127):  # in the 8-block vector steps, and in the blocks after them
        bent = x.clone()
        bent[1, h] = bad
        got = dense_int8(bent, packed)
        assert torch.isnan(got[1]).all() and torch.equal(got[[0, 2]], clean[[0, 2]])


@pytest.mark.parametrize("build", sorted(NARROWER_BUILDS))
def test_narrower_builds_equal_the_reference(tmp_path, build, monkeypatch):
    kernel = narrower_kernel(tmp_path, build)
    monkeypatch.setattr(cpu_native, "load", lambda: kernel)
    for shape in (SHAPES[1], SHAPES[4], SHAPES[5]):
        packed, _, _ = _packed(*shape)
        x = torch.randn(5, shape[1])
        assert rel(dense_int8(x, packed), dense_int8_ref(x, packed)) <= OWN_TOL


def test_bad_inputs_are_refused():
    packed, w, _ = _packed(96, 256, False)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_dense_int8(torch.randn(4, 100))
    with pytest.raises(ValueError, match="bias"):
        pack_dense_int8(w, bias=torch.randn(5))
    with pytest.raises(ValueError, match="float"):
        pack_dense_int8(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="inf or nan"):
        pack_dense_int8(torch.full((2, 32), float("nan")))
    with pytest.raises(ValueError, match="fp16"):
        pack_dense_int8(torch.full((2, 32), 1e7))  # scale 7.9e4: over fp16's largest
    with pytest.raises(ValueError, match="fp16"):
        pack_dense_int8(torch.full((2, 32), 1e-7))  # scale 7.9e-10: fp16 rounds it to 0
    with pytest.raises(ValueError, match="DenseInt8.scales"):
        DenseInt8(packed.qweight, packed.scales.float())
    with pytest.raises(ValueError, match="x: expected"):
        dense_int8(torch.randn(2, 100), packed)
    with pytest.raises(TypeError, match="DenseInt8"):
        dense_int8(torch.randn(2, 256), "weights")
    kernel = cpu_native.load()
    with pytest.raises(ValueError, match="out"):
        kernel.dense_int8(torch.randn(2, 256), packed.qweight, packed.scales, torch.empty(3, 96), 1)
    with pytest.raises(ValueError, match="qweight"):
        kernel.dense_int8(torch.randn(2, 256), packed.qweight.float(), packed.scales, torch.empty(2, 96), 1)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel.dense_int8(torch.randn(2, 100), packed.qweight, packed.scales, torch.empty(2, 96), 1)
    with pytest.raises(ValueError, match="at most"):
        kernel.dense_int8(torch.randn(cpu_native.MAX_TOKENS + 1, 256), packed.qweight, packed.scales,
                          torch.empty(cpu_native.MAX_TOKENS + 1, 96), 1)


def test_swap_replaces_attentions_layers_keeps_unpackable_ones_and_restores_the_same_objects():
    torch.manual_seed(0)
    model = nn.Sequential(TinyBlock(96), TinyBlock(96))
    with torch.no_grad():
        model[1].self_attn.o_proj.weight[3, :BLOCK] = 1e7  # a block scale fp16 cannot hold: kept as it is
    before = {name: m for name, m in model.named_modules()}
    x = torch.randn(3, 96)
    with torch.no_grad():
        want = [lin(x) for _, _, lin in attention_linears(model)]
    swap = swap_dense(model, "q8", threads=1)
    assert swap.info() == {"layers": 3, "bytes": swap.nbytes, "original_bytes": swap.original_nbytes, "kept": 1,
                           "chosen": "q8", "shared_qkv": 0,  # no k_proj / v_proj here: nothing shared
                           "roles": {"attention": 3},  # TinyBlock's mlp is not named as an MLP projection
                           "role_bytes": {"attention": swap.nbytes}}
    assert swap.nbytes < 0.3 * swap.original_nbytes  # 8.5 bits a weight against fp32's 32
    assert [name for _, name, _ in attention_linears(model)] == ["o_proj"]
    assert isinstance(model[0].self_attn.q_proj, Int8Linear) and type(model[0].mlp) is nn.Linear
    with torch.no_grad():
        got = [model[0].self_attn.q_proj(x), model[0].self_attn.o_proj(x), model[1].self_attn.q_proj(x)]
    replaced = [model[0].self_attn.q_proj, model[0].self_attn.o_proj, model[1].self_attn.q_proj]
    for g, w, lin in zip(got, want[:3], replaced, strict=True):
        assert rel(g, dense_int8_ref(x, lin.packed)) <= OWN_TOL and rel(g, w) <= FP32_TOL
    swap.restore()
    assert {name: m for name, m in model.named_modules()} == before


def test_without_keep_original_only_bf16_valued_originals_are_freed_and_they_come_back_exactly():
    torch.manual_seed(4)
    model = nn.Sequential(TinyBlock(64))
    q, o = model[0].self_attn.q_proj, model[0].self_attn.o_proj  # a bf16 checkpoint's values in fp32
    with torch.no_grad():
        o.weight.add_(1e-4)  # no longer bf16 values: no exact bf16 copy holds them
    want = {k: v.clone() for k, v in model.state_dict().items()}
    swap = swap_dense(model, "q8", keep_original=False)
    assert q.weight.numel() == 0 and o.weight.numel() == 64 * 64  # o's fp32 values: no exact bf16 copy, kept
    replaced = model[0].self_attn.q_proj
    assert isinstance(replaced, Int8Linear) and replaced.exact_weight().dtype == torch.bfloat16
    assert model[0].self_attn.o_proj.exact_weight() is None
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    swap.restore()
    assert model[0].self_attn.q_proj is q and torch.equal(q.weight, want["0.self_attn.q_proj.weight"])
    assert q.weight.dtype == torch.float32


class _GqaAttention(nn.Module):
    """q, k, v and o as a grouped-query attention holds them (k and v narrower), bias or not."""

    def __init__(self, h, kv, bias):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(h, h, bias=bias), nn.Linear(h, kv, bias=bias)
        self.v_proj, self.o_proj = nn.Linear(h, kv, bias=bias), nn.Linear(h, h, bias=False)


class _GqaBlock(nn.Module):
    def __init__(self, h, kv, bias):
        super().__init__()
        self.self_attn = _GqaAttention(h, kv, bias)


# each replacement's own launcher and packer (the layers' own call, and their weights packed alone)
LAUNCHERS = {"q8": (dense_int8, lambda lin: pack_dense_int8(lin.weight, lin.bias)),
             "q4": (dense_q8, lambda lin: pack_dense(lin.weight, None, lin.bias))}


@pytest.mark.parametrize("dense", ["q8", "q4"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 65])
def test_q_k_v_share_one_call_and_give_each_layers_own_bits(dense, bias, tokens):
    launch, pack_alone = LAUNCHERS[dense]
    torch.manual_seed(5)
    model = nn.Sequential(_GqaBlock(128, 64, bias), _GqaBlock(128, 64, bias))
    attn = model[0].self_attn
    alone_packed = {name: pack_alone(getattr(attn, f"{name}_proj")) for name in "qkv"}
    x = torch.randn(2, tokens, 128)
    swap = swap_dense(model, dense, threads=1)
    assert swap.info()["shared_qkv"] == 2 and swap.info()["layers"] == 8
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    shared = q.shared
    assert isinstance(shared, SharedProjections) and k.shared is shared and v.shared is shared and o.shared is None
    # the layers' own weights are views of the stacked rows (one copy), with the values they get packed alone
    assert q.packed.qweight.data_ptr() == shared.stacked.qweight.data_ptr()
    assert k.packed.qweight.data_ptr() == shared.stacked.qweight[128:].data_ptr()
    for name, layer in (("q", q), ("k", k), ("v", v)):
        want = alone_packed[name]
        for field in ("qweight", "scales", "zeros", "bias"):
            a, b = getattr(layer.packed, field, None), getattr(want, field, None)
            assert (a is None and b is None) or torch.equal(a, b), (name, field)
    alone = {name: launch(x, layer.packed, 1) for name, layer in (("q", q), ("k", k), ("v", v))}
    with torch.no_grad():
        got = {"q": q(x), "k": k(x), "v": v(x)}
    for name in "qkv":  # the same bits as each layer's own call, each its own contiguous tensor
        assert torch.equal(got[name], alone[name]) and got[name].is_contiguous()
    assert shared._pending is None  # all three handed out: the input is not held
    with torch.no_grad():
        # k first, a different input, then the same input changed in place between two calls: recomputed each time
        y = torch.randn(2, tokens, 128)
        assert torch.equal(k(y), launch(y, k.packed, 1))
        y.mul_(2)
        assert torch.equal(v(y), launch(y, v.packed, 1)) and torch.equal(q(y), launch(y, q.packed, 1))
        assert torch.equal(q(y), launch(y, q.packed, 1))  # q again with nothing held for it: computed again
        # an inference tensor has no version counter: computed by the layer alone, nothing held
        shared._pending = None
        with torch.inference_mode():
            z = torch.randn(2, tokens, 128)
            assert torch.equal(k(z), launch(z, k.packed, 1)) and shared._pending is None
    swap.restore()
    assert all(type(m) is nn.Linear for _, _, m in attention_linears(model))


def test_projections_are_not_shared_where_they_differ():
    torch.manual_seed(6)
    mixed = nn.Sequential(_GqaBlock(64, 32, False))
    mixed[0].self_attn.k_proj = nn.Linear(64, 32, bias=True)  # a bias on k alone
    unpackable = nn.Sequential(_GqaBlock(64, 32, False))
    with torch.no_grad():
        unpackable[0].self_attn.v_proj.weight[0, :BLOCK] = 1e7  # kept as nn.Linear (no fp16 scale holds it)
    for model in (mixed, unpackable):
        swap = swap_dense(model, "q8", threads=1)
        assert swap.info()["shared_qkv"] == 0
        assert all(getattr(m, "shared", None) is None for m in model.modules() if isinstance(m, Int8Linear))
        swap.restore()


def test_swap_refuses_in_features_off_the_block_before_replacing_any():
    model = nn.Sequential(TinyBlock(64), TinyBlock(100))
    with pytest.raises(ValueError, match="multiple of the 8-bit block 32"):
        swap_dense(model, "q8")
    assert all(type(m) is nn.Linear for _, _, m in attention_linears(model)) and len(attention_linears(model)) == 4


def test_runtime_config_takes_q8():
    from crisp_runtime import RuntimeConfig

    assert RuntimeConfig(dense="q8").dense is DenseWeights.Q8


def test_apply_with_dense_q8_nears_the_fp32_models_logits():
    from crisp_runtime import RuntimeConfig, apply
    from crisp_runtime.cpu.experts import EXACT

    model, pack = tiny_mixtral()
    linears = [m for _, _, m, _ in dense_linears(model)]
    assert model.lm_head in linears and len(linears) == 4 * model.config.num_hidden_layers + 1
    ids = torch.tensor(list((ROOT / "data" / "stdlib-calib.txt").read_bytes()[:256])).unsqueeze(0)  # byte tokens
    runs = {}
    for dense in ("keep", "q8"):
        config = RuntimeConfig(dense=dense, cpu_experts=EXACT)  # exact experts: only the dense layers differ
        with apply(model, pack, serving="cpu_only", cpu="on", gpu_budget="64MiB", config=config) as handle:
            if dense == "q8":
                info = handle.stats()["dense"]
                assert info["weights"] == "q8" and info["layers"] == len(linears) and info["kept"] == 0
                assert sum(isinstance(m, Int8Linear) for m in model.modules()) == len(linears)
            with torch.no_grad():
                runs[dense] = model(input_ids=ids).logits
    # attention's and the lm head's inputs and weights rounded to 8 bits: measured 0.54% relative on these logits
    # (0.46% with attention alone) and 99.6% of the argmaxes kept, against 5.9% and 95.7% for dense="q4"'s 4-bit
    # rows: the bounds leave ~3x room and still tell the two apart
    assert rel(runs["q8"], runs["keep"]) < 1.5e-2
    assert (runs["q8"].argmax(-1) == runs["keep"].argmax(-1)).float().mean() >= 0.97
    assert [m for _, _, m, _ in dense_linears(model)] == linears  # the same objects back


def test_applys_default_shares_each_attentions_q_k_v_call_with_the_same_logits():
    from crisp_runtime import apply

    model, pack = tiny_mixtral()
    ids = torch.tensor(list((ROOT / "data" / "stdlib-calib.txt").read_bytes()[:96])).unsqueeze(0)  # byte tokens
    with apply(model, pack) as handle:
        assert handle.stats()["dense"]["shared_qkv"] == model.config.num_hidden_layers
        layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
        with torch.no_grad():
            shared = model(input_ids=ids).logits
            decoded = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False)
            for layer in layers:
                layer.shared = None  # each layer its own call again
            alone = model(input_ids=ids).logits
            assert torch.equal(model.generate(ids[:, :8], max_new_tokens=6, do_sample=False), decoded)
    assert torch.equal(shared, alone)


def test_applys_default_takes_q8_for_cpu_only_8bit_experts_and_bf16_otherwise():
    from crisp_runtime import RuntimeConfig, apply
    from crisp_runtime.cpu.experts import EXACT

    model, pack = tiny_mixtral()
    n = len(dense_linears(model))  # attention's and the lm head
    with apply(model, pack, serving="cpu_only", cpu="on", gpu_budget="64MiB") as handle:
        info = handle.stats()["dense"]
        assert info["weights"] == "auto" and info["chosen"] == "q8" and info["layers"] == n
        assert "8-bit activations" in info["reason"]
    # the committed checkpoint is fp32 (trained here): exact experts ask for exact attention, and bf16 holds none
    # of these weights, so every layer is kept
    with apply(model, pack, serving="cpu_only", cpu="on", gpu_budget="64MiB",
               config=RuntimeConfig(cpu_experts=EXACT)) as handle:
        info = handle.stats()["dense"]
        assert info["chosen"] == "bf16" and info["layers"] == 0 and info["kept"] == n
        assert info["reason"].startswith("the CPU experts compute at precision 'fp32'")
    # experts on the device path (cpu="off": a GPU's, here on the CPU device): attention exact too
    with apply(model, pack, gpu_budget="64MiB", cpu="off") as handle:
        info = handle.stats()["dense"]
        assert info["chosen"] == "bf16" and info["layers"] == 0 and "placement 'gpu'" in info["reason"]
    # the default with a CPU model, budget or not: every expert on the 8-bit CPU kernel, so 8-bit attention
    for budget in ("64MiB", None):
        with apply(model, pack, gpu_budget=budget) as handle:
            info = handle.stats()["dense"]
            assert handle.stats()["cpu"]["placement"] == "cpu_only"
            assert info["chosen"] == "q8" and info["layers"] == n
    assert len(dense_linears(model)) == n
