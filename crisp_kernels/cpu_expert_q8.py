"""The CPU expert with 8-bit activations: what ``crisp_expert_rows_q8`` (``cpu_expert_native.c``) computes.

llama.cpp's CPU path multiplies its 4-bit weights with activations quantized to 8 bits (Q8_0: blocks of 32,
one fp32 scale each), so its dot products are integer sums that AVX2 computes 32 pairs per instruction. The
native kernel's ``Precision.Q8`` does the same on the format's own rows (no second copy):

- **x**, per token and block of :data:`X_BLOCK` elements of H: ``sx = max |x| / 127`` (fp32),
  ``xq = round(x / sx)`` (fp32 division, ties to even; 0 where ``sx`` is 0);
- **gate / up** of neuron j: ``sum_b s_g sx_b (sum_h xq_h q_h - z_g sum_h xq_h)``, the inner sums exact
  integers; ``a = silu(gate) up`` (0 where ``j >= k_t``);
- **down**: the coefficients ``c_jg = a_j s_jg`` (fp32), per token, group g of H and block of
  :data:`NEURON_BLOCK` neurons (aligned to multiples of it, clipped to the call's rows), are quantized the
  same way (``sc = max |c| / 127``, ``cq = round(c / sc)``) and ``y_h += sc sum_j cq_jg (q_jh - z_jg)``.

The error against the fp32 path is the rounding of x and of the down coefficients to 8 bits (each at most
half a step, 1/254 of its block's largest magnitude); the codes and their scales are used exactly.
:func:`expert_mlp_q8_ref` computes the same quantities in float64 from the same fp32 quantization, so the
kernel matches it to fp32 rounding, except where a down coefficient lies within fp32 rounding of a rounding
boundary (``c / sc`` at k + 1/2): the two may then round it to neighbouring integers, which moves the output
by one step of that coefficient; :func:`boundary_allowance` bounds that term for a test.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .format import SYMMETRIC_ZERO, PackedExpert, Proj, unpack_nibbles

# ----------------------------------------------------------------------------- constants

X_BLOCK = 32  # x elements per int8 scale (llama.cpp's Q8_0 block; 16 bytes of a row)
NEURON_BLOCK = 16  # neurons per down-coefficient scale (16 x 15 x 127 = 30,480 fits the kernel's int16 sums)
Q8_MAX = 127.0  # symmetric int8 range, -128 unused (as Q8_0)
# c / sc closer than this to k + 1/2: the kernel's fp32 a (summed in another order) may round it the other way.
# The kernel's a differs from the reference's by a few fp32 ulps (~1e-6 relative), and c / sc <= 127, so the
# quotient moves by < 127e-6 = 1.3e-4; 1e-3 leaves a margin of 8.
BOUNDARY_SLACK = 1e-3


# ----------------------------------------------------------------------------- reference


def quantize_blocks(v: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: v (..., n) fp32 in blocks of ``block`` along the last axis, q = round(v / scale) as fp32
    integers in [-127, 127], scale (..., n / block) = max |v| / 127 (fp32), q = 0 where the scale is 0."""
    blocks = v.float().reshape(*v.shape[:-1], v.shape[-1] // block, block)
    scale = blocks.abs().amax(-1) / Q8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale.unsqueeze(-1) > 0, torch.round(blocks / safe.unsqueeze(-1)), torch.zeros_like(blocks))
    return q.reshape(v.shape), scale


