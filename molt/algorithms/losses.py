"""Per-token policy losses: PPO (clip-higher, dual clip), GSPO and CISPO.

Each loss takes the trainer's current `logprobs` [B, T] (with gradient), the
anchor `old_logprobs` [B, T] (the rollout's logprobs, or the proximal policy's
when the trainer recomputes them), `advantages` and `loss_mask` [B, T], and
returns a `PolicyLoss`; reduce its `per_token_loss` with aggregation.py.

A masked token's log ratio is replaced by 0 before any exp, so an overflowing
ratio there (log ratio 89, exp = inf in fp32) cannot give a NaN value or gradient.
Valid log ratios are clamped to +-MAX_LOG_RATIO, beyond which the token has zero
gradient, as under the clip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class PolicyLoss:
    """per_token_loss [B, T] (0 off-mask), ratio [B, T] (detached, 1 off-mask), and
    bool [B, T] flags of tokens whose gradient the clip removed (low: A < 0 and
    ratio under 1 - clip_low; high: A > 0 and ratio over 1 + clip_high) or that
    the dual clip capped."""

    per_token_loss: Tensor
    ratio: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    dual_clipped: Tensor


def masked_log_ratio(logprobs: Tensor, old_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """log r_t = log pi - log pi_old [B, T], clamped to +-MAX_LOG_RATIO; gradient to logprobs only.

    Example: logprobs [[-1., -inf]], old [[-1.5, -1.]], mask [[1, 0]] -> [[0.5, 0.]].
    """
    gap = torch.where(loss_mask, logprobs - old_logprobs.detach(), 0.0)
    return gap.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(
            f"clip range must satisfy 0 <= clip_low < 1 and clip_high >= 0; got "
            f"clip_low={clip_low}, clip_high={clip_high}; hint: PPO uses 0.2/0.2, "
            f"DAPO's clip-higher 0.2/0.28"
        )


def _surrogate(
    ratio: Tensor, adv: Tensor, mask: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    low = mask & (adv < 0) & (ratio < 1.0 - clip_low)
    high = mask & (adv > 0) & (ratio > 1.0 + clip_high)
    return loss, low, high


def _finish(
    loss: Tensor, ratio: Tensor, mask: Tensor, low: Tensor, high: Tensor, dual: Tensor
) -> PolicyLoss:
    per_token = torch.where(mask, loss, torch.zeros_like(loss))
    shown_ratio = torch.where(mask, ratio.detach(), torch.ones_like(ratio))
    return PolicyLoss(per_token, shown_ratio, low, high, dual)


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> PolicyLoss:
    """PPO clipped surrogate with asymmetric clip and optional dual clip.

        r = exp(log pi - log pi_old)
        L = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
        dual clip, for A < 0 only: L = min(L, -dual_clip * A)
    Schulman et al. 2017 (arXiv:1707.06347); clip-higher from DAPO, Yu et al.
    2025 (arXiv:2503.14476); dual clip from Ye et al. 2020 (arXiv:1912.09729),
    which bounds the loss of a negative-advantage token whose ratio exploded.

    Example: log ratios [[0., 0.5, 0.5]], A [[1., 1., -1.]], clip 0.2/0.28,
    dual_clip 1.5: r = [1, 1.6487, 1.6487] -> loss [[-1., -1.28, 1.5]],
    clipped_high [[F, T, F]], dual_clipped [[F, F, T]].
    """
    _check_clip(clip_low, clip_high)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1; got {dual_clip}; hint: 3.0 is usual")
    ratio = masked_log_ratio(logprobs, old_logprobs, loss_mask).exp()
    adv = torch.where(loss_mask, advantages.detach(), 0.0)
    loss, low, high = _surrogate(ratio, adv, loss_mask, clip_low, clip_high)
    dual = torch.zeros_like(loss_mask)
    if dual_clip is not None:
        cap = -dual_clip * adv
        dual = loss_mask & (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    return _finish(loss, ratio, loss_mask, low, high, dual)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> PolicyLoss:
    """GSPO: clip the sequence's geometric-mean ratio instead of each token's.

        s_i = exp( (1/|y_i|) sum_t (log pi - log pi_old) )
        L_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)
    Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071),
    GSPO-token form: s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)], of value s_i and
    gradient s_i * grad log pi(y_t); exactly GSPO under `seq_mean_token_mean`.

    Example: one row, log ratios [[0.1, 0.3]], A 1, clip 3e-4/4e-4:
    s = exp(0.2) = 1.2214 -> clipped to 1.0004, loss [[-1.0004, -1.0004]].
    """
    _check_clip(clip_low, clip_high)
    log_ratio = masked_log_ratio(logprobs, old_logprobs, loss_mask)
    seq_log_ratio = log_ratio.sum(-1) / loss_mask.sum(-1).clamp(min=1)  # [B]
    current = torch.where(loss_mask, logprobs, 0.0)
    token_log_ratio = seq_log_ratio.detach()[:, None] + (current - current.detach())
    ratio = token_log_ratio.exp()
    adv = torch.where(loss_mask, advantages.detach(), 0.0)
    loss, low, high = _surrogate(ratio, adv, loss_mask, clip_low, clip_high)
    return _finish(loss, ratio, loss_mask, low, high, torch.zeros_like(loss_mask))


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    clip_high: float,
    clip_low: float | None = None,
) -> PolicyLoss:
    """CISPO: REINFORCE weighted by a clipped, stop-gradient IS weight.

        L_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A_t * log pi(y_t)
    MiniMax 2025, "MiniMax-M1" (arXiv:2506.13585). Unlike PPO, a clipped
    token keeps its gradient (weight times grad log pi); only the weight is
    capped. clip_low None means no lower bound, as in the paper. The loss
    *value* includes log pi and is not itself meaningful; its gradient is.

    Example: log ratios [[0., 1.]], logprobs [[-1., -2.]], A 1, clip_high 0.5:
    weights [1, 1.5] (e = 2.718 capped) -> loss [[1., 3.]], gradient w.r.t.
    logprobs [[-1., -1.5]], clipped_high [[F, T]].
    """
    ratio = masked_log_ratio(logprobs, old_logprobs, loss_mask).exp().detach()
    low_bound = None if clip_low is None else 1.0 - clip_low
    weight = ratio.clamp(min=low_bound, max=1.0 + clip_high)
    adv = torch.where(loss_mask, advantages.detach(), 0.0)
    current = torch.where(loss_mask, logprobs, 0.0)
    low = loss_mask & (ratio < weight)
    high = loss_mask & (ratio > weight)
    no_dual = torch.zeros_like(loss_mask)
    return _finish(-weight * adv * current, ratio, loss_mask, low, high, no_dual)


def sft_loss(logprobs: Tensor, loss_mask: Tensor) -> PolicyLoss:
    """Supervised fine-tuning: the negative log-likelihood -log pi(y_t) of each demonstrated token.

    No ratio, advantage or clip (ratio 1, no flags); with `token_mean` aggregation
    it is the usual mean token cross-entropy (nats).
    Example: logprobs [[-0.5, -2.0]], mask [[1, 0]] -> per_token_loss [[0.5, 0.0]].
    """
    zeros = torch.zeros_like(loss_mask)
    ones = torch.ones_like(logprobs).detach()
    return PolicyLoss(torch.where(loss_mask, -logprobs, 0.0), ones, zeros, zeros, zeros)
