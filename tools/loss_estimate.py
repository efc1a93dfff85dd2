"""The relative accuracy loss of one decode against a reference decode of the same windows, with its
standard error: what a search needs to decide that a loss is within a bound, not only that one sample was.

Why an interval: a throughput search scoring point estimates chose a serving configuration at 1.74% loss on 16 x 128
held-out calibration windows; on 128 x 256 held-out evaluation windows it lost 2.44%, over the 2% bound
(docs/serving-and-residency.md). 2,032 predictions carry a standard error of ~1.4 points on a
relative loss near 2%, so a point estimate under the bound said little.

The estimator: per window n, a_n = predictions the reference got right and d_n = a_n - c_n (the candidate's
right ones subtracted): a paired comparison, position by position, on the same text. The relative loss is the
ratio R = sum(d) / sum(a) (equal to (acc_ref - acc) / acc_ref); its standard error is the cluster (per-window)
delta-method one, sqrt(N / (N - 1) * sum((d_n - R a_n)^2)) / sum(a): windows are the independent units (a
miss early in a window changes the KV cache and the expert cache for the rest of it, so positions are not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["LossEstimate", "finite_or_none", "paired_advantage", "relative_loss"]


@dataclass(frozen=True)
class LossEstimate:
    """A relative accuracy loss (a fraction; negative when the candidate is more accurate) over ``windows``
    windows and its standard error (``inf`` from one window: no spread to estimate it from)."""

    loss: float
    standard_error: float
    windows: int

    def upper(self, z: float) -> float:
        """loss + z standard errors (``loss`` itself for z = 0, even from one window)."""
        return self.loss if z == 0 else self.loss + z * self.standard_error

    def lower(self, z: float) -> float:
        return self.loss if z == 0 else self.loss - z * self.standard_error


def relative_loss(reference_correct: torch.Tensor, correct: torch.Tensor) -> LossEstimate:
    """reference_correct, correct: (N, T) bool, the same N windows' next-token hits (``TokenScores.correct``)
    of the reference and of the candidate. ValueError on shapes that differ or hold no prediction."""
    if reference_correct.shape != correct.shape or reference_correct.dim() != 2 or reference_correct.numel() == 0:
        raise ValueError(f"relative_loss: expected two equal (N, T) hit tensors with N, T >= 1, got "
                         f"{tuple(reference_correct.shape)} and {tuple(correct.shape)}")
    a = reference_correct.double().sum(dim=1)  # (N,) reference hits per window
    return _ratio_estimate(a, a - correct.double().sum(dim=1))  # d: hits lost per window


def _ratio_estimate(a: torch.Tensor, d: torch.Tensor) -> LossEstimate:
    """sum(d) / sum(a) over windows and its cluster (per-window) delta-method standard error (module docstring)."""
    total = float(a.sum())
    n = a.numel()
    if total == 0:  # a reference that predicts nothing: no relative loss is defined; report none lost
        return LossEstimate(0.0, math.inf if n < 2 else 0.0, n)
    ratio = float(d.sum()) / total
    if n < 2:
        return LossEstimate(ratio, math.inf, n)
    spread = float(((d - ratio * a) ** 2).sum()) * n / (n - 1)
    return LossEstimate(ratio, math.sqrt(spread) / total, n)


def paired_advantage(reference_correct: torch.Tensor, correct: torch.Tensor,
                     baseline_correct: torch.Tensor) -> LossEstimate:
    """How far ``correct`` is ahead of ``baseline_correct`` on the same windows, relative to the reference's
    accuracy: (acc - acc_baseline) / acc_ref, a fraction (negative when the baseline is more accurate), with the
    same per-window cluster standard error as :func:`relative_loss` (e_n = hits - baseline hits per window, R =
    sum(e) / sum(a)). It equals relative_loss(ref, baseline) - relative_loss(ref, candidate), but its error is
    that of the paired difference, which is smaller than either loss's own when both decodes miss the same
    tokens. The returned ``loss`` field holds the advantage."""
    shapes = {tuple(x.shape) for x in (reference_correct, correct, baseline_correct)}
    if len(shapes) != 1 or reference_correct.dim() != 2 or reference_correct.numel() == 0:
        raise ValueError(f"paired_advantage: expected three equal (N, T) hit tensors with N, T >= 1, got "
                         f"{sorted(shapes)}")
    a = reference_correct.double().sum(dim=1)  # (N,)
    return _ratio_estimate(a, correct.double().sum(dim=1) - baseline_correct.double().sum(dim=1))


def finite_or_none(x: float) -> float | None:
    """JSON has no infinity: a standard error (or a bound) from one window is recorded as null."""
    return x if math.isfinite(x) else None