def _codes(packed: PackedExpert, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q (n, 3, H), scales (n, 3, G), zeros (n, 3, G)) of rows [start, stop), float64."""
    q = unpack_nibbles(packed.qweight[start:stop]).double()
    scales = packed.scales[start:stop].double()
    zeros = (packed.zeros[start:stop].double() if packed.zeros is not None
             else torch.full_like(scales, float(SYMMETRIC_ZERO)))
    return q, scales, zeros


def quantized_dots(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group: int) -> torch.Tensor:
    """(T, n) float64: each row's dot with x quantized to 8 bits (:func:`quantize_blocks`), the kernel's
    ``sum_b s_g sx_b (sum_h xq_h q_h - z_g sum_h xq_h)`` with exact integer inner sums.

    x: (T, H) fp32; q: (n, H) codes, scales / zeros: (n, G), all float64."""
    xq, sx = quantize_blocks(x.float(), X_BLOCK)  # (T, H), (T, H/32)
    tokens, hidden = x.shape
    n = q.shape[0]
    xb = xq.double().view(tokens, hidden // X_BLOCK, X_BLOCK)
    per_group = group // X_BLOCK
    isum = torch.einsum("tbk,jbk->tjb", xb, q.view(n, hidden // X_BLOCK, X_BLOCK))  # exact integers
    z = zeros.repeat_interleave(per_group, dim=1)  # (n, B)
    s = scales.repeat_interleave(per_group, dim=1)
    exact = isum - z.unsqueeze(0) * xb.sum(-1).unsqueeze(1)
    return (exact * s.unsqueeze(0) * sx.double().unsqueeze(1)).sum(-1)


def _activations(x: torch.Tensor, packed: PackedExpert, start: int, stop: int,
                 token_widths: torch.Tensor | None) -> torch.Tensor:
    """a: (T, n) float64, the rows' silu(gate) up from the quantized x, 0 past each token's width."""
    g = packed.fmt.group_size
    q, scales, zeros = _codes(packed, start, stop)
    gate, up = (quantized_dots(x, q[:, proj], scales[:, proj], zeros[:, proj], g) for proj in (Proj.GATE, Proj.UP))
    a = F.silu(gate) * up
    if token_widths is not None:
        keep = torch.arange(start, stop).unsqueeze(0) < token_widths.to(torch.int64).unsqueeze(1)
        a = a * keep
    return a


def _coefficients(a: torch.Tensor, packed: PackedExpert, start: int, stop: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cq (T, n, G), sc (T, n, G) each row's block scale, quotient c / sc (T, n, G)) of the down pass."""
    _, scales, _ = _codes(packed, start, stop)
    c = a.float().unsqueeze(-1) * scales[:, Proj.DOWN].float().unsqueeze(0)  # (T, n, G) fp32, as the kernel
    block = torch.arange(start, stop) // NEURON_BLOCK
    sc = torch.zeros_like(c)
    for b in block.unique():
        rows = block == b
        sc[:, rows] = (c[:, rows].abs().amax(1) / Q8_MAX).unsqueeze(1)
    safe = torch.where(sc > 0, sc, torch.ones_like(sc))
    quotient = torch.where(sc > 0, c / safe, torch.zeros_like(c))
    return torch.round(quotient), sc, quotient


def expert_mlp_q8_ref(x: torch.Tensor, packed: PackedExpert, width: int, *, token_widths: torch.Tensor | None = None,
                      row_start: int = 0) -> torch.Tensor:
    """The expert at ``width`` (rows [row_start, width)) with 8-bit activations: (T, H) float64.

    x: (T, H) fp32 on the CPU; token widths as in ``expert_mlp`` (token t uses rows j < min(width, k_t))."""
    tokens, hidden = x.shape
    if row_start >= width or tokens == 0:
        return torch.zeros(tokens, hidden, dtype=torch.float64)
    a = _activations(x.float(), packed, row_start, width, token_widths)
    cq, sc, _ = _coefficients(a, packed, row_start, width)
    y = torch.einsum("tjg,jgk->tgk", cq.double() * sc.double(), _down_centred(packed, row_start, width))
    return y.reshape(tokens, hidden)


def boundary_allowance(x: torch.Tensor, packed: PackedExpert, width: int, *,
                       token_widths: torch.Tensor | None = None, row_start: int = 0) -> torch.Tensor:
    """(T, H) float64: per output element, the most the kernel may differ from :func:`expert_mlp_q8_ref` because a
    down coefficient within :data:`BOUNDARY_SLACK` of a rounding boundary rounded the other way (one step
    ``sc |q - z|`` each); 0 where no coefficient is that close."""
    tokens, hidden = x.shape
    if row_start >= width or tokens == 0:
        return torch.zeros(tokens, hidden, dtype=torch.float64)
    a = _activations(x.float(), packed, row_start, width, token_widths)
    _, sc, quotient = _coefficients(a, packed, row_start, width)
    near = ((quotient - quotient.floor() - 0.5).abs() < BOUNDARY_SLACK) & (sc > 0)
    y = torch.einsum("tjg,jgk->tgk", near.double() * sc.double(), _down_centred(packed, row_start, width).abs())
    return y.reshape(tokens, hidden)


def _down_centred(packed: PackedExpert, start: int, stop: int) -> torch.Tensor:
    """(n, G, g) float64: rows [start, stop)'s down codes minus their zero points, by group of H."""
    g = packed.fmt.group_size
    q, _, zeros = _codes(packed, start, stop)
    return q[:, Proj.DOWN].view(stop - start, -1, g) - zeros[:, Proj.DOWN].unsqueeze(-1)
