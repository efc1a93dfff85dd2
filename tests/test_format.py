"""The packed format: exact round trips on the grid, quantization quality, layout and errors."""

import pytest
import torch

from crisp_kernels import (
    PackedExpert,
    QuantFormat,
    dequantize_expert,
    dequantize_layer,
    pack_expert,
    pack_layer,
)
from crisp_kernels.format import (
    NUM_PROJ,
    dequantize_rows,
    pack_nibbles,
    quantize_rows,
    unpack_nibbles,
)

FORMATS = [QuantFormat(group_size=g, symmetric=s) for g in (32, 64, 128) for s in (False, True)]


def _fmt_id(fmt: QuantFormat) -> str:
    return f"g{fmt.group_size}-{'sym' if fmt.symmetric else 'asym'}"


def grid_weights(rows: int, hidden: int, fmt: QuantFormat, gen: torch.Generator):
    """Weights exactly on the 4-bit grid of ``fmt``: (q - z) * s with every group spanning the
    full code range, so quantization must recover q, s and z exactly.

    Returns (w (rows, H) fp32, q (rows, H) uint8, s (rows, H/g) fp16, z (rows, H/g) uint8 or None).
    """
    groups = hidden // fmt.group_size
    q = torch.randint(0, 16, (rows, groups, fmt.group_size), generator=gen)
    if fmt.symmetric:
        # codes in [1, 15] (|q - 8| <= 7) with 1 and 15 present: absmax is exactly 7 s
        q = q.clamp(1, 15)
        q[..., 0], q[..., 1] = 1, 15
        z = torch.full((rows, groups), 8)
    else:
        q[..., 0], q[..., 1] = 0, 15
        z = torch.randint(0, 16, (rows, groups), generator=gen)
    perm = torch.argsort(torch.rand(rows, groups, fmt.group_size, generator=gen), dim=-1)
    q = q.gather(-1, perm)  # the extreme codes anywhere in the group
    s = (torch.rand(rows, groups, generator=gen) * 0.1 + 1e-3).half()
    # (q - z) * s is exact in fp32: an 11-bit significand times a 5-bit integer
    w = ((q - z.unsqueeze(-1)).float() * s.float().unsqueeze(-1)).reshape(rows, hidden)
    q = q.reshape(rows, hidden).to(torch.uint8)
    return w, q, s, None if fmt.symmetric else z.to(torch.uint8)


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
def test_quantize_rows_recovers_grid_exactly(fmt):
    gen = torch.Generator().manual_seed(0)
    w, q, s, z = grid_weights(24, 256, fmt, gen)
    q2, s2, z2 = quantize_rows(w, fmt)
    assert torch.equal(q2, q)
    assert torch.equal(s2, s)
    if fmt.symmetric:
        assert z2 is None
    else:
        assert torch.equal(z2, z)
    assert torch.equal(dequantize_rows(q2, s2, z2, fmt.group_size), w)


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
def test_pack_expert_dequantize_exact_on_grid(fmt):
    gen = torch.Generator().manual_seed(1)
    inter, hidden = 20, 256
    w, q, _, _ = grid_weights(3 * inter, hidden, fmt, gen)
    gate, up, down_t = w[:inter], w[inter : 2 * inter], w[2 * inter :]
    packed = pack_expert(gate, up, down_t.t(), fmt)
    g2, u2, d2 = dequantize_expert(packed)
    assert torch.equal(g2, gate) and torch.equal(u2, up) and torch.equal(d2, down_t.t())
    # the packed bytes are the codes, low nibble = even element, neuron-major
    q = q.reshape(3, inter, hidden).transpose(0, 1)  # (I, 3, H)
    assert torch.equal(packed.qweight, q[..., 0::2] | (q[..., 1::2] << 4))
    # a prefix dequantizes to the first k neurons
    g3, u3, d3 = dequantize_expert(packed, 7, dtype=torch.float64)
    assert torch.equal(g3, gate[:7].double()) and torch.equal(u3, up[:7].double())
    assert torch.equal(d3, down_t[:7].t().double())


