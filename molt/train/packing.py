"""Step planning and sequence packing: which rows go to which rank and micro-batch,
and how one micro-batch becomes one packed sequence.

Planning (`plan_step`), for one optimizer step of N rows with token counts ``n_i``:

1. Ranks: rows sorted by length, longest first, each to the data-parallel rank with
   the fewest tokens so far (LPT greedy; ties to the lowest rank). A row is never split.
2. Micro-batches, per rank: first-fit decreasing into bins of at most
   ``max_tokens`` tokens; a row longer than ``max_tokens`` gets a bin of its own.
3. Every rank gets the same number ``M`` of micro-batches (the most any rank needs);
   a rank with fewer has empty ones at the end, which the trainer runs as a one-token
   dummy forward/backward with zero loss (FSDP collectives must match across ranks).

Example: lengths [5, 4, 3, 2], world_size 2, max_tokens 6 -> dp_rank [0, 1, 1, 0]
(7 tokens each); rank 0's rows (5, 2) and rank 1's rows (4, 3) do not fit one bin of 6,
so micro_batch [0, 0, 1, 1] and M = 2.

Packing (`pack_sequences`): the rows of one micro-batch are concatenated into one
sequence ``[1, S]`` with ``position_ids`` restarting at 0 for every row; transformers
derives a block-diagonal causal mask from the restarts (no row attends to another).
Example: rows [7, 8, 9] and [4, 5] -> input_ids [[7, 8, 9, 4, 5]],
position_ids [[0, 1, 2, 0, 1]], starts [0, 3].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepPlan:
    """Placement of every row of a step: ``dp_rank[i]``, ``micro_batch[i]``; ``M`` per rank."""

    dp_rank: list[int]
    micro_batch: list[int]
    num_micro_batches: int


def balance_ranks(lengths: Sequence[int], world_size: int) -> list[int]:
    """Rank of each row: longest first, each to the rank with the fewest tokens (LPT).

    Example: [5, 4, 3, 2] over 2 ranks -> [0, 1, 1, 0] (7 tokens each).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}; hint: set pack's world_size "
                         "to the train stage's world_size")
    totals = [0] * world_size
    ranks = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (totals[r], r))
        ranks[i] = rank
        totals[rank] += lengths[i]
    return ranks


def fill_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[int]:
    """Bin of each row: first-fit decreasing into bins of <= max_tokens tokens.

    A row longer than ``max_tokens`` is placed alone (never split).
    Example: [3, 5, 2, 4], max_tokens 6 -> bins {5}, {4, 2}, {3} -> [2, 0, 1, 1].
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1; got {max_tokens}")
    used: list[int] = []
    bins = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fit = next((b for b, u in enumerate(used) if u + lengths[i] <= max_tokens), None)
        if fit is None:
            used.append(0)
            fit = len(used) - 1
        used[fit] += lengths[i]
        bins[i] = fit
    return bins


def plan_step(lengths: Sequence[int], world_size: int, max_tokens: int) -> StepPlan:
    """Place every row of one step on a rank and a micro-batch (module docstring).

    Example: [5, 4, 3, 2], world_size 2, max_tokens 6 -> dp_rank [0, 1, 1, 0],
    micro_batch [0, 0, 1, 1], num_micro_batches 2.
    """
    ranks = balance_ranks(lengths, world_size)
    micro = [0] * len(lengths)
    num = 1
    for rank in range(world_size):
        rows = [i for i, r in enumerate(ranks) if r == rank]
        bins = fill_micro_batches([lengths[i] for i in rows], max_tokens)
        for i, b in zip(rows, bins):
            micro[i] = b
        num = max(num, max(bins, default=-1) + 1)
    return StepPlan(ranks, micro, num)


@dataclass(frozen=True)
class PackedSequence:
    """One micro-batch as one sequence. input_ids, position_ids [1, S]; starts [R] int."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    starts: list[int]
    lengths: list[int]


def pack_sequences(rows: Sequence[Sequence[int]]) -> PackedSequence:
    """Concatenate token rows; positions restart at 0 per row (module docstring example).

    Raises:
        ValueError: no rows, or an empty row (column ``token_ids``).
    """
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError(f"cannot pack an empty micro-batch or an empty row; got lengths "
                         f"{[len(r) for r in rows]}; hint: column 'token_ids' needs >= 1 token per row")
    lengths = [len(r) for r in rows]
    ids = torch.tensor([t for r in rows for t in r], dtype=torch.long)[None, :]
    positions = torch.cat([torch.arange(n) for n in lengths])[None, :]
    starts = [sum(lengths[:k]) for k in range(len(lengths))]
    return PackedSequence(ids, positions, starts, lengths)
