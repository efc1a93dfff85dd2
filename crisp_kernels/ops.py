"""The expert kernels as ``torch.library`` custom ops (namespace ``crisp``), with fake
implementations so that ``torch.compile`` and CUDA graphs can trace through them:

- ``torch.ops.crisp.expert_mlp(x, qweight, scales, zeros, group_size, width, token_widths) -> Tensor``
- ``torch.ops.crisp.expert_mlp_accumulate_(out, x, qweight, scales, zeros, group_size, width, rows,
  weights, token_widths) -> ()`` (mutates ``out``)

A packed expert is passed as its tensors (``zeros`` None means the symmetric format) plus the
group size, since ops take tensors and scalars only. Both dispatch exactly as
:func:`crisp_kernels.expert_mlp` (compiled Triton on CUDA, the interpreter on CPU when
``TRITON_INTERPRET=1``, else the torch reference) and raise the same errors.

This module is imported by ``crisp_kernels/__init__.py``: registering touches no GPU (it only
records Python functions with the dispatcher), so ``import crisp_kernels`` is enough to make
``torch.ops.crisp.*`` available.
"""

from __future__ import annotations

import torch

from .expert_mlp import expert_mlp, expert_mlp_accumulate_
from .format import PackedExpert, QuantFormat

EXPERT_MLP_SCHEMA = (
    "(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, int group_size, int width, "
    "Tensor? token_widths) -> Tensor"
)
EXPERT_MLP_ACCUMULATE_SCHEMA = (
    "(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, int group_size, int width, "
    "Tensor rows, Tensor weights, Tensor? token_widths) -> ()"
)


def packed_from_tensors(qweight, scales, zeros, group_size: int) -> PackedExpert:
    """The :class:`PackedExpert` that the op arguments describe (validated by its constructor)."""
    return PackedExpert(QuantFormat(group_size=group_size, symmetric=zeros is None), qweight, scales, zeros)


@torch.library.custom_op("crisp::expert_mlp", mutates_args=(), schema=EXPERT_MLP_SCHEMA)
def expert_mlp_op(x, qweight, scales, zeros, group_size, width, token_widths):
    packed = packed_from_tensors(qweight, scales, zeros, group_size)
    return expert_mlp(x, packed, width, token_widths=token_widths)


@expert_mlp_op.register_fake
def _(x, qweight, scales, zeros, group_size, width, token_widths):
    torch._check(x.dim() == 2, lambda: f"x: expected (T, H), got {x.dim()} dims")
    torch._check(
        x.shape[1] == qweight.shape[-1] * 2,
        lambda: f"x: expected hidden size {qweight.shape[-1] * 2}, got {x.shape[1]}",
    )
    return x.new_empty(x.shape)


@torch.library.custom_op(
    "crisp::expert_mlp_accumulate_", mutates_args=("out",), schema=EXPERT_MLP_ACCUMULATE_SCHEMA
)
def expert_mlp_accumulate_op_(out, x, qweight, scales, zeros, group_size, width, rows, weights, token_widths):
    packed = packed_from_tensors(qweight, scales, zeros, group_size)
    expert_mlp_accumulate_(out, x, packed, width, rows=rows, weights=weights, token_widths=token_widths)


@expert_mlp_accumulate_op_.register_fake
def _(out, x, qweight, scales, zeros, group_size, width, rows, weights, token_widths):
    torch._check(out.dim() == 2 and out.shape[1] == x.shape[1], lambda: "out: expected (N, H) like x")
    return None
