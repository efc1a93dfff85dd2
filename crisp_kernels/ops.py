"""The expert kernels as ``torch.library`` custom ops (namespace ``crisp``), with fake
implementations so that ``torch.compile`` and CUDA graphs can trace through them:

- ``torch.ops.crisp.expert_mlp(x, qweight, scales, zeros, group_size, width, token_widths, bias=None,
  down_bias=None, activation="silu_glu", alpha=0., limit=0., backend=None) -> Tensor``
- ``torch.ops.crisp.expert_mlp_accumulate_(out, x, qweight, scales, zeros, group_size, width, rows,
  weights, token_widths, bias=None, down_bias=None, activation="silu_glu", alpha=0., limit=0., backend=None) -> ()``
  (mutates ``out``)

A packed expert is passed as its tensors (``zeros`` None means the symmetric format) plus the
group size, since ops take tensors and scalars only; the activation as its ``ActivationKind``
value with alpha / limit (ignored for ``silu_glu``). Both dispatch exactly as
:func:`crisp_kernels.expert_mlp` (compiled Triton on CUDA, the interpreter on CPU when
``TRITON_INTERPRET=1``, else the torch reference) and raise the same errors; ``backend`` (a
:class:`~crisp_kernels.Backend` value, None = that choice) pins one, as the runtime does: its
CPU default is the torch reference even under ``TRITON_INTERPRET=1``.

This module is imported by ``crisp_kernels/__init__.py``: registering touches no GPU (it only
records Python functions with the dispatcher), so ``import crisp_kernels`` is enough to make
``torch.ops.crisp.*`` available.
"""

from __future__ import annotations

import torch

from .expert_mlp import Backend, expert_mlp, expert_mlp_accumulate_
from .format import SILU_GLU, Activation, ActivationKind, PackedExpert, QuantFormat

_EXTRA = ('Tensor? bias=None, Tensor? down_bias=None, str activation="silu_glu", float alpha=0., float limit=0., '
          'str? backend=None')
EXPERT_MLP_SCHEMA = (
    "(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, int group_size, int width, "
    f"Tensor? token_widths, {_EXTRA}) -> Tensor"
)
EXPERT_MLP_ACCUMULATE_SCHEMA = (
    "(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, int group_size, int width, "
    f"Tensor rows, Tensor weights, Tensor? token_widths, {_EXTRA}) -> ()"
)


def packed_from_tensors(qweight, scales, zeros, group_size: int, bias=None, down_bias=None,
                        activation: str = "silu_glu", alpha: float = 0.0, limit: float = 0.0) -> PackedExpert:
    """The :class:`PackedExpert` that the op arguments describe (validated by its constructor)."""
    kind = ActivationKind(activation)
    act = SILU_GLU if kind is ActivationKind.SILU_GLU else Activation(kind, alpha, limit)
    return PackedExpert(QuantFormat(group_size=group_size, symmetric=zeros is None), qweight, scales, zeros,
                        bias, down_bias, act)


def _backend(name: str | None) -> Backend | None:
    if name is None:
        return None
    try:
        return Backend(name)
    except ValueError:
        raise ValueError(f"backend: expected one of {[b.value for b in Backend]} or None, got {name!r}") from None


@torch.library.custom_op("crisp::expert_mlp", mutates_args=(), schema=EXPERT_MLP_SCHEMA)
def expert_mlp_op(x, qweight, scales, zeros, group_size, width, token_widths, bias=None, down_bias=None,
                  activation="silu_glu", alpha=0.0, limit=0.0, backend=None):
    packed = packed_from_tensors(qweight, scales, zeros, group_size, bias, down_bias, activation, alpha, limit)
    return expert_mlp(x, packed, width, token_widths=token_widths, backend=_backend(backend))


@expert_mlp_op.register_fake
def _(x, qweight, scales, zeros, group_size, width, token_widths, bias=None, down_bias=None, activation="silu_glu",
      alpha=0.0, limit=0.0, backend=None):
    torch._check(x.dim() == 2, lambda: f"x: expected (T, H), got {x.dim()} dims")
    torch._check(
        x.shape[1] == qweight.shape[-1] * 2,
        lambda: f"x: expected hidden size {qweight.shape[-1] * 2}, got {x.shape[1]}",
    )
    return x.new_empty(x.shape)


@torch.library.custom_op(
    "crisp::expert_mlp_accumulate_", mutates_args=("out",), schema=EXPERT_MLP_ACCUMULATE_SCHEMA
)
def expert_mlp_accumulate_op_(out, x, qweight, scales, zeros, group_size, width, rows, weights, token_widths,
                              bias=None, down_bias=None, activation="silu_glu", alpha=0.0, limit=0.0, backend=None):
    packed = packed_from_tensors(qweight, scales, zeros, group_size, bias, down_bias, activation, alpha, limit)
    expert_mlp_accumulate_(out, x, packed, width, rows=rows, weights=weights, token_widths=token_widths,
                           backend=_backend(backend))


@expert_mlp_accumulate_op_.register_fake
def _(out, x, qweight, scales, zeros, group_size, width, rows, weights, token_widths, bias=None, down_bias=None,
      activation="silu_glu", alpha=0.0, limit=0.0, backend=None):
    torch._check(out.dim() == 2 and out.shape[1] == x.shape[1], lambda: "out: expected (N, H) like x")
    return None
