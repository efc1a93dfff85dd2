"""A dense layer's weights in the format's 4-bit rows, computed on the CPU with 8-bit activations.

The non-expert layers of an MoE model (attention's projections) are read whole every token; in fp32 they cost
a CPU-only decode more than the experts do (a Mixtral-shaped model with 605 MB of 4-bit experts: 201 MB of fp32
attention weights a token against 151 MB of expert bytes, 11.7 of a token's 33 ms; docs/cpu-kernel.md).
llama.cpp's Q4_0 stores them at 4.5 bits. :func:`pack_dense` quantizes a weight (O, H) into the experts' row
format (4 bits, groups along H, fp16 scales, uint8 zero points unless symmetric); :func:`dense_q8` computes
``x W^T (+ bias)`` through the native kernel's ``crisp_dense_q8`` (the experts' 8-bit-activation dots, one row at
a time); :func:`dense_q8_ref` is its float64 reference (``cpu_expert_q8.quantized_dots``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_native
from .cpu_expert_q8 import quantized_dots
from .format import QuantFormat, check_format, pack_nibbles, quantize_rows, unpack_nibbles

# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class DenseQ4:
    """One dense weight (O, H) in 4-bit rows: qweight (O, H/2) uint8, scales (O, G) fp16, zeros (O, G) uint8 or
    None (symmetric: 8), bias (O,) fp32 or None."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    fmt: QuantFormat
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # checked once here, so that a call checks only its activations (dense_q8: ~10 us a call saved, a decode
        # step calls it 4 times a layer)
        check_format(self.fmt)
        o, half = self.qweight.shape if self.qweight.dim() == 2 else (-1, -1)
        groups = 2 * half // self.fmt.group_size
        want = {"qweight": (self.qweight, torch.uint8, (o, half)), "scales": (self.scales, torch.float16, (o, groups))}
        if self.zeros is not None:
            want["zeros"] = (self.zeros, torch.uint8, (o, groups))
        if self.bias is not None:
            want["bias"] = (self.bias, torch.float32, (o,))
        for name, (t, dtype, shape) in want.items():
            if (not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous()
                    or t.device.type != "cpu"):
                raise ValueError(f"DenseQ4.{name}: expected a contiguous {dtype} {shape} CPU tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if 2 * half % self.fmt.group_size or half <= 0:
            raise ValueError(f"DenseQ4: in_features {2 * half} is not a positive multiple of the group size "
                             f"{self.fmt.group_size}")

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 2

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.zeros, self.bias)
        return sum(t.nbytes for t in parts if t is not None)


def pack_dense(weight: torch.Tensor, fmt: QuantFormat | None = None, bias: torch.Tensor | None = None) -> DenseQ4:
    """``weight`` (O, H) (any float dtype) as :class:`DenseQ4`; H must be a multiple of the format's group."""
    fmt = check_format(QuantFormat() if fmt is None else fmt)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight: expected a float (O, H) tensor, got {getattr(weight, 'shape', type(weight))}")
    fmt.check_hidden_size(weight.shape[1], "weight's in_features")
    q, scales, zeros = quantize_rows(weight.detach().float().cpu(), fmt)
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias: expected ({weight.shape[0]},), got {tuple(bias.shape)}")
    return DenseQ4(pack_nibbles(q).contiguous(), scales.contiguous(), None if zeros is None else zeros.contiguous(),
                   fmt, None if bias is None else bias.detach().float().cpu().contiguous())


# ----------------------------------------------------------------------------- launcher


def dense_q8(x: torch.Tensor, packed: DenseQ4, threads: int | None = None) -> torch.Tensor:
    """``x W^T + bias`` for x (..., H) on the CPU (any float dtype; the result in x's dtype), in chunks of
    ``cpu_native.MAX_TOKENS`` rows of x. threads: the kernel's (None: torch's intra-op threads)."""
    if not isinstance(packed, DenseQ4):
        raise TypeError(f"packed: expected a DenseQ4 (pack_dense), got {type(packed).__name__}")
    kernel = cpu_native.load()

    def call(xs, out, n):
        kernel.dense_q8(xs, packed.qweight, packed.scales, packed.zeros, packed.fmt.group_size, out, n,
                        weights_checked=True)

    return cpu_native.dense_chunks(x, packed.in_features, packed.out_features, packed.bias, threads, call)


# ----------------------------------------------------------------------------- torch.library op


@torch.library.custom_op("crisp::dense_q8", mutates_args=())
def dense_q8_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group_size: int, bias: torch.Tensor | None, threads: int | None) -> torch.Tensor:
    """:func:`dense_q8` as ``torch.ops.crisp.dense_q8`` (``zeros`` None: the symmetric format): what a compiled
    model calls (dynamo cannot trace the native library's loading, so the call is opaque to it)."""
    fmt = QuantFormat(group_size=group_size, symmetric=zeros is None)
    return dense_q8(x, DenseQ4(qweight, scales, zeros, fmt, bias), threads)


@dense_q8_op.register_fake
def _(x, qweight, scales, zeros, group_size, bias, threads):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


# ----------------------------------------------------------------------------- reference


def dense_q8_ref(x: torch.Tensor, packed: DenseQ4) -> torch.Tensor:
    """(..., O) float64: what :func:`dense_q8` computes, from the same 8-bit quantization of x."""
    flat = x.reshape(-1, packed.in_features).float()
    q = unpack_nibbles(packed.qweight).double()
    scales = packed.scales.double()
    zeros = packed.zeros.double() if packed.zeros is not None else torch.full_like(scales, 8.0)
    y = quantized_dots(flat, q, scales, zeros, packed.fmt.group_size)
    if packed.bias is not None:
        y = y + packed.bias.double()
    return y.view(*x.shape[:-1], packed.out_features)
