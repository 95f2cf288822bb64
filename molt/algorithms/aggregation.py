"""Reduce a per-token loss [B, T] to this micro-batch's share of the step's loss.

Every mode divides by a *global* count over the whole optimizer step (all
data-parallel ranks, all gradient-accumulation micro-batches), which the pack
stage sends with the step (DESIGN §8). So the shares of all micro-batches on
all ranks sum to the full-batch loss, whatever the split:

    token_mean              sum_it l_it / N_tokens                  DAPO, arXiv:2503.14476
    seq_mean_token_mean     sum_i (sum_t l_it / n_i) / N_seqs       GRPO, arXiv:2402.03300
    seq_mean_token_sum      sum_it l_it / (N_seqs * normalizer)     Dr.GRPO, arXiv:2503.20783

with n_i = sum_t m_it the valid tokens of row i, N_tokens = sum_it m_it and
N_seqs = sum_i any_t m_it over the whole step, and `normalizer` a constant such
as the max generation length.

Call backward on each share and let gradients *sum*: under DDP/FSDP, whose
all-reduce averages over ranks, multiply the share by the world size.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AggregationMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


def count_loss_tokens(loss_mask: Tensor) -> tuple[int, int]:
    """(N_tokens, N_seqs) of a micro-batch (module docstring); sum them over the step.

    Example: [[1, 1, 0], [0, 0, 0], [1, 0, 0]] -> (3, 2); empty or all-false -> (0, 0).
    """
    return int(loss_mask.sum()), int(loss_mask.any(-1).sum())


def _check_global(name: str, global_count: int, local_count: int) -> None:
    if global_count < local_count:
        raise ValueError(
            f"{name} is smaller than this micro-batch's own count; got {global_count} < "
            f"{local_count}; hint: pass the whole step's count (all ranks and "
            f"micro-batches) from the pack stage, not a local one"
        )


def aggregate_loss(
    per_token_loss: Tensor,
    loss_mask: Tensor,
    mode: AggregationMode,
    global_num_tokens: int,
    global_num_seqs: int,
    normalizer: float | None = None,
) -> Tensor:
    """This micro-batch's share of the step loss (0-dim), by `mode` (module docstring).

    Example: two rows, A with 4 valid tokens of loss 1.0, B with 6 tokens all
    masked: token_mean with global_num_tokens 4 -> 1.0 (not 4/10 = 0.4).
    A global count of 0 is read as 1 (an empty step).
    """
    local_tokens, local_seqs = count_loss_tokens(loss_mask)
    _check_global("global_num_tokens", global_num_tokens, local_tokens)
    _check_global("global_num_seqs", global_num_seqs, local_seqs)
    masked = torch.where(loss_mask, per_token_loss, torch.zeros_like(per_token_loss))
    if mode == "token_mean":
        return masked.sum() / max(global_num_tokens, 1)
    if mode == "seq_mean_token_mean":
        per_seq = masked.sum(-1) / loss_mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(global_num_seqs, 1)
    if mode == "seq_mean_token_sum":
        if normalizer is None or normalizer <= 0:
            raise ValueError(
                f"seq_mean_token_sum needs a positive constant normalizer; got "
                f"{normalizer}; hint: set it to the max generation length (Dr.GRPO)"
            )
        return masked.sum() / (max(global_num_seqs, 1) * normalizer)
    raise ValueError(
        f"unknown aggregation mode; got {mode!r}; hint: use 'token_mean', "
        f"'seq_mean_token_mean' or 'seq_mean_token_sum'"
    )