def test_nibble_order_low_is_even():
    q = torch.tensor([[0x3, 0xC, 0x0, 0xF]], dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.tolist() == [[0xC3, 0xF0]]
    assert torch.equal(unpack_nibbles(torch.tensor([[0xC3, 0xF0]], dtype=torch.uint8)), q)
    # through the packer: an expert whose single gate group is [-8s, 7s, -8s, 7s, ...] (z = 8)
    s = 0.5
    gate = torch.tensor([-8.0 * s, 7.0 * s] * 16).unsqueeze(0)
    fmt = QuantFormat(group_size=32)
    packed = pack_expert(gate, torch.zeros(1, 32), torch.zeros(32, 1), fmt)
    assert packed.zeros[0, 0, 0].item() == 8
    assert packed.qweight[0, 0, 0].item() == 0xF0  # even element code 0 low, odd element code 15 high


def test_pack_nibbles_rejects_odd_length():
    with pytest.raises(ValueError, match="last dimension must be even"):
        pack_nibbles(torch.zeros(2, 3, dtype=torch.uint8))


# Measured on 256x3x1024 standard-normal weights (seed 0): asym g32/g64/g128 = 21.9/20.8/19.9 dB,
# sym = 20.3/19.4/18.6 dB (about 6 dB per bit less the loss of Gaussian tails to the min-max
# range). The bounds sit 0.5 dB under the measurements.
SQNR_BOUNDS_DB = {(32, False): 21.3, (64, False): 20.3, (128, False): 19.4, (32, True): 19.7, (64, True): 18.8,
                  (128, True): 18.1}  # fmt: skip


def _sqnr_db(w, approx):
    return (10 * torch.log10(w.double().pow(2).sum() / (w.double() - approx.double()).pow(2).sum())).item()


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
def test_quantization_sqnr(fmt):
    w = torch.randn(256, 3, 1024, generator=torch.Generator().manual_seed(0))
    q, s, z = quantize_rows(w, fmt)
    sqnr = _sqnr_db(w, dequantize_rows(q, s, z, fmt.group_size))
    assert sqnr >= SQNR_BOUNDS_DB[(fmt.group_size, fmt.symmetric)], f"SQNR {sqnr:.2f} dB"
    assert sqnr < 30  # 4 bits cannot do better: a bound that fails if the test compares w with itself


def test_one_signed_and_constant_groups_quantize_well():
    """Groups of one sign keep their range (it must include 0 for an integer zero point), and a
    constant or all-zero group does not collapse (its scale survives the cast to fp16)."""
    fmt = QuantFormat(group_size=32)
    gen = torch.Generator().manual_seed(3)
    w = torch.stack(
        [torch.rand(32, generator=gen) + 1.0, -torch.rand(32, generator=gen) - 1.0, torch.full((32,), 0.5),
         torch.zeros(32)]
    )  # fmt: skip
    q, s, z = quantize_rows(w, fmt)
    d = dequantize_rows(q, s, z, fmt.group_size)
    assert torch.isfinite(d).all()
    # one-signed groups: error within half a step of a grid of 16 codes over [0, max|w|]
    step = w.abs().amax(dim=1) / 15
    assert ((d - w).abs().amax(dim=1)[:2] <= step[:2] / 2 * 1.01).all()
    assert torch.allclose(d[2], w[2], rtol=1e-3)
    assert torch.equal(d[3], w[3])


# ----------------------------------------------------------------------------- prefix / nbytes


@pytest.fixture
def expert():
    gen = torch.Generator().manual_seed(4)
    inter, hidden = 48, 256
    return pack_expert(
        torch.randn(inter, hidden, generator=gen),
        torch.randn(inter, hidden, generator=gen),
        torch.randn(hidden, inter, generator=gen),
        QuantFormat(group_size=64),
    )


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k", [0, 1, 17, 48])
def test_nbytes_is_the_prefix_bytes(k, symmetric):
    gen = torch.Generator().manual_seed(5)
    fmt = QuantFormat(group_size=64, symmetric=symmetric)
    packed = pack_expert(torch.randn(48, 256, generator=gen), torch.randn(48, 256, generator=gen),
                         torch.randn(256, 48, generator=gen), fmt)  # fmt: skip
    prefix_bytes = sum(t.numel() * t.element_size() for t in packed.prefix(k).tensors())
    assert packed.nbytes(k) == prefix_bytes == k * fmt.neuron_nbytes(256)


def test_neuron_nbytes_mixtral():
    # H=4096, g=64: 3 x (2048 packed bytes + 64 fp16 scales + 64 zero bytes) = 6,720
    assert QuantFormat(group_size=64).neuron_nbytes(4096) == 6720
    assert QuantFormat(group_size=64, symmetric=True).neuron_nbytes(4096) == 6528


def test_prefix_is_zero_copy(expert):
    p = expert.prefix(10)
    assert p.width == 10
    for full, view in zip(expert.tensors(), p.tensors(), strict=True):
        assert view.data_ptr() == full.data_ptr()
        assert view.is_contiguous()
        assert view.shape[0] == 10
    assert expert.prefix().width == expert.width
    assert expert.prefix(0).nbytes() == 0


@pytest.mark.parametrize("bad", [-1, 49])
def test_width_out_of_range(expert, bad):
    with pytest.raises(ValueError, match=r"width=-?\d+ is out of range"):
        expert.prefix(bad)
    with pytest.raises(ValueError, match="width"):
        expert.nbytes(bad)


@pytest.mark.parametrize("bad", [2.0, True, torch.tensor(3), "4"])
def test_width_not_an_int(expert, bad):
    with pytest.raises(TypeError, match="width: expected an int"):
        expert.prefix(bad)


# ----------------------------------------------------------------------------- layers


def _dense_layer(num_experts=3, inter=24, hidden=128, seed=6):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_experts, 2 * inter, hidden, generator=gen), torch.randn(num_experts, hidden, inter,
                                                                                  generator=gen)  # fmt: skip


