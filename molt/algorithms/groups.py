"""Group structure of a batch of trajectory rows, and per-group statistics.

A *row* is one trajectory segment (DESIGN §3). Rows with the same `prompt_id`
form a *group*; rows with the same (`prompt_id`, `rollout_id`) are the segments
of one *rollout* and share its reward. Group statistics count every rollout
once, so a 4-turn failure does not outweigh a 1-turn success.

Shape legend: N rows, R rollouts, G groups, T tokens per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class RolloutIndex:
    """How rows map to rollouts and rollouts to groups.

    row_rollout:     [N] long, index of each row's rollout in 0..R-1
    rollout_group:   [R] long, index of each rollout's group in 0..G-1
    rollout_rewards: [R] float, the one reward of each rollout
    num_groups:      G
    """

    row_rollout: Tensor
    rollout_group: Tensor
    rollout_rewards: Tensor
    num_groups: int


def index_rollouts(
    prompt_ids: Sequence[str], rollout_ids: Sequence[str], rewards: Tensor
) -> RolloutIndex:
    """Collapse rows to rollouts and number the groups, in order of first appearance.

    Row order is free: each reward stays with its own row's rollout. Example:
    prompt_ids ["p", "p", "p", "q"], rollout_ids ["a", "a", "b", "c"], rewards
    [1., 1., 0., 2.] -> row_rollout [0, 0, 1, 2], rollout_group [0, 0, 1],
    rollout_rewards [1., 0., 2.], num_groups 2.

    Raises:
        ValueError: lengths differ, or segments of one rollout carry different rewards.
    """
    _check_lengths(prompt_ids, rollout_ids, rewards)
    rollout_of_key: dict[tuple[str, str], int] = {}
    group_of_prompt: dict[str, int] = {}
    row_rollout: list[int] = []
    rollout_group: list[int] = []
    first_reward: list[float] = []
    for prompt_id, rollout_id, reward in zip(prompt_ids, rollout_ids, rewards.tolist()):
        key = (prompt_id, rollout_id)
        if key not in rollout_of_key:
            rollout_of_key[key] = len(rollout_group)
            rollout_group.append(group_of_prompt.setdefault(prompt_id, len(group_of_prompt)))
            first_reward.append(reward)
        elif first_reward[rollout_of_key[key]] != reward:
            raise ValueError(
                f"segments of one rollout must share one reward; got "
                f"{first_reward[rollout_of_key[key]]} and {reward} for prompt_id "
                f"{prompt_id!r}, rollout_id {rollout_id!r}; hint: give every segment "
                f"of a multi-turn rollout the rollout's final reward"
            )
        row_rollout.append(rollout_of_key[key])
    device = rewards.device
    return RolloutIndex(
        row_rollout=torch.tensor(row_rollout, dtype=torch.long, device=device),
        rollout_group=torch.tensor(rollout_group, dtype=torch.long, device=device),
        rollout_rewards=torch.tensor(first_reward, dtype=rewards.dtype, device=device),
        num_groups=len(group_of_prompt),
    )


def _check_lengths(prompt_ids: Sequence[str], rollout_ids: Sequence[str], rewards: Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D, one per row; got shape {tuple(rewards.shape)}; "
            f"hint: pass the `reward` column, not a per-token tensor"
        )
    if not len(prompt_ids) == len(rollout_ids) == rewards.numel():
        raise ValueError(
            f"prompt_ids, rollout_ids and rewards must have one entry per row; got "
            f"{len(prompt_ids)}, {len(rollout_ids)} and {rewards.numel()}; hint: "
            f"take all three from the same record batch"
        )


@dataclass(frozen=True)
class GroupStats:
    """Per-group statistics of one value per rollout.

    count: [G] float, rollouts in the group
    mean:  [G] float
    std:   [G] float, Bessel-corrected (divides by count - 1); 0 for a group of one
    flat:  [G] bool, every value in the group is exactly equal (max == min)
    """

    count: Tensor
    mean: Tensor
    std: Tensor
    flat: Tensor


def group_stats(values: Tensor, group_ids: Tensor, num_groups: int) -> GroupStats:
    """Mean, std and flatness of `values` [R] per group, with `group_ids` [R] in 0..G-1.

        mean_g = sum_g x / n_g,  std_g = sqrt(sum_g (x - mean_g)^2 / (n_g - 1))
    (Bessel, as GRPO in TRL and verl). `flat` is max == min, since in fp32 seven
    rewards of 0.35 have a std that is not exactly 0. A zero std has zero
    gradient, not NaN; a group id with no member gets count 0, mean 0, std 0, flat.
    Example: values [1., 0., 0.35, 0.35], group_ids [0, 0, 1, 1] -> count [2, 2],
    mean [0.5, 0.35], std [0.7071, 0.], flat [False, True].
    """
    count = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    count.index_add_(0, group_ids, torch.ones_like(values))
    total = torch.zeros_like(count).index_add_(0, group_ids, values)
    mean = total / count.clamp(min=1)
    centred = values - mean[group_ids]
    squares = torch.zeros_like(count).index_add_(0, group_ids, centred * centred)
    variance = squares / (count - 1).clamp(min=1)
    zero = variance == 0  # sqrt'(0) = inf would make 0 * inf = NaN gradients
    std = torch.where(zero, 0.0, torch.where(zero, 1.0, variance).sqrt())
    high = torch.zeros_like(count).scatter_reduce_(0, group_ids, values, "amax", include_self=False)
    low = torch.zeros_like(count).scatter_reduce_(0, group_ids, values, "amin", include_self=False)
    return GroupStats(count=count, mean=mean, std=std, flat=high == low)


def rows_to_tokens(row_values: Tensor, loss_mask: Tensor) -> Tensor:
    """A_it = v_i if loss_mask_it else 0 [N, T]: one value per row over its loss tokens.

    Outcome supervision (GRPO, Shao et al. 2024, arXiv:2402.03300).
    Example: row_values [0.5, -0.5], loss_mask [[1, 1, 0], [0, 0, 0]]
    -> [[0.5, 0.5, 0.], [0., 0., 0.]].
    """
    spread = row_values[:, None].expand(loss_mask.shape)
    return torch.where(loss_mask, spread, torch.zeros_like(spread))
