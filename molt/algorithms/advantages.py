"""Outcome advantage estimators: one scalar per rollout, from the rewards of its group.

Every estimator maps (rewards [R] float, group_ids [R] long in 0..G-1) -> [R], one
value per rollout (not per segment), and gives exactly 0, with zero gradient, to
every member of a *flat* group (all rewards equal, or a group of one), however
fp32 rounds the group's mean and std.

Worked example used below: 2 prompts x 3 samples,
    rewards   [1., 0., 0.,   0.5, 0.5, 0.5]
    group_ids [0,  0,  0,    1,   1,   1  ]
Group 0 has mean 1/3 and Bessel std 0.5774; group 1 is flat.

Shape legend: R rollouts, N rows.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from molt.algorithms.groups import group_stats, index_rollouts

Estimator = Callable[[Tensor, Tensor], Tensor]


def _num_groups(group_ids: Tensor) -> int:
    return int(group_ids.max()) + 1 if group_ids.numel() else 0


def _zero_if_flat(advantages: Tensor, flat: Tensor) -> Tensor:
    return torch.where(flat, torch.zeros_like(advantages), advantages)


def grpo_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps).

    Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), outcome supervision.
    std is Bessel-corrected, as in TRL and verl; a flat group gives 0, not
    tiny / (tiny + eps). Example: -> [1.1547, -0.5773, -0.5773, 0., 0., 0.].
    """
    stats = group_stats(rewards, group_ids, _num_groups(group_ids))
    centred = rewards - stats.mean[group_ids]
    return _zero_if_flat(centred / (stats.std[group_ids] + eps), stats.flat[group_ids])


def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr.GRPO: A_i = r_i - mean_g (no std division).

    Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv:2503.20783).
    The other half of Dr.GRPO, no length normalisation, is the aggregation mode
    `seq_mean_token_sum`. Example: -> [0.6667, -0.3333, -0.3333, 0., 0., 0.].
    """
    stats = group_stats(rewards, group_ids, _num_groups(group_ids))
    return _zero_if_flat(rewards - stats.mean[group_ids], stats.flat[group_ids])


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: A_i = r_i - (sum_g - r_i) / (n_g - 1), the mean of the *other* samples.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization" (arXiv:2402.14740). A group of one has no baseline: 0.
    Example: -> [1.0, -0.5, -0.5, 0., 0., 0.].
    """
    num_groups = _num_groups(group_ids)
    stats = group_stats(rewards, group_ids, num_groups)
    total = torch.zeros_like(stats.mean).index_add_(0, group_ids, rewards)
    others = (total[group_ids] - rewards) / (stats.count[group_ids] - 1).clamp(min=1)
    return _zero_if_flat(rewards - others, stats.flat[group_ids])


def _whiten(values: Tensor, eps: float, centre: bool) -> Tensor:
    """(x - mean) / (std + eps) over the whole batch; 0 if all values are equal or < 2."""
    if values.numel() < 2 or bool(values.max() == values.min()):
        return torch.zeros_like(values)
    centred = values - values.mean() if centre else values
    return centred / (values.std() + eps)


def reinforce_pp_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: A_i = (r_i - mean_B) / (std_B + eps), whitened over the batch.

    Hu et al. 2025, "REINFORCE++" (arXiv:2501.03262). Groups are ignored, so a
    flat group is not 0; under 2 rollouts or all rewards equal -> zeros. We
    whiten over rollouts, not tokens as OpenRLHF, so long answers do not
    dominate. For the paper's KL-in-reward form, fold the KL in first (kl.py).
    Example: batch mean 0.4167, std 0.3764
    -> [1.5498, -1.1070, -1.1070, 0.2214, 0.2214, 0.2214].
    """
    del group_ids
    return _whiten(rewards, eps, centre=True)


def reinforce_pp_baseline_advantages(
    rewards: Tensor, group_ids: Tensor, eps: float = 1e-6
) -> Tensor:
    """REINFORCE++-baseline: A_i = (r_i - mean_g) / (std_B(r - mean_g) + eps).

    Hu et al. 2025 (arXiv:2501.03262), the baseline variant. The batch mean of
    group-centred rewards is 0 by construction, so we skip subtracting it and
    flat groups stay exactly 0.
    Example: centred [0.6667, -0.3333, -0.3333, 0, 0, 0], batch std 0.3651
    -> [1.8257, -0.9129, -0.9129, 0., 0., 0.].
    """
    return _whiten(dr_grpo_advantages(rewards, group_ids), eps, centre=False)


def row_advantages(
    estimator: Estimator, prompt_ids: Sequence[str], rollout_ids: Sequence[str], rewards: Tensor
) -> Tensor:
    """Apply `estimator` to the rollouts of N rows -> one advantage per row [N].

    A_row = estimator(rollout_rewards, rollout_group)[rollout(row)] (groups.py):
    segments of one rollout count once and all receive its advantage; a
    zero-length completion is a rollout like any other. Example: prompt_ids
    ["p"] * 5, rollout_ids ["win", "lose", "lose", "lose", "lose"], rewards
    [1, 0, 0, 0, 0] under `dr_grpo_advantages`: baseline 0.5 (not 0.2)
    -> [0.5, -0.5, -0.5, -0.5, -0.5].
    """
    index = index_rollouts(prompt_ids, rollout_ids, rewards)
    per_rollout = estimator(index.rollout_rewards, index.rollout_group)
    return per_rollout[index.row_rollout]