@pytest.mark.parametrize("fmt", [QuantFormat(group_size=32), QuantFormat(group_size=64, symmetric=True)], ids=_fmt_id)
def test_pack_layer_matches_pack_expert(fmt):
    gate_up, down = _dense_layer()
    layer = pack_layer(gate_up, down, fmt)
    inter = layer.intermediate_size
    for e in range(layer.num_experts):
        ref = pack_expert(gate_up[e, :inter], gate_up[e, inter:], down[e], fmt)
        got = layer.expert(e)
        for a, b in zip(got.tensors(), ref.tensors(), strict=True):
            assert torch.equal(a, b)


def test_neuron_order_round_trip():
    gate_up, down = _dense_layer()
    fmt = QuantFormat(group_size=32)
    gen = torch.Generator().manual_seed(7)
    order = torch.stack([torch.randperm(24, generator=gen) for _ in range(3)])
    plain = pack_layer(gate_up, down, fmt)
    permuted = pack_layer(gate_up, down, fmt, neuron_order=order)
    assert torch.equal(permuted.neuron_order, order)
    # stored neuron j of expert e is original neuron order[e, j], quantized identically
    for e in range(3):
        assert torch.equal(permuted.qweight[e], plain.qweight[e, order[e]])
        assert torch.equal(permuted.scales[e], plain.scales[e, order[e]])
        assert torch.equal(permuted.zeros[e], plain.zeros[e, order[e]])
    # dequantize_layer puts the neurons back in their original order
    gu_p, d_p = dequantize_layer(permuted)
    gu, d = dequantize_layer(plain)
    assert torch.equal(gu_p, gu) and torch.equal(d_p, d)
    assert not torch.equal(permuted.qweight, plain.qweight)  # the permutation did move rows
    # and close to the dense weights (4-bit)
    assert (gu - gate_up).norm() / gate_up.norm() < 0.15


def test_layer_expert_view_is_zero_copy():
    layer = pack_layer(*_dense_layer(), QuantFormat(group_size=32))
    assert layer.expert(1).qweight.data_ptr() == layer.qweight[1].data_ptr()
    assert layer.nbytes() == 3 * 24 * layer.fmt.neuron_nbytes(128)
    with pytest.raises(IndexError, match="expert index 3 out of range"):
        layer.expert(3)


