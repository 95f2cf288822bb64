"""Loss masks for padded completions.

Shape legend: B rows, T completion tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def completion_loss_mask(
    completion_ids: Tensor, eos_id: int, num_generated: Tensor | None = None
) -> Tensor:
    """Bool [B, T]: the generated tokens of each padded completion, up to and including
    the first EOS.

    When the tokenizer pads with its EOS id, an EOS in the completion is either
    the one the model generated or padding. Generation stops at the first EOS,
    so only the first one is generated; every later position is padding.
    A completion without EOS (truncated at max length) is all generated.
    `num_generated` [B], if given, also cuts each row at its generated length,
    the only way to express a zero-length completion in a padded tensor.

    m_it = (no EOS in ids[i, :t]) and (t < num_generated_i); no paper: the
    padding convention of Hugging Face generate.
    Shapes: completion_ids [B, T] long, num_generated [B] -> [B, T] bool.
    Empty input ([0, T], [B, 0]) -> an all-false mask of the same shape.

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
