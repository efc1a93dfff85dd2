"""The relative accuracy loss with its standard error (crisp_tools.loss_estimate), and the decode that stops
early (crisp_tools.serving_eval.decode_windows(stop=)): what the throughput search accepts or stops on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from crisp_tools.calibration import contiguous_windows, load_model
from crisp_tools.loss_estimate import LossEstimate, paired_advantage, relative_loss
from crisp_tools.serving_eval import decode_windows
from crisp_tools.text import read_texts

ROOT = Path(__file__).resolve().parents[1]


def _hits(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def test_the_ratio_is_the_relative_accuracy_loss():
    ref = _hits([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])  # 9 right
    cand = _hits([[1, 0, 1, 0], [1, 1, 0, 1], [0, 0, 1, 1]])  # 7 right; one gained where the reference missed
    est = relative_loss(ref, cand)
    acc_ref, acc = ref.double().mean(), cand.double().mean()
    assert est.loss == pytest.approx(float((acc_ref - acc) / acc_ref)) and est.windows == 3
    # by hand: a = (3, 2, 4), d = (1, -1, 2), R = 2 / 9
    r = 2 / 9
    spread = ((1 - 3 * r) ** 2 + (-1 - 2 * r) ** 2 + (2 - 4 * r) ** 2) * 3 / 2
    assert est.standard_error == pytest.approx(math.sqrt(spread) / 9)


def test_paired_advantage_by_hand_and_as_a_difference_of_losses():
    ref = _hits([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])  # a = (3, 2, 4), 9 right
    crisp = _hits([[1, 0, 1, 0], [1, 1, 0, 1], [1, 1, 1, 1]])  # (2, 3, 4)
    base = _hits([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1]])  # (1, 2, 2)
    est = paired_advantage(ref, crisp, base)
    # e = (1, 1, 2), R = 4 / 9: acc ahead of the baseline over the reference's accuracy
    assert est.loss == pytest.approx(4 / 9) and est.windows == 3
    assert est.loss == pytest.approx(relative_loss(ref, base).loss - relative_loss(ref, crisp).loss)
    r = 4 / 9
    spread = ((1 - 3 * r) ** 2 + (1 - 2 * r) ** 2 + (2 - 4 * r) ** 2) * 3 / 2
    assert est.standard_error == pytest.approx(math.sqrt(spread) / 9)
    flipped = paired_advantage(ref, base, crisp)  # the baseline ahead: the same size, negative
    assert flipped.loss == pytest.approx(-est.loss) and flipped.standard_error == pytest.approx(est.standard_error)


def test_paired_advantage_is_tighter_than_the_losses_when_decodes_share_their_misses():
    gen = torch.Generator().manual_seed(0)
    ref = torch.rand(64, 100, generator=gen) < 0.7
    hard = torch.rand(64, 100, generator=gen) < 0.2  # tokens both pruned decodes miss
    crisp = ref & ~hard
    base = crisp & ~(torch.rand(64, 100, generator=gen) < 0.02)  # the baseline misses a few more
    ahead = paired_advantage(ref, crisp, base)
    assert ahead.loss > 0
    assert ahead.standard_error < min(relative_loss(ref, crisp).standard_error, relative_loss(ref, base).standard_error)


@pytest.mark.parametrize("shapes", [((2, 3), (2, 3), (2, 4)), ((2, 3), (3, 3), (2, 3)), ((0, 3), (0, 3), (0, 3))])
def test_paired_advantage_refuses_mismatched_hits(shapes):
    a, b, c = (torch.zeros(s, dtype=torch.bool) for s in shapes)
    with pytest.raises(ValueError, match="paired_advantage"):
        paired_advantage(a, b, c)


def test_identical_decodes_lose_nothing_with_no_spread():
    ref = _hits([[1, 0, 1], [0, 1, 1]])
    est = relative_loss(ref, ref.clone())
    assert est == LossEstimate(0.0, 0.0, 2)
    assert est.upper(1.645) == 0.0 == est.lower(1.645)


def test_one_window_has_no_standard_error():
    est = relative_loss(_hits([[1, 1, 1, 1]]), _hits([[1, 1, 0, 1]]))
    assert est.loss == 0.25 and math.isinf(est.standard_error)
    assert est.upper(0) == 0.25 and math.isinf(est.upper(1.645))  # only the point estimate can decide


def test_the_interval_scales_with_z():
    est = LossEstimate(0.01, 0.004, 16)
    assert est.upper(1.645) == pytest.approx(0.01658) and est.lower(1.645) == pytest.approx(0.00342)


def test_a_reference_that_predicts_nothing_reports_no_loss():
    est = relative_loss(_hits([[0, 0], [0, 0]]), _hits([[1, 0], [0, 0]]))
    assert est.loss == 0.0


@pytest.mark.parametrize("a, b", [((2, 3), (3, 2)), ((2, 3), (2, 4)), ((0, 3), (0, 3)), ((6,), (6,))])
def test_shapes_that_cannot_pair_are_refused(a, b):
    with pytest.raises(ValueError, match="relative_loss"):
        relative_loss(torch.ones(a, dtype=torch.bool), torch.ones(b, dtype=torch.bool))


def test_decode_stops_where_asked_and_keeps_what_it_decoded():
    model, _ = load_model(ROOT / "models/tiny-mixtral")
    windows = contiguous_windows(read_texts([ROOT / "data/stdlib-heldout.txt"]), 4, 9)
    whole = decode_windows(model, windows)
    asked = []

    def stop(scores):
        asked.append(scores.correct.shape[0])
        return scores.correct.shape[0] == 2

    part = decode_windows(model, windows, stop=stop)
    assert asked == [1, 2] and part.correct.shape == (2, 8)
    assert torch.equal(part.correct, whole.correct[:2]) and torch.allclose(part.nll, whole.nll[:2])
    asked.clear()
    never = decode_windows(model, windows, stop=lambda s: asked.append(s.correct.shape[0]) or False)
    assert asked == [1, 2, 3] and torch.equal(never.correct, whole.correct)  # not asked after the last window
