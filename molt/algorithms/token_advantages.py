"""Per-token advantages: GAE for a value model, on-policy distillation, reward placement.

No gradient flows through these functions (their inputs are detached):
advantages are targets, not predictions.
"""

from __future__ import annotations

import torch
from torch import Tensor


def outcome_token_rewards(rewards: Tensor, loss_mask: Tensor) -> Tensor:
    """r_it = R_i if t is row i's last loss token else 0 [B, T], as GAE expects it.

    The outcome reward of RLHF PPO (Ouyang et al. 2022, arXiv:2203.02155); a row
    with no loss token gets none. Example: rewards [1., 2.], loss_mask
    [[1, 1, 0], [0, 1, 1]] -> [[0., 1., 0.], [0., 0., 2.]].
    """
    num_tokens = loss_mask.shape[-1]
    if num_tokens == 0:  # argmax over an empty axis raises
        return torch.zeros(loss_mask.shape, dtype=rewards.dtype, device=rewards.device)
    last = num_tokens - 1 - loss_mask.flip(-1).int().argmax(-1)  # [B]
    positions = torch.arange(num_tokens, device=loss_mask.device)
    at_last = (positions[None, :] == last[:, None]) & loss_mask
    placed = rewards.detach()[:, None].expand(loss_mask.shape)
    return torch.where(at_last, placed, torch.zeros_like(placed))


def gae_advantages(
    token_rewards: Tensor, values: Tensor, loss_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the generated tokens of each row.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE"
    (arXiv:1506.02438):
        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1},   returns_t = A_t + V_t
    The time axis is the *generated* tokens only: prompt, tool and environment
    tokens (mask false) are skipped, so a tool reply between two assistant turns
    neither discounts nor bootstraps. After the last generated token V = 0.

    Returns (advantages [B, T], returns [B, T]).
    Example: one row, token_rewards [[0, 0, 1]], values [[0.5, 0.6, 0.7]], all
    valid, gamma 0.9, lam 0.5: delta = [0.04, 0.03, 0.3],
    A = [[0.11425, 0.165, 0.3]], returns = [[0.61425, 0.765, 1.0]].
    """
    token_rewards, values = token_rewards.detach(), values.detach()
    next_value = values.new_zeros(values.shape[:1])  # [B]
    running = torch.zeros_like(next_value)
    columns = []
    for t in reversed(range(values.shape[-1])):
        valid = loss_mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        running = torch.where(valid, candidate, running)
        next_value = torch.where(valid, values[:, t], next_value)
        columns.append(torch.where(valid, candidate, torch.zeros_like(candidate)))
    advantages = torch.stack(columns[::-1], dim=-1) if columns else torch.zeros_like(values)
    returns = torch.where(loss_mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


def distillation_advantages(
    rollout_logprobs: Tensor, teacher_logprobs: Tensor, loss_mask: Tensor, beta: float = 1.0
) -> Tensor:
    """On-policy distillation: A_t = -beta * (log pi(y_t) - log pi_teacher(y_t)).

    The per-token reverse KL estimate on the student's own samples, used as a
    dense advantage (Agarwal et al. 2024, "On-Policy Distillation of Language
    Models", arXiv:2306.13649; Thinking Machines 2025, "On-Policy
    Distillation"). Tokens the teacher likes more than the student get a
    positive advantage. Example: rollout_logprobs [[-1.0, -2.0]],
    teacher_logprobs [[-0.5, -3.0]], mask all true, beta 1 -> [[0.5, -1.0]].
    """
    gap = torch.where(loss_mask, rollout_logprobs.detach() - teacher_logprobs.detach(), 0.0)
    return torch.where(loss_mask, -beta * gap, torch.zeros_like(gap))
