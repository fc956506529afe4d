"""Importance-ratio and rollout/trainer mismatch metrics, as RL trainers log them.

Notation, per generated token ``t`` (tokens were sampled from pi_old by the rollout engine):

    lp_theta[t]   trainer log-prob (``support_logprobs``: kept set; or full vocabulary)
    lp_old[t]     rollout log-prob returned by the engine (processed: kept set)
    log_ratio[t] = lp_theta[t] - lp_old[t],   ratio[t] = exp(log_ratio[t])

With identical weights and matching supports every ratio is 1. Scoring the kept-set pi_old with
a full-vocabulary pi_theta makes ``ratio[t]`` exactly the kept probability mass of token ``t``'s
distribution, i.e. a bias below 1.
"""

from __future__ import annotations

import math

import torch

DEFAULT_RATIO_BAND = 0.1
"""``ratio_outside_band`` counts ratios outside ``[1 - band, 1 + band]``."""


def importance_ratio_metrics(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    valid: torch.Tensor | None = None,
    ratio_band: float = DEFAULT_RATIO_BAND,
) -> dict[str, float]:
    """Summaries of ``ratio = exp(trainer_logprobs - rollout_logprobs)`` over valid tokens.

    Args:
        trainer_logprobs: ``[*] float`` lp_theta of the sampled tokens.
        rollout_logprobs: ``[*] float`` lp_old of the same tokens (same shape).
        valid: optional ``[*] bool``; False entries (padding, prompt) are left out.
        ratio_band: half-width of the band around 1 for ``ratio_outside_band``.

    Returns (computed in float64; when no token is valid ``num_tokens`` is 0 and every other
    value NaN):
        ``num_tokens``: number of valid tokens.
        ``ratio_mean``: mean of ``ratio``.
        ``ratio_outside_band``: fraction of tokens with ``ratio`` outside
            ``[1 - ratio_band, 1 + ratio_band]``.
        ``kl_k1``: mean of ``lp_old - lp_theta``; unbiased estimate of KL(pi_old || pi_theta)
            from tokens sampled from pi_old, but noisy and can be negative.
        ``kl_k3``: mean of ``ratio - 1 - log(ratio)`` (Schulman's k3); always >= 0, lower
            variance, and unbiased for the same KL when pi_theta sums to 1 over pi_old's
            support: exactly what kept-set renormalisation restores.
        ``log_ratio_abs_max``: max of ``|lp_theta - lp_old|``.

    Raises ``ValueError`` if the shapes differ.
    """
    if trainer_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(
            f"trainer_logprobs and rollout_logprobs must have the same shape, got "
            f"{tuple(trainer_logprobs.shape)} and {tuple(rollout_logprobs.shape)}."
        )
    log_ratio = (trainer_logprobs.detach().double()
                 - rollout_logprobs.detach().to(trainer_logprobs.device).double())
    if valid is not None:
        if valid.shape != log_ratio.shape:
            raise ValueError(
                f"valid must have the logprobs' shape {tuple(log_ratio.shape)}, got "
                f"{tuple(valid.shape)}."
            )
        log_ratio = log_ratio[valid.to(device=log_ratio.device, dtype=torch.bool)]
    log_ratio = log_ratio.reshape(-1)
    num_tokens = log_ratio.numel()
    if num_tokens == 0:
        nan = math.nan
        return {"num_tokens": 0.0, "ratio_mean": nan, "ratio_outside_band": nan,
                "kl_k1": nan, "kl_k3": nan, "log_ratio_abs_max": nan}
    ratio = torch.exp(log_ratio)
    outside = (ratio < 1.0 - ratio_band) | (ratio > 1.0 + ratio_band)
    return {
        "num_tokens": float(num_tokens),
        "ratio_mean": ratio.mean().item(),
        "ratio_outside_band": outside.double().mean().item(),
        "kl_k1": (-log_ratio).mean().item(),
        "kl_k3": (ratio - 1.0 - log_ratio).mean().item(),
        "log_ratio_abs_max": log_ratio.abs().max().item(),
    }


def kept_probability_mass(kept_logprobs: torch.Tensor, full_logprobs: torch.Tensor) -> torch.Tensor:
    """Probability mass of each token's kept set under the full-vocabulary softmax.

    ``full - kept = logsumexp(z[kept set]) - logsumexp(z)``, so the mass is
    ``exp(full_logprobs - kept_logprobs)``; both come from ``support_logprobs(...,
    return_full=True)``. Shapes ``[*] float``; returns ``[*] float32`` in ``(0, 1]``.
    """
    return torch.exp(full_logprobs.detach().float() - kept_logprobs.detach().float())
