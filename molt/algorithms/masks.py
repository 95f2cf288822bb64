"""Loss masks for padded completions [B rows, T completion tokens]."""

from __future__ import annotations

import torch
from torch import Tensor


def completion_loss_mask(
    completion_ids: Tensor, eos_id: int, num_generated: Tensor | None = None
) -> Tensor:
    """m_it = (no EOS in ids[i, :t]) and (t < num_generated_i) [B, T] bool.

    The generated tokens of completions padded with the EOS id (Hugging Face
    generate): every EOS after the first is padding; a truncated completion (no
    EOS) is all generated. `num_generated` [B] cuts each row at its length, the
    only way to express a zero-length completion.
    Example: eos_id 2, completion_ids [[5, 6, 2, 2, 2], [7, 8, 9, 4, 3]]
    -> [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]; with num_generated [3, 0]
    -> [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]].
    """
    is_eos = completion_ids == eos_id
    eos_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    mask = ~eos_before
    if num_generated is not None:
        positions = torch.arange(completion_ids.shape[-1], device=completion_ids.device)
        mask = mask & (positions[None, :] < num_generated[:, None])
    return mask
