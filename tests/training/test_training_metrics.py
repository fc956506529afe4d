"""Importance-ratio metrics and kept mass against hand computations."""

import math

import pytest
import torch

from vllm_sampling_mask.training import (
    PackedMasks,
    importance_ratio_metrics,
    kept_probability_mass,
    support_logprobs,
)


def test_metrics_by_hand() -> None:
    trainer = torch.tensor([-1.0, -2.0, -3.0, -0.5])
    rollout = torch.tensor([-1.0, -2.2, -2.9, -0.5])
    log_ratios = [0.0, 0.2, -0.1, 0.0]  # trainer - rollout
    ratios = [math.exp(d) for d in log_ratios]
    metrics = importance_ratio_metrics(trainer, rollout)
    assert metrics["num_tokens"] == 4
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / 4, abs=1e-6)
    assert metrics["ratio_outside_band"] == pytest.approx(1 / 4)  # e^0.2 = 1.22 > 1.1 only
    assert metrics["kl_k1"] == pytest.approx(-sum(log_ratios) / 4, abs=1e-6)
    assert metrics["kl_k3"] == pytest.approx(
        sum(r - 1 - d for r, d in zip(ratios, log_ratios)) / 4, abs=1e-6)
    assert metrics["log_ratio_abs_max"] == pytest.approx(0.2, abs=1e-6)
    wide = importance_ratio_metrics(trainer, rollout, ratio_band=0.25)
    assert wide["ratio_outside_band"] == 0


def test_valid_mask_and_empty_selection() -> None:
    trainer = torch.tensor([[0.0, -5.0], [-1.0, -1.0]])
    rollout = torch.tensor([[0.0, -1.0], [-1.5, -1.0]])
    valid = torch.tensor([[True, False], [True, True]])
    metrics = importance_ratio_metrics(trainer, rollout, valid)
    assert metrics["num_tokens"] == 3
    assert metrics["ratio_mean"] == pytest.approx((1 + math.exp(0.5) + 1) / 3, abs=1e-6)
    assert metrics["log_ratio_abs_max"] == pytest.approx(0.5)
    empty = importance_ratio_metrics(trainer, rollout, torch.zeros(2, 2, dtype=torch.bool))
    assert empty["num_tokens"] == 0 and math.isnan(empty["ratio_mean"])


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="same shape"):
        importance_ratio_metrics(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="valid must have"):
        importance_ratio_metrics(torch.zeros(3), torch.zeros(3), torch.ones(4, dtype=torch.bool))


def test_kept_mass_and_truncation_bias() -> None:
    """Full-vocabulary pi_theta against kept-set pi_old: the ratio is exactly the kept mass."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 2
    probs = logits.softmax(-1)
    rows = [probs[t].topk(5).indices.sort().values.tolist() for t in range(6)]
    tokens = torch.tensor([row[2] for row in rows])
    kept, full = support_logprobs(logits, tokens, PackedMasks.from_rows(rows), return_full=True)
    mass = kept_probability_mass(kept, full)
    expected_mass = torch.stack([probs[t, rows[t]].sum() for t in range(6)])
    torch.testing.assert_close(mass, expected_mass, atol=1e-6, rtol=1e-5)
    assert (mass < 1).all()
    # Same weights: kept-set ratios are 1; full-vocabulary ratios average the kept mass.
    rollout = kept.detach()
    assert importance_ratio_metrics(kept, rollout)["ratio_mean"] == pytest.approx(1.0)
    full_metrics = importance_ratio_metrics(full, rollout)
    assert full_metrics["ratio_mean"] == pytest.approx(expected_mass.mean().item(), abs=1e-6)
    assert full_metrics["kl_k1"] > 0
