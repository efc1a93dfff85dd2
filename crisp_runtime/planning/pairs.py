"""Combination keys of a CRISP plan (what its tiers are keyed on), leading-pair statistics and their skew.

A key reads a token's two heaviest routed experts by routing weight (:func:`leading_pairs`) and names its
combination (:class:`CombinationKey`): the leading pair (the paper's key; at top-2 the whole combination) or the
leading expert alone. One definition here (:func:`combination_of` for Python ints, :func:`combination_codes` for
tensors), for the runtime's tier lookup, the profiler, the simulator and the evaluation alike.

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

import enum
from dataclasses import dataclass

import torch


class CombinationKey(enum.Enum):
    """What a CRISP plan's tiers are keyed on (``combination_key`` in plan.json).

    LEADING_PAIR: the two heaviest routed experts of a token, unordered, ``(a, b)`` with ``a <= b``.
    LEADING_EXPERT: the heaviest routed expert alone, ``(e,)``. Why: on the tiny DeepSeek-shaped model (top-6 of
    64) the leading expert predicted the damage of skipping a token's three lightest routed experts as well as the
    leading pair (out-of-sample R^2 of the per-token KL 0.017 / 0.041 / 0.040 against 0.015 / 0.045 / 0.021 in its
    three MoE layers, ``bench/results/key-study-tiny-deepseek.json``) with 64 combinations per layer to count
    against 2,016.
    """

    LEADING_PAIR = "leading-pair-by-routing-weight"
    LEADING_EXPERT = "leading-expert-by-routing-weight"

    @property
    def size(self) -> int:
        """Experts in one combination of this key."""
        return 2 if self is CombinationKey.LEADING_PAIR else 1

    def code_count(self, num_experts: int) -> int:
        """Length of a table indexed by :func:`combination_codes` (codes lie in [0, code_count))."""
        return num_experts * num_experts if self is CombinationKey.LEADING_PAIR else num_experts


def combination_of(key: CombinationKey, first: int, second: int) -> tuple[int, ...]:
    """The combination of a token whose heaviest routed expert is ``first`` and second-heaviest ``second``."""
    if key is CombinationKey.LEADING_EXPERT:
        return (first,)
    return (first, second) if first <= second else (second, first)


def combination_code(key: CombinationKey, combination: tuple[int, ...], num_experts: int) -> int:
    """The code :func:`combination_codes` gives a token of ``combination``."""
    return combination[0] * num_experts + combination[1] if key is CombinationKey.LEADING_PAIR else combination[0]


def codes_of_sorted(key: CombinationKey, first: torch.Tensor, second: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Code of each token's combination from its heaviest (``first``) and second-heaviest (``second``) expert:
    ``a * E + b`` (a <= b) for the leading pair, the expert id for the leading expert. Tensor ops only (no
    data-dependent control flow: the compiled all-resident path traces it)."""
    if key is CombinationKey.LEADING_EXPERT:
        return first
    return torch.minimum(first, second) * num_experts + torch.maximum(first, second)


def combination_codes(key: CombinationKey, index: torch.Tensor, weights: torch.Tensor,
                      num_experts: int) -> torch.Tensor:
    """Code of each token's combination under ``key`` (see :func:`codes_of_sorted`): (T,) int64."""
    first, second = leading_pairs(index, weights)
    return codes_of_sorted(key, first, second, num_experts)


def combination_counts(key: CombinationKey, index: torch.Tensor, weights: torch.Tensor,
                       num_experts: int) -> torch.Tensor:
    """Tokens per combination code: (``key.code_count(E)``,) int64."""
    codes = combination_codes(key, index, weights, num_experts)
    return torch.bincount(codes, minlength=key.code_count(num_experts))


def counts_by_combination(key: CombinationKey, counts: torch.Tensor, num_experts: int
                          ) -> dict[tuple[int, ...], int]:
    """{combination: tokens} of those seen at least once, from counts indexed by code (any shape whose flat
    order is the codes': an (E, E) pair matrix or an (E,) vector)."""
    flat = counts.reshape(-1)
    if key is CombinationKey.LEADING_PAIR:
        return counts_by_pair(flat.view(num_experts, num_experts))
    return {(int(e),): int(n) for e, n in enumerate(flat.tolist()) if n > 0}


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
    return combination_codes(CombinationKey.LEADING_PAIR, index, weights, num_experts)


def pair_counts(index: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per leading pair: (E, E) int64, count of (a, b) at [a, b] with a < b, zero elsewhere."""
    return combination_counts(CombinationKey.LEADING_PAIR, index, weights, num_experts).view(num_experts, num_experts)


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
