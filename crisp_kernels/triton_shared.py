"""Pieces the 4-bit and the 2-bit-tail expert kernels share: the dot helper, the row gather, the launch sizing.

Both ``expert_mlp_triton`` (4-bit rows) and ``expert_mlp_tail_triton`` (2-bit tail rows) import these, so
neither kernel module imports the other's internals.
"""

from __future__ import annotations

import functools

import torch

from ._triton import interpreter_enabled, tl, triton

# Stand-in SM count under the interpreter: small, so that tests exercise split > 1.
_INTERPRETER_SMS = 2


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


@triton.jit
def dot_acc(a, b, acc, DOT_DTYPE: tl.constexpr):
    """``acc + a @ b`` with both operands in ``DOT_DTYPE``; fp32 means IEEE fp32, not TF32."""
    if DOT_DTYPE == tl.float32:  # noqa: SIM300 (a compile-time branch)
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        r = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc)
    return r


@triton.jit
def token_rows(rows_ptr, offs_t, t_mask, HAS_ROWS: tl.constexpr):
    if HAS_ROWS:  # noqa: SIM108 (a compile-time branch)
        r = tl.load(rows_ptr + offs_t, mask=t_mask, other=0).to(tl.int64)
    else:
        r = offs_t.to(tl.int64)
    return r


def operand_dtype(x: torch.Tensor):
    # The interpreter's bf16 dot is wrong, so it gets fp32 operands (exact products).
    if interpreter_enabled() or x.dtype == torch.float32:
        return tl.float32
    return tl.float16 if x.dtype == torch.float16 else tl.bfloat16
