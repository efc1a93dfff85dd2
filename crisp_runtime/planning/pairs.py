"""Leading-pair statistics: the combination key of a CRISP plan, its counts and its skew.

The leading pair of a token is its two routed experts with the highest routing weights (ties: router
order, the same stable order ``CrispPlan`` ranks by), unordered: ``(a, b)`` with ``a < b``, coded
``a * E + b``. For top-2 routing it is the whole combination; for wider routing it is what the
plan keys on (see ``crisp_runtime.planning.plan``). One definition here, for the profiler, the evidence
report, the tiny-model trainer and the benchmarks.

Skew (the paper's motivating statistic): over *all* C(E, 2) possible pairs of a layer, unseen
ones counting 0, the share of the layer's tokens carried by the most frequent ``top_fraction`` of
pairs and by the least frequent ``bottom_fraction`` (the paper quotes 25% and 29%); each part is
``max(1, round(fraction x C(E, 2)))`` pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def leading_pairs(index: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(heavier, lighter) expert of each token's leading pair by routing weight: two (T,) int64.

    index, weights: (T, k) with k >= 2, as a transformers router returns them.
    """
    if index.dim() != 2 or index.shape != weights.shape or index.shape[1] < 2:
        raise ValueError(f"index / weights: expected equal (T, k) shapes with k >= 2, "
                         f"got {tuple(index.shape)} and {tuple(weights.shape)}")
    order = weights.float().argsort(dim=1, descending=True, stable=True)
    top2 = index.long().gather(1, order[:, :2])
    return top2[:, 0], top2[:, 1]


def pair_codes(index: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Code ``a * E + b`` (a < b) of each token's leading pair: (T,) int64."""
    first, second = leading_pairs(index, weights)
    return torch.minimum(first, second) * num_experts + torch.maximum(first, second)


def pair_counts(index: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per leading pair: (E, E) int64, count of (a, b) at [a, b] with a < b, zero elsewhere."""
    codes = pair_codes(index, weights, num_experts)
    return torch.bincount(codes, minlength=num_experts * num_experts).view(num_experts, num_experts)


def counts_by_pair(counts: torch.Tensor) -> dict[tuple[int, int], int]:
    """{(a, b): tokens} of the pairs seen at least once, from an (E, E) count matrix (upper triangle)."""
    a, b = torch.triu_indices(counts.shape[0], counts.shape[1], offset=1)
    values = counts[a, b]
    return {(int(x), int(y)): int(n) for x, y, n in zip(a, b, values, strict=True) if n > 0}


@dataclass(frozen=True)
class PairSkew:
    """How concentrated one layer's leading pairs are (see the module docstring)."""

    top_fraction: float
    bottom_fraction: float
    top_share: float  # share of tokens carried by the most frequent top_fraction of all pairs
    bottom_share: float  # ... by the least frequent bottom_fraction
    seen: int  # pairs seen at least once
    possible: int  # C(E, 2)
    tokens: int


def pair_skew(counts: torch.Tensor, top_fraction: float = 0.25, bottom_fraction: float = 0.29) -> PairSkew:
    """Skew of an (E, E) leading-pair count matrix (upper triangle, as :func:`pair_counts` returns)."""
    if counts.dim() != 2 or counts.shape[0] != counts.shape[1] or counts.shape[0] < 2:
        raise ValueError(f"counts: expected an (E, E) matrix with E >= 2, got {tuple(counts.shape)}")
    for name, frac in (("top_fraction", top_fraction), ("bottom_fraction", bottom_fraction)):
        if not 0.0 < frac <= 1.0:
            raise ValueError(f"{name} must lie in (0, 1], got {frac}")
    a, b = torch.triu_indices(counts.shape[0], counts.shape[1], offset=1)
    ordered = counts[a, b].long().sort(descending=True).values
    n = ordered.numel()
    total = int(ordered.sum())
    n_top, n_bottom = max(1, round(top_fraction * n)), max(1, round(bottom_fraction * n))
    denom = total or 1
    return PairSkew(top_fraction, bottom_fraction, int(ordered[:n_top].sum()) / denom,
                    int(ordered[n - n_bottom:].sum()) / denom, int((ordered > 0).sum()), n, total)
