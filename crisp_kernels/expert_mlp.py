"""One expert over the first k neurons of its packed 4-bit weights.

Public entry points:

- ``expert_mlp(x, packed, width, token_widths=)`` -> (T, H) in x's dtype;
- ``expert_mlp_accumulate_(out, x, packed, width, rows=, weights=, token_widths=)``:
  ``out[rows[t]] += weights[t] * expert(x[rows[t]])`` in float32, so a runtime accumulates
  several experts into one output without gathering or scattering tokens itself.

Backends (``Backend``): compiled Triton for CUDA tensors, Triton's interpreter for CPU
tensors when ``TRITON_INTERPRET=1``, otherwise the pure-torch reference (which is also what
the kernels are tested against). The kernels live in ``expert_mlp_triton.py``.

Activations: the hidden dimension must be contiguous (stride 1, checked); rows may be strided
(e.g. a slice of a wider buffer), the kernels take the row stride.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ._triton import HAS_TRITON, interpreter_enabled
from .checks import (
    INDEX_DTYPES,
    check_accumulate_args,
    check_activations,
    check_packed,
    check_token_vector,
    check_width,
)
from .format import TAIL_NEURONS_PER_ROW, PackedExpert, apply_activation, dequantize_expert


class Backend(enum.Enum):
    TRITON = "triton"  # compiled, CUDA tensors
    TRITON_INTERPRET = "triton-interpret"  # Triton's CPU interpreter (tests)
    TORCH = "torch"  # dequantize then F.linear


def select_backend(device: torch.device) -> Backend:
    if HAS_TRITON and device.type == "cuda":
        return Backend.TRITON
    if HAS_TRITON and device.type == "cpu" and interpreter_enabled():
        return Backend.TRITON_INTERPRET
    return Backend.TORCH


def _resolve_backend(backend: Backend | None, device: torch.device) -> Backend:
    chosen = select_backend(device) if backend is None else Backend(backend)
    if chosen is Backend.TRITON and device.type != "cuda":
        raise ValueError(f"backend=TRITON needs CUDA tensors, got {device}")
    if chosen is Backend.TRITON_INTERPRET and not (device.type == "cpu" and interpreter_enabled()):
        raise ValueError("backend=TRITON_INTERPRET needs CPU tensors and TRITON_INTERPRET=1 set before import")
    if chosen is not Backend.TORCH and not HAS_TRITON:
        raise ValueError("Triton is not installed; use backend=Backend.TORCH")
    return chosen


def expert_mlp(
    x: torch.Tensor,
    packed: PackedExpert,
    width: int | None = None,
    *,
    token_widths: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """``down(act(gate(x), up(x)))`` over the first ``width`` neurons of ``packed`` (act and the
    optional biases as in :func:`expert_mlp_ref`).

    x: (T, H) fp16, bf16 or fp32; accumulation in fp32; returns (T, H) in x's dtype.
    width: neurons used (None = all the packed expert holds); a runtime argument.
    token_widths: optional (T,) int32/int64; token t uses only neurons j < min(width,
    token_widths[t]) (values are clamped to [0, width], never read past the prefix).
    """
    check_packed(packed)
    check_activations(x, packed)
    width = check_width(width, packed)
    check_token_vector(token_widths, "token_widths", x.shape[0], x.device, INDEX_DTYPES)
    chosen = _resolve_backend(backend, x.device)
    if chosen is Backend.TORCH:
        return expert_mlp_ref(x, packed, width, token_widths=token_widths).to(x.dtype)
    from .expert_mlp_triton import expert_mlp_triton

    return expert_mlp_triton(x, packed, width, token_widths)


def expert_mlp_accumulate_(
    out: torch.Tensor,
    x: torch.Tensor,
    packed: PackedExpert,
    width: int | None = None,
    *,
    rows: torch.Tensor,
    weights: torch.Tensor,
    token_widths: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """``out[rows[t]] += weights[t] * expert(x[rows[t]])`` for t < len(rows); returns ``out``.

    out: (N, H) float32 accumulation buffer; x: (N, H) activations (the same rows index both);
    rows: (T,) int32/int64 token indices in [0, N), which may repeat; weights: (T,) float32
    routing weights; token_widths: optional (T,) widths, as in :func:`expert_mlp`.
    The values of ``rows`` are not range-checked (that would cost a device-to-host sync): an
    index outside [0, N) is an error on the torch backend and undefined in the kernels.
    """
    check_packed(packed)
    check_activations(x, packed)
    width = check_width(width, packed)
    check_accumulate_args(out, x, rows, weights)
    check_token_vector(token_widths, "token_widths", rows.shape[0], x.device, INDEX_DTYPES)
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"out: expected {x.shape[0]} rows like x, got {out.shape[0]}")
    chosen = _resolve_backend(backend, x.device)
    if chosen is Backend.TORCH:
        expert_mlp_accumulate_ref_(out, x, packed, width, rows=rows, weights=weights, token_widths=token_widths)
        return out
    from .expert_mlp_triton import expert_mlp_accumulate_triton_

    expert_mlp_accumulate_triton_(out, x, packed, width, rows, weights, token_widths)
    return out


def expert_mlp_accumulate_unchecked_(
    out: torch.Tensor,
    x: torch.Tensor,
    packed: PackedExpert,
    width: int,
    rows: torch.Tensor,
    weights: torch.Tensor,
    token_widths: torch.Tensor | None,
    backend: Backend,
) -> None:
    """:func:`expert_mlp_accumulate_` without its argument checks and backend selection.

    For a runtime that checked its inputs once at its boundary (activations, packed layers,
    index dtypes) and resolved ``backend`` once with :func:`resolve_backend`: on the project's
    2-core CPU VM (busy) the checked entry spent 9.1 us per call before its kernel, this one
    0.6 us. Arguments that the checked entry would refuse are undefined behaviour here.
    """
    if backend is Backend.TORCH:
        expert_mlp_accumulate_ref_(out, x, packed, width, rows=rows, weights=weights, token_widths=token_widths)
        return
    from .expert_mlp_triton import expert_mlp_accumulate_triton_  # imports Triton: only off the torch backend

    expert_mlp_accumulate_triton_(out, x, packed, width, rows, weights, token_widths)


def experts_mlp_accumulate_unchecked_(
    out: torch.Tensor,
    x: torch.Tensor,
    experts: Sequence[PackedExpert],
    widths: Sequence[int],
    rows: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    token_widths: Sequence[torch.Tensor | None],
    backend: Backend,
) -> None:
    """Several experts accumulated into ``out``, in order: ``expert_mlp_accumulate_unchecked_(out, x,
    experts[i], widths[i], rows[i], weights[i], token_widths[i], backend)`` for each i.

    The same kernels in the same order, so the same sums (bit-identical to the calls one by one), with
    one entry per layer step instead of one per expert: each Python entry, backend dispatch and call of
    the reference cost a decode step ~0.3-0.6 us per expert on the 2-core CPU VM. The torch backend runs
    :func:`experts_mlp_accumulate_ref_` once; Triton launches one kernel per expert (a single launch for
    the step is not built). Unchecked, as the single entry.
    """
    if backend is Backend.TORCH:
        experts_mlp_accumulate_ref_(out, x, experts, widths, rows, weights, token_widths)
        return
    from .expert_mlp_triton import expert_mlp_accumulate_triton_  # imports Triton: only off the torch backend

    for packed, width, r, w, tw in zip(experts, widths, rows, weights, token_widths, strict=True):
        expert_mlp_accumulate_triton_(out, x, packed, width, r, w, tw)


def resolve_backend(backend: Backend | str | None, device: torch.device) -> Backend:
    """The backend the checked entries would pick for tensors on ``device`` (raises if unusable)."""
    return _resolve_backend(None if backend is None else Backend(backend), torch.device(device))


def effective_token_widths(width: int, token_widths: torch.Tensor | None, num_tokens: int, device) -> torch.Tensor:
    """Per-token widths clamped to [0, width]: (T,) int64.

    Values are clamped rather than validated so that no device-to-host sync is needed on
    CUDA; a width can never reach past the resident prefix.
    """
    if token_widths is None:
        return torch.full((num_tokens,), width, dtype=torch.int64, device=device)
    return token_widths.to(torch.int64).clamp(0, width)


def tail_token_neurons(widths: torch.Tensor, tail_start: int) -> torch.Tensor:
    """Per-token widths in storage rows -> neurons (``format.neurons_in_rows`` elementwise): (T,) int64."""
    return torch.where(widths > tail_start, tail_start + TAIL_NEURONS_PER_ROW * (widths - tail_start), widths)


def expert_mlp_ref(
    x: torch.Tensor,
    packed: PackedExpert,
    width: int | None = None,
    *,
    token_widths: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``down(act(gate(x), up(x)))`` over the first ``width`` neurons; (T, H) in ``compute_dtype``.

    With a 2-bit tail (``packed.tail_start``) ``width`` and ``token_widths`` count storage rows, and a row
    holds ``format.neurons_in_rows`` neurons (two per tail row).

    act is ``packed.activation`` (silu(gate) * up by default). Neurons j >= token_widths[t]
    contribute nothing to token t. With biases (gpt-oss): gate/up biases per neuron, and the
    down bias added in full to every token whose width min(width, token_widths[t]) is >= 1 (a
    token at width 0 gets nothing, as an expert run at width 0 is skipped).
    """
    width = check_width(width, packed)
    gate, up, down = dequantize_expert(packed, width, dtype=compute_dtype)  # (n, H), (n, H), (H, n): n neurons
    xc = x.to(compute_dtype)
    pre_gate, pre_up = F.linear(xc, gate), F.linear(xc, up)  # (T, k)
    if packed.bias is not None:
        bias = packed.bias[:width].to(compute_dtype)
        pre_gate, pre_up = pre_gate + bias[:, 0], pre_up + bias[:, 1]
    hidden = apply_activation(pre_gate, pre_up, packed.activation)
    widths = None
    if token_widths is not None:
        widths = effective_token_widths(width, token_widths, x.shape[0], x.device)
        neurons = tail_token_neurons(widths, packed.tail_start) if packed.tail_start is not None else widths
        keep = torch.arange(gate.shape[0], device=x.device).unsqueeze(0) < neurons.unsqueeze(1)  # (T, n)
        hidden = hidden * keep
    out = F.linear(hidden, down)  # (T, H)
    if packed.down_bias is not None and width:
        down_bias = packed.down_bias.to(compute_dtype)
        out = out + (down_bias if widths is None else (widths > 0).unsqueeze(1) * down_bias)
    return out


def expert_mlp_accumulate_ref_(
    out: torch.Tensor,
    x: torch.Tensor,
    packed: PackedExpert,
    width: int | None = None,
    *,
    rows: torch.Tensor,
    weights: torch.Tensor,
    token_widths: torch.Tensor | None = None,
) -> None:
    """``out[rows[t]] += weights[t] * expert(x[rows[t]])`` in float32, the reference."""
    experts_mlp_accumulate_ref_(out, x, (packed,), (width,), (rows,), (weights,), (token_widths,))


def experts_mlp_accumulate_ref_(
    out: torch.Tensor,
    x: torch.Tensor,
    experts: Sequence[PackedExpert],
    widths: Sequence[int | None],
    rows: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    token_widths: Sequence[torch.Tensor | None],
) -> None:
    """:func:`expert_mlp_accumulate_ref_` for several experts, in order: the reference's one loop (the
    single-expert entry calls it with one expert; the grouped entry with a layer step's experts)."""
    for packed, width, r, w, tw in zip(experts, widths, rows, weights, token_widths, strict=True):
        r = r.long()
        y = expert_mlp_ref(x[r], packed, width, token_widths=tw, compute_dtype=torch.float32)
        out.index_add_(0, r, y * w.unsqueeze(1))
