"""KL estimators against a reference policy, as a loss term or folded into the reward.

With d_t = log pi(y_t) - log pi_ref(y_t) on tokens sampled from pi
(Schulman 2020, "Approximating KL Divergence", joschu.net/blog/kl-approx.html):

    k1 = d                      unbiased, can be negative, high variance
    k2 = d^2 / 2                biased, low variance
    k3 = exp(-d) - 1 + d        unbiased, always >= 0, low variance

k3 explodes when pi puts far less mass than pi_ref on a token (d = -100 gives
exp(100) = inf in fp32). We clamp d to +-max_log_ratio *in value only*: the
gradient is dk/dd at the clamped d, so both stay finite and the penalty keeps
pulling the policy back instead of going silent.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3"]


def _clamped_log_ratio(
    logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor, max_log_ratio: float
) -> Tensor:
    """d on valid tokens, value clamped to +-max_log_ratio, gradient d/dlogprobs = 1."""
    current = torch.where(loss_mask, logprobs, 0.0)
    ref = torch.where(loss_mask, ref_logprobs.detach(), 0.0)
    clamped = (current.detach() - ref).clamp(-max_log_ratio, max_log_ratio)
    return clamped + (current - current.detach())


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    loss_mask: Tensor,
    estimator: KLEstimator = "k3",
    max_log_ratio: float = 10.0,
) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate [B, T] (module docstring).

    Example: logprobs [[-1.0, -100.0]], ref_logprobs [[-1.5, 0.0]], k3,
    max_log_ratio 10: d = [0.5, -100 -> -10]
    -> [[exp(-0.5) - 1 + 0.5, exp(10) - 1 - 10]] = [[0.1065, 22015.4658]],
    gradient w.r.t. logprobs [[1 - exp(-0.5), 1 - exp(10)]] = [[0.3935, -22025.4658]].
    """
    if max_log_ratio <= 0:
        raise ValueError(f"max_log_ratio must be > 0; got {max_log_ratio}; hint: 10 is usual")
    d = _clamped_log_ratio(logprobs, ref_logprobs, loss_mask, max_log_ratio)
    if estimator == "k1":
        value = d
    elif estimator == "k2":
        value = 0.5 * d * d
    elif estimator == "k3":
        value = torch.exp(-d) - 1.0 + d
    else:
        raise ValueError(f"unknown KL estimator; got {estimator!r}; hint: use 'k1', 'k2' or 'k3'")
    return torch.where(loss_mask, value, torch.zeros_like(value))


def fold_kl_into_rewards(rewards: Tensor, token_kl: Tensor, coef: float) -> Tensor:
    """KL-in-reward: r_i - coef * sum_t kl_it [B], no gradient, before advantages.

    InstructGPT-style penalty (Ouyang et al. 2022, arXiv:2203.02155). A row with
    no valid token keeps its reward. Example: rewards [1.0, 0.0], token_kl
    [[0.1, 0.2], [0.0, 0.5]], coef 0.1 -> [0.97, -0.05].
    """
    return rewards.detach() - coef * token_kl.detach().sum(-1)
