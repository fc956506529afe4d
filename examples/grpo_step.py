"""The trainer half shared by both examples: score rollouts with the policy on each token's kept
set, then one clipped GRPO/PPO step.

A rollout is what the engine returned for one completion: prompt and generated token ids, the
engine's log-prob of each generated token (``logprobs_mode="processed_logprobs"``: pi_old
normalised over the token's kept set) and its sampling mask, in whatever form it arrived
(``completion.sampling_mask``, its ``.token_ids`` rows, or the HTTP compact dict): the
``vllm_sampling_mask.training`` functions take them all.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm_sampling_mask.training import (
    IGNORE_INDEX,
    importance_ratio_metrics,
    kept_probability_mass,
    pack_padded_batch,
    support_logprobs,
)


def add_rollout_args(parser: argparse.ArgumentParser, weights_of: str) -> None:
    """The options both examples take: model, group size, sampling, dtype, the ratio check."""
    parser.add_argument("model", nargs="?", help="model directory (default: build a tiny one)")
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--dtype", default="float32",
                        help=f"weights of both {weights_of} and policy (float32: identical scores)")
    parser.add_argument("--max-ratio-error", type=float, default=None,
                        help="exit 1 if the kept-set mean ratio is further than this from 1")


@dataclass(frozen=True)
class Rollout:
    """One completion as the engine returned it (``T`` generated tokens)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # [T] pi_old of each generated token, on its kept set
    sampling_mask: Any  # T rows in any form support_logprobs accepts


def toy_rewards(rollouts: list[Rollout]) -> torch.Tensor:
    """``[B] float32``: a stand-in for a real reward (share of even token ids), so that the
    completions of one prompt differ and GRPO advantages are not all zero."""
    return torch.tensor([sum(t % 2 == 0 for t in r.token_ids) / max(len(r.token_ids), 1)
                         for r in rollouts])


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's std (``[B]`` -> ``[B]``);
    the completions of one prompt are ``group_size`` consecutive entries."""
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    return (centred / (groups.std(dim=1, keepdim=True, unbiased=False) + 1e-6)).view(-1)


def grpo_step(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, rollouts: list[Rollout],
              group_size: int, temperature: float, clip_eps: float = 0.2) -> dict[str, Any]:
    """Score ``rollouts`` (``B`` completions, ``group_size`` per prompt, in prompt order) with
    ``policy`` on the kept sets, take one clipped-surrogate step, return the metrics."""
    device = next(policy.parameters()).device
    sequences = [r.prompt_token_ids + r.token_ids for r in rollouts]
    batch, length = len(sequences), max(len(s) for s in sequences)
    input_ids = torch.zeros((batch, length), dtype=torch.long)  # right-padded with id 0
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    labels = torch.full((batch, length), IGNORE_INDEX)  # labels[b, l]: the token l predicts
    old_logprobs = torch.zeros((batch, length))
    for b, (rollout, sequence) in enumerate(zip(rollouts, sequences)):
        input_ids[b, :len(sequence)] = torch.tensor(sequence)
        attention_mask[b, :len(sequence)] = 1
        first = len(rollout.prompt_token_ids) - 1  # the position that predicts token 0
        labels[b, first:first + len(rollout.token_ids)] = torch.tensor(rollout.token_ids)
        old_logprobs[b, first:first + len(rollout.token_ids)] = torch.tensor(rollout.logprobs)
    positions = labels != IGNORE_INDEX  # [B, L] bool: positions that score a generated token

    logits = policy(input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device)).logits  # [B, L, V]
    # Row b * L + l of the masks is the kept set of labels[b, l] (empty rows elsewhere).
    masks = pack_padded_batch([r.sampling_mask for r in rollouts], positions.to(device))
    kept, full = support_logprobs(logits.view(batch * length, -1),
                                  labels.view(-1).to(device), masks, temperature=temperature,
                                  return_full=True)
    kept, full = kept.view(batch, length), full.view(batch, length)  # pi_theta, [B, L]
    old_logprobs, positions = old_logprobs.to(device), positions.to(device)

    advantages = group_advantages(toy_rewards(rollouts), group_size).to(device)[:, None]
    ratio = torch.exp(kept - old_logprobs)  # pi_theta / pi_old, both on the kept set
    surrogate = torch.minimum(ratio * advantages,
                              ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages)
    loss = -surrogate[positions].mean()
    optimizer.zero_grad()
    loss.backward()
    grad_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in policy.parameters()
                              if p.grad is not None))
    optimizer.step()
    return {
        "sequences": batch,
        "tokens": int(positions.sum()),
        "loss": loss.item(),
        "grad_norm": grad_norm,
        "kept_set": importance_ratio_metrics(kept, old_logprobs, valid=positions),
        "full_vocab": importance_ratio_metrics(full, old_logprobs, valid=positions),
        "kept_mass_mean": kept_probability_mass(kept[positions], full[positions]).mean().item(),
    }


def report(metrics: dict[str, Any], max_ratio_error: float | None) -> int:
    """Print the step's metrics; the exit status: 1 if the loss or gradient is not finite or
    (with ``max_ratio_error``) the kept-set mean ratio is further than that from 1."""
    kept, full = metrics["kept_set"], metrics["full_vocab"]
    print(f"{metrics['sequences']} completions, {metrics['tokens']} tokens: "
          f"loss {metrics['loss']:.4f}, gradient norm {metrics['grad_norm']:.4f}")
    print(f"pi_theta / pi_old on the kept set:   mean {kept['ratio_mean']:.4f}, "
          f"max |log ratio| {kept['log_ratio_abs_max']:.2e}")
    print(f"pi_theta / pi_old on the full vocab: mean {full['ratio_mean']:.4f} "
          f"(the kept probability mass, {metrics['kept_mass_mean']:.4f}: the bias masks remove)")
    failures = []
    if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
        failures.append("loss or gradient not finite")
    if max_ratio_error is not None and not abs(kept["ratio_mean"] - 1.0) <= max_ratio_error:
        failures.append(f"kept-set mean ratio {kept['ratio_mean']} further than "
                        f"{max_ratio_error} from 1")
    for failure in failures:
        print(f"FAIL: {failure}")
    return 1 if failures else 0
