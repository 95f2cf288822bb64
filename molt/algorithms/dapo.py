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
    dropped:  flat groups (all rewards equal): zero advantage, no learning signal
    num_more_needed: informative groups still missing; the producer should admit
              at least this many more prompts before the step can start
    """

    keep: list[int]
    surplus: list[int]
    dropped: list[int]
    num_more_needed: int


def is_flat(rewards: Sequence[float]) -> bool:
    """True when every reward is exactly equal (also for 0 or 1 reward).

    flat = (max r == min r): the zero-advantage groups that DAPO's dynamic
    sampling filters out (Yu et al. 2025, arXiv:2503.14476).
    Shapes: rewards, a sequence of n floats -> bool. Empty ([]) -> True.
    """
    return len(rewards) == 0 or max(rewards) == min(rewards)


def select_informative_groups(
    group_rewards: Sequence[Sequence[float]], num_groups_per_step: int
) -> GroupSelection:
    """DAPO dynamic sampling: drop flat groups, keep the step at a fixed number of groups.

    Pass each candidate group's row rewards in arrival order. Segments repeat
    their rollout's reward, which cannot change whether a group is flat, so rows
    may be passed as they come.

    keep = the first num_groups_per_step groups with not is_flat(rewards)
    (Yu et al. 2025, arXiv:2503.14476, dynamic sampling).
    Shapes: G candidate groups of any length each -> GroupSelection of index lists.
    Example: groups [[1, 0], [1, 1], [0, 0, 1], [0.5, 0.5], [0, 1]] with 2 per
    step -> keep [0, 2], surplus [4], dropped [1, 3], num_more_needed 0;
    with 4 per step -> keep [0, 2, 4], num_more_needed 1.
    No candidates -> nothing kept, num_more_needed = num_groups_per_step; an
    empty group is flat and dropped.
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
    (DAPO eq. 13, Yu et al. 2025, arXiv:2503.14476.) L = generated tokens of the row.

    Shapes: num_generated [B] int -> [B] float.
    Example: max_length 20, cache_length 4, L [16, 18, 20, 25] -> [0., -0.5, -1., -1.].
    Empty input ([0]) -> [0]; L = 0 (zero-length completion) -> 0.
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
    """Entropy of each next-token distribution, [B, T, V] logits -> [B, T]:
    H = logsumexp(z) - sum_v p_v z_v.

    Vocabulary entries masked with -inf logits contribute 0 (p = 0), not NaN.
    The entropy DAPO monitors (Yu et al. 2025, arXiv:2503.14476).
    Example: logits [[[0., 0.]]] -> [[log 2]] = [[0.6931]];
    [[[0., -inf]]] -> [[0.]].
    Empty input ([0, T, V], [B, 0, V]) -> [0, T] / [B, 0]; a position whose logits
    are all -inf (or V = 0) -> 0 with zero gradient, not NaN.
    """
    dead = ~logits.isfinite().any(-1, keepdim=True)  # every entry masked: no distribution
    logits = torch.where(dead, 0.0, logits)
    log_norm = logits.logsumexp(-1)
    probs = logits.softmax(-1)
    finite = torch.where(logits.isfinite(), logits, 0.0)
    return torch.where(dead[..., 0], 0.0, log_norm - (probs * finite).sum(-1))


def entropy_bonus(entropy: Tensor, loss_mask: Tensor, coef: float) -> Tensor:
    """Per-token loss term -coef * H [B, T] (maximises entropy), 0 off-mask; aggregate it
    with the policy loss. Example: H [[0.7, 0.1]], mask [[1, 0]], coef 0.01 -> [[-0.007, 0.]].

    The entropy regulariser of PPO (Schulman et al. 2017, arXiv:1707.06347, eq. 9).
    Shapes: entropy, loss_mask [B, T] -> [B, T].
    All-masked or empty ([0, T], [B, 0]) input -> zeros of its shape, zero gradient.
    """
    bonus = -coef * entropy
    return torch.where(loss_mask, bonus, torch.zeros_like(bonus))