# ----------------------------------------------------------------------------- bad inputs


def test_quant_format_errors():
    with pytest.raises(ValueError, match="QuantFormat.bits"):
        QuantFormat(bits=8)
    with pytest.raises(ValueError, match="QuantFormat.group_size"):
        QuantFormat(group_size=48)


def test_hidden_not_multiple_of_group():
    with pytest.raises(ValueError, match="H=96 must be a positive multiple of group_size=64"):
        pack_expert(torch.randn(4, 96), torch.randn(4, 96), torch.randn(96, 4), QuantFormat(group_size=64))
    with pytest.raises(ValueError, match="H=96 must be a positive multiple of group_size=64"):
        pack_layer(torch.randn(2, 8, 96), torch.randn(2, 96, 4), QuantFormat(group_size=64))


def test_expert_shape_errors():
    fmt = QuantFormat(group_size=32)
    with pytest.raises(ValueError, match="gate: expected"):
        pack_expert(torch.randn(4, 64, 1), torch.randn(4, 64), torch.randn(64, 4), fmt)
    with pytest.raises(ValueError, match="up: expected"):
        pack_expert(torch.randn(4, 64), torch.randn(5, 64), torch.randn(64, 4), fmt)
    with pytest.raises(ValueError, match="down: expected"):
        pack_expert(torch.randn(4, 64), torch.randn(4, 64), torch.randn(4, 64), fmt)
    with pytest.raises(ValueError, match="gate: expected a floating-point"):
        pack_expert(torch.ones(4, 64, dtype=torch.int32), torch.randn(4, 64), torch.randn(64, 4), fmt)


def test_layer_shape_errors():
    fmt = QuantFormat(group_size=32)
    with pytest.raises(ValueError, match="gate_up_proj: expected"):
        pack_layer(torch.randn(2, 7, 64), torch.randn(2, 64, 3), fmt)
    with pytest.raises(ValueError, match="down_proj: expected"):
        pack_layer(torch.randn(2, 8, 64), torch.randn(2, 64, 5), fmt)


@pytest.mark.parametrize(
    "order, match",
    [
        (torch.tensor([[0, 1, 1, 3], [0, 1, 2, 3]]), "each row must be a permutation"),
        (torch.tensor([[0, 1, 2, 4], [0, 1, 2, 3]]), "each row must be a permutation"),
        (torch.tensor([[0, 1, 2, 3]]), "neuron_order: expected an integer tensor of shape"),
        (torch.tensor([[0.0, 1, 2, 3], [0, 1, 2, 3]]), "neuron_order: expected an integer tensor"),
    ],
)
def test_bad_neuron_order(order, match):
    with pytest.raises(ValueError, match=match):
        pack_layer(torch.randn(2, 8, 64), torch.randn(2, 64, 4), QuantFormat(group_size=32), neuron_order=order)


def test_packed_expert_validation():
    fmt = QuantFormat(group_size=32)
    q = torch.zeros(4, NUM_PROJ, 32, dtype=torch.uint8)
    s = torch.ones(4, NUM_PROJ, 2, dtype=torch.float16)
    z = torch.zeros(4, NUM_PROJ, 2, dtype=torch.uint8)
    PackedExpert(fmt, q, s, z)  # valid
    with pytest.raises(ValueError, match="PackedExpert.qweight"):
        PackedExpert(fmt, q.int(), s, z)
    with pytest.raises(ValueError, match="PackedExpert.scales"):
        PackedExpert(fmt, q, s.float(), z)
    with pytest.raises(ValueError, match="PackedExpert.zeros"):
        PackedExpert(fmt, q, s, None)
    with pytest.raises(ValueError, match="PackedExpert.zeros: the symmetric format stores no zero points"):
        PackedExpert(QuantFormat(group_size=32, symmetric=True), q, s, z)
    with pytest.raises(ValueError, match="different devices"):
        PackedExpert(fmt, q, s, z.to("meta"))
