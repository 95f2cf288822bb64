"""DAPO extras: dynamic sampling, soft overlong punishment, entropy bonus.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale" (arXiv:2503.14476). Clip-higher lives in losses.py (clip_high) and
token-level loss in aggregation.py (token_mean).

Shape legend: B rows, T tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class GroupSelection:
    """Decision of `select_informative_groups`, indices into the candidate groups.

    keep:     groups that fill this step, in arrival order
    surplus:  informative groups beyond the target (hold them for the next step)
    dropped:  flat groups (`is_flat`)
    num_more_needed: informative groups still missing; admit at least this many
              more prompts before the step can start
    """

    keep: list[int]
    surplus: list[int]
    dropped: list[int]
    num_more_needed: int


def is_flat(rewards: Sequence[float]) -> bool:
    """max r == min r, True for 0 or 1 reward: a zero-advantage group."""
    return len(rewards) == 0 or max(rewards) == min(rewards)


def select_informative_groups(
    group_rewards: Sequence[Sequence[float]], num_groups_per_step: int
) -> GroupSelection:
    """DAPO dynamic sampling: keep = the first num_groups_per_step groups not `is_flat`.

    Pass each candidate group's row rewards in arrival order (segments repeat
    their rollout's reward, which cannot change whether a group is flat).
    Example: groups [[1, 0], [1, 1], [0, 0, 1], [0.5, 0.5], [0, 1]] with 2 per
    step -> keep [0, 2], surplus [4], dropped [1, 3], num_more_needed 0;
    with 4 per step -> keep [0, 2, 4], num_more_needed 1. An empty group is flat.
    """
    if num_groups_per_step < 1:
        raise ValueError(
            f"num_groups_per_step must be >= 1; got {num_groups_per_step}; hint: "
            f"set the pack stage's groups per step"
        )
    informative = [i for i, rewards in enumerate(group_rewards) if not is_flat(rewards)]
    dropped = [i for i, rewards in enumerate(group_rewards) if is_flat(rewards)]
    keep = informative[:num_groups_per_step]
    return GroupSelection(
        keep=keep,
        surplus=informative[num_groups_per_step:],
        dropped=dropped,
        num_more_needed=num_groups_per_step - len(keep),
    )


def overlong_penalty(num_generated: Tensor, max_length: int, cache_length: int) -> Tensor:
    """DAPO soft overlong punishment, a reward term per row [B] (add it to the score).

        0                              if L <= max_length - cache_length
        ((max_length - cache_length) - L) / cache_length   if inside the cache
        -1                             if L > max_length
    DAPO eq. 13; L = num_generated [B], the generated tokens of the row.
    Example: max_length 20, cache_length 4, L [16, 18, 20, 25] -> [0., -0.5, -1., -1.].
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(
            f"cache_length must be in (0, max_length]; got cache_length={cache_length}, "
            f"max_length={max_length}; hint: DAPO uses 4096 of 20480"
        )
    expected = max_length - cache_length
    ramp = (expected - num_generated.float()) / cache_length
    return ramp.clamp(min=-1.0, max=0.0)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of each next-token distribution, H = logsumexp(z) - sum_v p_v z_v [B, T].

    The entropy DAPO monitors. A -inf logit adds 0, not NaN; a position whose
    logits are all -inf (or V = 0) gives 0 with zero gradient.
    Example: logits [[[0., 0.]]] -> [[log 2]] = [[0.6931]]; [[[0., -inf]]] -> [[0.]].
    """
    dead = ~logits.isfinite().any(-1, keepdim=True)  # every entry masked: no distribution
    logits = torch.where(dead, 0.0, logits)
    log_norm = logits.logsumexp(-1)
    probs = logits.softmax(-1)
    finite = torch.where(logits.isfinite(), logits, 0.0)
    return torch.where(dead[..., 0], 0.0, log_norm - (probs * finite).sum(-1))


def entropy_bonus(entropy: Tensor, loss_mask: Tensor, coef: float) -> Tensor:
    """Per-token loss term -coef * H [B, T], maximising entropy; aggregate it with the loss.

    The entropy regulariser of PPO (Schulman et al. 2017, arXiv:1707.06347, eq. 9).
    Example: H [[0.7, 0.1]], mask [[1, 0]], coef 0.01 -> [[-0.007, 0.]].
    """
    bonus = -coef * entropy
    return torch.where(loss_mask, bonus, torch.zeros_like(bonus))
