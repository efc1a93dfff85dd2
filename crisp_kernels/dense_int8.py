"""A dense layer's weight in 8-bit blocks, computed on the CPU with 8-bit activations: ``crisp_dense_int8``.

Attention's projections are read whole every decode token. In bf16 (``crisp_kernels.dense_bf16``, exact for a
bf16 checkpoint) they are still the largest part of a CPU-only token after the experts: 101 MB a token on the
4-layer, H 2048 Mixtral-shaped model against 151 MB of 4-bit expert bytes (docs/cpu-kernel.md). This format
stores them as llama.cpp's Q8_0 does: int8 codes and one fp16 scale per block of 32 elements of a row (8.5 bits
a weight, 53% of bf16's bytes), scale ``amax / 127`` and codes rounded to nearest; :func:`dense_int8` quantizes
x per block of 32 the same way and sums exact integer block dots, so the result is llama.cpp's Q8_0 x Q8_0
arithmetic: ~0.5% relative rounding from each side on random data, far below the experts' 4-bit rows. On one
core of the project's 2-core AMD EPYC VM a 2048 x 2048 matrix took 343 us against 588 in bf16 (two cores: 201
against 376). :func:`dense_int8_ref` is the float64 reference from the same quantized x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crisp_kernels import cpu_native

# ----------------------------------------------------------------------------- constants

BLOCK = 32  # elements of a row per fp16 scale (Q8_0's block), and of x per activation scale
CODE_MAX = 127  # symmetric codes: -127..127 (-128 unused, as Q8_0)

# ----------------------------------------------------------------------------- format


@dataclass(frozen=True)
class DenseInt8:
    """A dense layer's weight (O, H): qweight (O, H) int8, scales (O, H / 32) fp16, bias (O,) fp32 or None."""

    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # checked once here, so that a call checks only its activations
        o, h = self.qweight.shape if self.qweight.dim() == 2 else (-1, -1)
        want = {"qweight": (self.qweight, torch.int8, (o, h)), "scales": (self.scales, torch.float16, (o, h // BLOCK))}
        if self.bias is not None:
            want["bias"] = (self.bias, torch.float32, (o,))
        for name, (t, dtype, shape) in want.items():
            if (not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous()
                    or t.device.type != "cpu"):
                raise ValueError(f"DenseInt8.{name}: expected a contiguous {dtype} {shape} CPU tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if h <= 0 or h % BLOCK:
            raise ValueError(f"DenseInt8: in_features {h} is not a positive multiple of {BLOCK}")

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.qweight, self.scales, self.bias) if t is not None)


def quantize_blocks(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (..., H) fp32, H a multiple of 32, as codes (..., H) (float, integers in [-127, 127]) and scales
    (..., H / 32) fp32 (amax / 127 of each block; 0 for an all-zero block, whose codes are 0): the activations'
    rounding, as the kernel does it (fp32 division, round half to even)."""
    blocks = values.reshape(*values.shape[:-1], -1, BLOCK)
    scales = blocks.abs().amax(-1) / CODE_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.where(scales[..., None] > 0, torch.round(blocks / safe[..., None]), torch.zeros_like(blocks))
    return codes.reshape(values.shape), scales


def pack_dense_int8(weight: torch.Tensor, bias: torch.Tensor | None = None) -> DenseInt8:
    """``weight`` (O, H), a float tensor on the CPU with H a multiple of 32, as :class:`DenseInt8`: per block of
    32, scale = amax / 127 rounded to fp16 and codes = round(w / scale) in [-127, 127]. A block whose scale fp16
    cannot hold (amax over 127 x 65504, or nonzero and under 127 x 2^-24) or a non-finite weight is refused
    (ValueError): the layer is better kept than silently zeroed or saturated."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight: expected a float (O, H) tensor, got {getattr(weight, 'shape', type(weight))}")
    if weight.device.type != "cpu" or weight.is_meta:
        raise ValueError(f"weight: expected a CPU tensor, got one on {weight.device}")
    if weight.shape[1] == 0 or weight.shape[1] % BLOCK:
        raise ValueError(f"weight: in_features {weight.shape[1]} is not a positive multiple of {BLOCK}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias: expected ({weight.shape[0]},), got {tuple(bias.shape)}")
    w = weight.detach().float()
    if not torch.isfinite(w).all():
        raise ValueError("weight: holds inf or nan")
    blocks = w.view(w.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(-1)
    scales = (amax / CODE_MAX).half()
    if not torch.isfinite(scales).all() or bool(((scales == 0) & (amax > 0)).any()):
        raise ValueError("weight: a block's scale does not fit fp16 (|w| over 8.3e6 or a nonzero block under "
                         "7.6e-6)")
    s = scales.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round(blocks / safe[..., None]).clamp_(-CODE_MAX, CODE_MAX)
    return DenseInt8(codes.to(torch.int8).view(w.shape).contiguous(), scales.contiguous(),
                     None if bias is None else bias.detach().float().cpu().contiguous())


# ----------------------------------------------------------------------------- launcher


def dense_int8(x: torch.Tensor, packed: DenseInt8, threads: int | None = None) -> torch.Tensor:
    """``x W^T + bias`` for x (..., H) on the CPU (any float dtype; the result in x's dtype), in chunks of
    ``cpu_native.MAX_TOKENS`` rows of x. threads: the kernel's (None: torch's intra-op threads)."""
    if not isinstance(packed, DenseInt8):
        raise TypeError(f"packed: expected a DenseInt8 (pack_dense_int8), got {type(packed).__name__}")
    kernel = cpu_native.load()
    return cpu_native.dense_chunks(x, packed.in_features, packed.out_features, packed.bias, threads,
                                   lambda xs, out, n: kernel.dense_int8(xs, packed.qweight, packed.scales, out, n))


# ----------------------------------------------------------------------------- torch.library op


@torch.library.custom_op("crisp::dense_int8", mutates_args=())
def dense_int8_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                  threads: int | None) -> torch.Tensor:
    """:func:`dense_int8` as ``torch.ops.crisp.dense_int8``: what a compiled model calls (dynamo cannot trace the
    native library's loading, so the call is opaque to it)."""
    return dense_int8(x, DenseInt8(qweight, scales, bias), threads)


@dense_int8_op.register_fake
def _(x, qweight, scales, bias, threads):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


# ----------------------------------------------------------------------------- reference


def dense_int8_ref(x: torch.Tensor, packed: DenseInt8) -> torch.Tensor:
    """(..., O) float64: what :func:`dense_int8` computes, from the same 8-bit quantization of x."""
    flat = x.reshape(-1, packed.in_features).float()
    codes, sx = quantize_blocks(flat)
    o, h = packed.qweight.shape
    dots = torch.einsum("tbk,obk->tob", codes.double().view(-1, h // BLOCK, BLOCK),
                        packed.qweight.double().view(o, h // BLOCK, BLOCK))  # (T, O, B) exact integers
    y = (dots * packed.scales.double()[None] * sx.double()[:, None, :]).sum(-1)
    if packed.bias is not None:
        y = y + packed.bias.double()
    return y.view(*x.shape[:-1], packed.out_features)
