"""Per-step diagnostics as flat dicts of floats; every key names its reduction.

Keys read `<quantity>/<reduction>`: `count` and `sum` add up, `mean` and
`frac` are token-weighted means (by `tokens/count`), `max` and `min` are
extrema. `merge_token_metrics` combines micro-batches and ranks by exactly
these rules.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from molt.algorithms.corrections import Correction
from molt.algorithms.groups import RolloutIndex, group_stats, index_rollouts
from molt.algorithms.losses import PolicyLoss


def _mean(values: Tensor, mask: Tensor) -> float:
    total = torch.where(mask, values.detach().double(), 0.0).sum()
    return float(total / max(int(mask.sum()), 1))


def _extreme(values: Tensor, mask: Tensor, largest: bool) -> float:
    if not bool(mask.any()):
        return 0.0
    picked = values.detach()[mask]
    return float(picked.max() if largest else picked.min())


def policy_step_metrics(
    loss_mask: Tensor,
    advantages: Tensor,
    policy_loss: PolicyLoss | None = None,
    correction: Correction | None = None,
    train_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    token_kl: Tensor | None = None,
    entropy: Tensor | None = None,
) -> dict[str, float]:
    """Token-level diagnostics of one micro-batch, reduced over its valid tokens.

    Always: tokens/count, advantage/{mean,min,max,zero_frac}. With
    `policy_loss`: clip/{low_frac,high_frac,dual_frac}, ratio/{mean,max},
    ppo_kl/mean = mean of r - 1 - log r (k3). With `correction`: is/masked_frac
    (valid tokens it dropped), is/weight_mean. With both logprobs:
    logprob_diff/{abs_mean,abs_max}. With `token_kl`: kl/mean. With `entropy`:
    entropy/mean. x/mean = sum_t m_t x_t / max(sum_t m_t, 1).
    Example: on the first on-policy step (train == rollout logprobs) every
    ratio is 1, so clip/*_frac = 0, ppo_kl/mean = 0, logprob_diff/abs_max = 0.
    """
    mask = loss_mask
    out = {"tokens/count": float(mask.sum())}
    out |= {
        "advantage/mean": _mean(advantages, mask),
        "advantage/min": _extreme(advantages, mask, largest=False),
        "advantage/max": _extreme(advantages, mask, largest=True),
        "advantage/zero_frac": _mean((advantages == 0).float(), mask),
    }
    if policy_loss is not None:
        out |= _ratio_metrics(policy_loss, mask)
    if correction is not None:
        out["is/masked_frac"] = _mean((mask & ~correction.keep).float(), mask)
        out["is/weight_mean"] = _mean(correction.weight, correction.keep)
    if train_logprobs is not None and rollout_logprobs is not None:
        gap = torch.where(mask, (train_logprobs.detach() - rollout_logprobs).abs(), 0.0)
        out["logprob_diff/abs_mean"] = _mean(gap, mask)
        out["logprob_diff/abs_max"] = _extreme(gap, mask, largest=True)
    if token_kl is not None:
        out["kl/mean"] = _mean(token_kl, mask)
    if entropy is not None:
        out["entropy/mean"] = _mean(entropy, mask)
    return out


def _ratio_metrics(policy_loss: PolicyLoss, mask: Tensor) -> dict[str, float]:
    ratio = policy_loss.ratio
    return {
        "clip/low_frac": _mean(policy_loss.clipped_low.float(), mask),
        "clip/high_frac": _mean(policy_loss.clipped_high.float(), mask),
        "clip/dual_frac": _mean(policy_loss.dual_clipped.float(), mask),
        "ratio/mean": _mean(ratio, mask),
        "ratio/max": _extreme(ratio, mask, largest=True),
        "ppo_kl/mean": _mean(ratio - 1.0 - ratio.log(), mask),
    }


def merge_token_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine `policy_step_metrics` of micro-batches or ranks by each key's reduction.

    mean/frac: sum_k n_k x_k / max(sum_k n_k, 1), n_k = tokens/count; [] -> {}.
    Example: [{"tokens/count": 1, "kl/mean": 0.2, "ratio/max": 1.1},
              {"tokens/count": 3, "kl/mean": 0.6, "ratio/max": 1.3}]
    -> {"tokens/count": 4, "kl/mean": 0.5, "ratio/max": 1.3}.
    """
    weights = [part["tokens/count"] for part in parts]
    total = sum(weights)
    merged: dict[str, float] = {}
    for key in parts[0] if parts else []:
        values = [part[key] for part in parts]
        if key.endswith(("count", "sum")):
            merged[key] = sum(values)
        elif key.endswith("max"):
            merged[key] = max(values)
        elif key.endswith("min"):
            merged[key] = min(values)
        else:
            merged[key] = sum(w * v for w, v in zip(weights, values)) / max(total, 1.0)
    return merged


def group_metrics(
    prompt_ids: Sequence[str],
    rollout_ids: Sequence[str],
    rewards: Tensor,
    finish_reasons: Sequence[str],
    row_advantages: Tensor | None = None,
) -> dict[str, float]:
    """Rollout- and group-level diagnostics of an advantage batch (each rollout counted once).

    Keys: rollouts/count, groups/count, reward/{mean,std (Bessel)},
    rollouts/truncated_frac (any row finished with "length"), groups/flat_frac,
    groups/all_truncated_frac (every rollout truncated), and with
    `row_advantages` [N] advantage/{std,abs_max}. Inputs are the batch's N rows.
    Example: one group of four rollouts, rewards [1, 1, 1, 1], all "length"
    -> groups/flat_frac 1.0, groups/all_truncated_frac 1.0.
    """
    index = index_rollouts(prompt_ids, rollout_ids, rewards)
    truncated = _truncated_rollouts(index, finish_reasons)  # [R] bool
    truncated_share = group_stats(truncated.float(), index.rollout_group, index.num_groups)
    reward_stats = group_stats(index.rollout_rewards, index.rollout_group, index.num_groups)
    num_groups = max(index.num_groups, 1)
    out = {
        "rollouts/count": float(index.rollout_rewards.numel()),
        "groups/count": float(index.num_groups),
        "reward/mean": _plain_mean(index.rollout_rewards),
        "reward/std": _plain_std(index.rollout_rewards),
        "rollouts/truncated_frac": _plain_mean(truncated),
        "groups/flat_frac": float(reward_stats.flat.sum()) / num_groups,
        "groups/all_truncated_frac": float((truncated_share.mean == 1.0).sum()) / num_groups,
    }
    if row_advantages is not None:
        per_rollout = torch.zeros_like(index.rollout_rewards)
        per_rollout.index_copy_(0, index.row_rollout, row_advantages.to(per_rollout.dtype))
        out["advantage/std"] = _plain_std(per_rollout)
        out["advantage/abs_max"] = float(per_rollout.abs().max()) if per_rollout.numel() else 0.0
    return out


def _truncated_rollouts(index: RolloutIndex, finish_reasons: Sequence[str]) -> Tensor:
    """[R] bool: a row of the rollout finished with "length"."""
    if len(finish_reasons) != index.row_rollout.numel():
        raise ValueError(
            f"finish_reasons must have one entry per row; got {len(finish_reasons)} for "
            f"{index.row_rollout.numel()} rows; hint: take it from the same record batch"
        )
    truncated = torch.zeros_like(index.rollout_rewards, dtype=torch.bool)
    hit_rows = [row for row, reason in enumerate(finish_reasons) if reason == "length"]
    truncated[index.row_rollout[hit_rows]] = True
    return truncated


def _plain_mean(values: Tensor) -> float:
    return float(values.double().mean()) if values.numel() else 0.0


def _plain_std(values: Tensor) -> float:
    return float(values.double().std()) if values.numel() > 1 else 0.0
