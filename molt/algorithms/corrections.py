"""Off-policy corrections between the engine's and the trainer's logprobs.

Kernels, precision and staleness make the trainer's `train_logprobs` differ from
the engine's `rollout_logprobs` for the same tokens. Each correction turns the
per-token log ratio  d_t = train_logprobs - rollout_logprobs  into a `Correction`:

    weight [B, T]  detached, finite, >= 0, exactly 0 where dropped
    keep   [B, T]  bool, loss_mask minus the dropped tokens

Apply it as  where(keep, weight * per_token_loss, 0)  with `apply_correction`,
and pass `keep` as the loss_mask of the policy loss, so a dropped token's
overflowing ratio is never exponentiated. A NaN or -inf log ratio is always
dropped (TIS caps +inf). A dropped token still counts in the loss denominator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from molt.algorithms.losses import MAX_LOG_RATIO, PolicyLoss, ppo_clip_loss


@dataclass(frozen=True)
class Correction:
    """weight [B, T] float, keep [B, T] bool (module docstring)."""

    weight: Tensor
    keep: Tensor


def _log_gap(train_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """d_t on valid tokens, 0 elsewhere; may be +-inf or NaN on valid tokens."""
    gap = train_logprobs.detach() - rollout_logprobs.detach()
    return torch.where(loss_mask, gap, 0.0)


def _weights_where(keep: Tensor, log_weight: Tensor) -> Tensor:
    """exp(log_weight) where keep, exactly 0 elsewhere; exp never sees a dropped value."""
    safe = torch.where(keep, log_weight, 0.0)
    return torch.where(keep, safe.exp(), 0.0)


def no_correction(
    train_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor
) -> Correction:
    """w_t = 1, keep = loss_mask: on-policy runs, or when the anchor is the rollout."""
    del train_logprobs, rollout_logprobs
    return Correction(loss_mask.float(), loss_mask)


def truncated_is(
    train_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, cap: float
) -> Correction:
    """Token-level truncated importance sampling (TIS): w_t = min(exp(d_t), cap).

    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training" (fengyao.notion.site). Computed as
    exp(min(d_t, log cap)), so d_t = 89 gives cap, not inf.
    Example: d [[0., log 3, -1.]], cap 2 -> weight [[1., 2., 0.3679]].
    """
    gap = _log_gap(train_logprobs, rollout_logprobs, loss_mask)
    keep = loss_mask & (gap > -math.inf)  # also false for NaN
    return Correction(_weights_where(keep, gap.clamp(max=math.log(cap))), keep)


def icepop(
    train_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, low: float, high: float
) -> Correction:
    """IcePop: w_t = M(exp(d_t)), M(k) = k if low <= k <= high else 0 (dropped).

    Ling Team 2025, "Small Leak Can Sink a Great Ship: Boost RL Training on
    MoE with IcePop" (ring-1t report).
    Example: d [[0., 89., log 0.25]], low 0.5, high 5 -> weight [[1., 0., 0.]],
    keep [[T, F, F]].
    """
    gap = _log_gap(train_logprobs, rollout_logprobs, loss_mask)
    keep = loss_mask & (gap >= math.log(low)) & (gap <= math.log(high))
    return Correction(_weights_where(keep, gap), keep)


def sequence_mis(
    train_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, cap: float
) -> Correction:
    """Sequence-level masked IS: rho = exp(sum_t d_t); keep the row iff rho <= cap, weight rho.

    Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse
    from the Training-Inference Mismatch" (seq-MIS): rejecting instead of
    truncating removes the bias of a truncated weight on outlier sequences.
    Example: rows d [[0.1, 0.2], [1., 1.]], cap 2: rho = [1.3499, 7.389]
    -> weight [[1.3499, 1.3499], [0., 0.]].
    """
    gap = _log_gap(train_logprobs, rollout_logprobs, loss_mask)
    seq_gap = gap.sum(-1, keepdim=True)  # [B, 1]
    keep = loss_mask & (seq_gap > -math.inf) & (seq_gap <= math.log(cap))
    return Correction(_weights_where(keep, seq_gap.expand_as(gap)), keep)


def geometric_mis(
    train_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, low: float, high: float
) -> Correction:
    """Geometric-mean masking: keep a row iff exp(mean_t d_t) lies in [low, high]; weight 1.

    Liu et al. 2025 (as `sequence_mis`); the per-token geometric mean does
    not grow with length, so one band suits short and long answers. It is a
    rejection filter only: kept rows are not reweighted.
    Example: rows d [[0.1, -0.1], [0.5, 0.7]], band [0.5, 1.5]: means [0, 0.6],
    exp = [1, 1.8221] -> weight [[1., 1.], [0., 0.]].
    """
    gap = _log_gap(train_logprobs, rollout_logprobs, loss_mask)
    mean_gap = gap.sum(-1, keepdim=True) / loss_mask.sum(-1, keepdim=True).clamp(min=1)
    inside = (mean_gap >= math.log(low)) & (mean_gap <= math.log(high))
    keep = loss_mask & inside
    return Correction(keep.float(), keep)


def apply_correction(per_token_loss: Tensor, correction: Correction) -> Tensor:
    """where(keep, weight * loss, 0) [B, T]: dropped tokens give exactly 0 and 0 gradient,
    even with NaN or inf in the loss."""
    weighted = correction.weight * per_token_loss
    return torch.where(correction.keep, weighted, torch.zeros_like(weighted))


def decoupled_ppo_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    behaviour_cap: float | None = None,
) -> PolicyLoss:
    """Decoupled PPO: clip around a proximal policy, reweight by the behaviour ratio.

        L_t = -(pi_prox / pi_behav) * min(r_t A_t, clip(r_t) A_t),  r_t = pi / pi_prox
    Hilton et al. 2022, "Batch size-invariance for policy optimization"
    (arXiv:2110.00641); used for asynchronous RL by AReaL (arXiv:2505.24298).
    pi_behav is the engine (`rollout_logprobs`), pi_prox the trainer's
    recomputation at the start of the step. The behaviour weight is truncated
    at `behaviour_cap` (None: e^MAX_LOG_RATIO bound only).
    Example: prox = behav (fresh data) reduces to PPO with old = prox.
    """
    cap = behaviour_cap if behaviour_cap is not None else math.exp(MAX_LOG_RATIO)
    behaviour = truncated_is(proximal_logprobs, rollout_logprobs, loss_mask, cap)
    inner: PolicyLoss = ppo_clip_loss(
        logprobs, proximal_logprobs, advantages, behaviour.keep, clip_low, clip_high
    )
    return replace(inner, per_token_loss=apply_correction(inner.per_token_loss, behaviour))
