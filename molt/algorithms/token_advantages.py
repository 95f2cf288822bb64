"""Per-token advantages: GAE for a value model, on-policy distillation, reward placement.

All inputs are padded [B, T] tensors with a bool `loss_mask` [B, T] that is
true exactly on tokens the policy generated. Outputs are exactly 0 outside the
mask. No gradient flows through these functions (their inputs are detached):
advantages are targets, not predictions.

Shape legend: B rows, T tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def outcome_token_rewards(rewards: Tensor, loss_mask: Tensor) -> Tensor:
    """Place each row's reward [B] on its last loss token -> [B, T].

    r_it = R_i if t is row i's last loss token else 0: the outcome reward of
    RLHF PPO (Ouyang et al. 2022, arXiv:2203.02155), as GAE expects it.
    Example: rewards [1., 2.], loss_mask [[1, 1, 0], [0, 1, 1]]
    -> [[0., 1., 0.], [0., 0., 2.]].
    A row with no loss token (zero-length completion) gets no reward anywhere.
    Empty input ([0, T] or [B, 0] mask) -> zeros of the mask's shape.
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

    Example: one row, token_rewards [[0, 0, 1]], values [[0.5, 0.6, 0.7]], all
    valid, gamma 0.9, lam 0.5: delta = [0.04, 0.03, 0.3],
    A = [[0.11425, 0.165, 0.3]], returns = [[0.61425, 0.765, 1.0]].
    An all-false row gives zeros for both outputs; empty input ([0, T] or
    [B, 0]) gives two empty tensors of that shape.

    Returns (advantages [B, T], returns [B, T]).
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
    positive advantage.
    Shapes: rollout_logprobs, teacher_logprobs, loss_mask [B, T] -> [B, T].

    Example: rollout_logprobs [[-1.0, -2.0]], teacher_logprobs [[-0.5, -3.0]],
    mask all true, beta 1 -> [[0.5, -1.0]].
    Masked tokens get 0 even when their logprobs are -inf or NaN; an all-masked
    or empty ([0, T], [B, 0]) input gives zeros of its shape.
    """
    valid = loss_mask
    gap = torch.where(valid, rollout_logprobs.detach() - teacher_logprobs.detach(), 0.0)
    return torch.where(valid, -beta * gap, torch.zeros_like(gap))
