"""Input checks shared by the expert kernels: clear errors naming the argument, raised before
any Triton or CUDA code could fail deep inside."""

from __future__ import annotations

import torch

from .format import PackedExpert, _check_prefix_width

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_activations(x: torch.Tensor, packed: PackedExpert, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != packed.hidden_size:
        raise ValueError(f"{name}: expected shape (T, H={packed.hidden_size}), got {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name}: expected dtype fp16, bf16 or fp32, got {x.dtype}")
    if x.device != packed.device:
        raise ValueError(f"{name} is on {x.device} but the packed expert is on {packed.device}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: the hidden dimension must be contiguous (stride 1), got strides {x.stride()}")


def check_packed(packed: PackedExpert) -> None:
    if not isinstance(packed, PackedExpert):
        raise TypeError(f"packed: expected a PackedExpert, got {type(packed).__name__}")
    for name, t in (("qweight", packed.qweight), ("scales", packed.scales), ("zeros", packed.zeros)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"packed.{name}: must be contiguous (a prefix view of a contiguous tensor is)")


def check_width(width: int | None, packed: PackedExpert) -> int:
    return _check_prefix_width(width, packed.width)


def check_token_vector(t: torch.Tensor | None, name: str, length: int, device, dtypes, *, required: bool = False
                       ) -> None:
    """A (T,) per-token tensor: right length, dtype, device and stride 1.

    The kernels index per-token vectors as ``ptr + t`` (no stride argument: one more scalar per
    launch for a case no caller needs), so a strided view would be read wrongly (token_widths)
    or send writes out of bounds (rows, weights): refused here, at the public boundary.
    """
    if t is None:
        if required:
            raise TypeError(f"{name}: expected a torch.Tensor of shape ({length},), got None")
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape ({length},), got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name}: expected shape ({length},), got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: expected dtype in ({names}), got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the activations")
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: must be contiguous (stride 1), got stride {t.stride(0)}; pass {name}.contiguous()")


def check_accumulate_args(out, x, rows, weights) -> None:
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[1] != x.shape[1]:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out: expected (N, H={x.shape[1]}), got {shape}")
    if out.dtype != torch.float32:
        # fp32 so that several experts (and atomic adds) accumulate without fp16/bf16 rounding.
        raise ValueError(f"out: expected float32 (the accumulation buffer), got {out.dtype}")
    if out.device != x.device:
        raise ValueError(f"out is on {out.device}, expected {x.device} like x")
    if not out.is_contiguous():
        raise ValueError("out: must be contiguous")
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows: expected a torch.Tensor of token indices, shape (T,), got {type(rows).__name__}")
    if rows.dim() != 1:
        raise ValueError(f"rows: expected shape (T,), got {tuple(rows.shape)}")
    check_token_vector(rows, "rows", rows.shape[0], x.device, INDEX_DTYPES, required=True)
    check_token_vector(weights, "weights", rows.shape[0], x.device, (torch.float32,), required=True)
