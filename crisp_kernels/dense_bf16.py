"""A dense layer's weight in bf16 with fp32 activations on the CPU: the native kernel's ``crisp_dense_bf16``.

For a weight whose values are bf16 (a bf16 checkpoint loaded in fp32, as transformers does for
``dtype=torch.float32``), :func:`pack_dense_bf16` keeps the same values in half the bytes and :func:`dense_bf16`
computes ``x W^T + bias`` with them widened exactly to fp32: the result is the fp32 layer's up to the order of the
sums (~1e-7 relative), not a rounding of the weights. A weight that bf16 does not hold exactly is refused.
Why: on one core of the project's 2-core VM the 16 attention matrices of a 4-layer, H 2048 Mixtral-shaped model
(201 MB in fp32) took ~10.7 ms a decode token through ``nn.Linear`` and ~6.4 ms in bf16 through this kernel (3.6 against
~9.9 ms with both cores): attention's fp32 weights are what CPU-only serving reads most after the experts
(docs/cpu-kernel.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crisp_kernels import cpu_native

# ----------------------------------------------------------------------------- format


@dataclass(frozen=True)
class DenseBf16:
    """A dense layer's weight (O, H) in bf16, contiguous on the CPU, and its bias (O,) fp32 or None."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of ``weight`` is a bf16 (so :func:`pack_dense_bf16` keeps it exactly)."""
    return bool(torch.equal(weight.detach().to(torch.bfloat16).to(weight.dtype), weight.detach()))


def pack_dense_bf16(weight: torch.Tensor, bias: torch.Tensor | None = None) -> DenseBf16:
    """``weight`` (O, H), a float tensor on the CPU whose values are all bf16 (else ValueError: this format never
    rounds a weight), as :class:`DenseBf16`."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight: expected a float (O, H) tensor, got {getattr(weight, 'shape', type(weight))}")
    if weight.device.type != "cpu" or weight.is_meta:
        raise ValueError(f"weight: expected a CPU tensor, got one on {weight.device}")
    if not bf16_exact(weight):
        raise ValueError("weight: not every value is a bf16; keeping it in bf16 would round it (keep the layer)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias: expected ({weight.shape[0]},), got {tuple(bias.shape)}")
    return DenseBf16(weight.detach().to(torch.bfloat16).contiguous(),
                     None if bias is None else bias.detach().float().cpu().contiguous())


# ----------------------------------------------------------------------------- launcher


def dense_bf16(x: torch.Tensor, packed: DenseBf16, threads: int | None = None) -> torch.Tensor:
    """``x W^T + bias`` for x (..., H) on the CPU (any float dtype; the result in x's dtype), fp32 arithmetic, in
    chunks of ``cpu_native.MAX_TOKENS`` rows of x. threads: the kernel's (None: torch's intra-op threads)."""
    if not isinstance(packed, DenseBf16):
        raise TypeError(f"packed: expected a DenseBf16 (pack_dense_bf16), got {type(packed).__name__}")
    kernel = cpu_native.load()
    return cpu_native.dense_chunks(x, packed.in_features, packed.out_features, packed.bias, threads,
                                   lambda xs, out, n: kernel.dense_bf16(xs, packed.weight, out, n))


# ----------------------------------------------------------------------------- torch.library op


@torch.library.custom_op("crisp::dense_bf16", mutates_args=())
def dense_bf16_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  threads: int | None) -> torch.Tensor:
    """:func:`dense_bf16` as ``torch.ops.crisp.dense_bf16``: what a compiled model calls (dynamo cannot trace the
    native library's loading, so the call is opaque to it)."""
    return dense_bf16(x, DenseBf16(weight, bias), threads)


@dense_bf16_op.register_fake
def _(x, weight, bias, threads):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# ----------------------------------------------------------------------------- reference


def dense_bf16_ref(x: torch.Tensor, packed: DenseBf16) -> torch.Tensor:
    """(..., O) float64: ``x W^T + bias`` with the bf16 weight's exact values."""
    y = x.double() @ packed.weight.double().t()
    if packed.bias is not None:
        y = y + packed.bias.double()
    return y
