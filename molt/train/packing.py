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


def prefix_units(rows: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[bool]] | None,
                 prompt_keys: Sequence[object] | None = None) -> list[tuple[list[int], int]]:
    """Rows that share their prompt, as (row indices, shared prefix length P), in first-appearance order.

    A row's prompt is its tokens before its first ``loss_mask`` token. Rows with the same
    prompt tokens (and the same ``prompt_keys`` entry, e.g. the row's images, when given),
    each longer than it, form one unit that is forwarded as the prompt once
    plus every row's rest (`pack_sequences`); any other row is a unit of its own with P 0.
    Example: rows [1, 2, 7], [1, 2, 8, 9], [3, 4] with masks [F, F, T], [F, F, T, T],
    [F, T] -> [([0, 1], 2), ([2], 0)].
    """
    if loss_masks is None:
        return [([i], 0) for i in range(len(rows))]
    units: dict[tuple[object, ...], list[int]] = {}
    order: list[tuple[object, ...] | int] = []
    for i, (row, mask) in enumerate(zip(rows, loss_masks)):
        prompt = next((j for j, m in enumerate(mask) if m), len(row))
        if 1 <= prompt < len(row):
            key = (*row[:prompt], prompt_keys[i]) if prompt_keys is not None else tuple(row[:prompt])
            if key not in units:
                units[key] = []
                order.append(key)
            units[key].append(i)
        else:
            order.append(i)
    out: list[tuple[list[int], int]] = []
    for entry in order:
        if isinstance(entry, int):
            out.append(([entry], 0))
        else:
            prefix = len(entry) - (prompt_keys is not None)
            out.append((units[entry], prefix if len(units[entry]) > 1 else 0))
    return out


def unit_tokens(rows: Sequence[Sequence[int]], units: list[tuple[list[int], int]]) -> list[int]:
    """Tokens each unit forwards: P + sum over its rows of (length - P)."""
    return [prefix + sum(len(rows[i]) - prefix for i in members) for members, prefix in units]


@dataclass(frozen=True)
class PackedSequence:
    """One micro-batch as one sequence.

    input_ids, position_ids [1, S]; ``lengths`` [R] the rows' token counts (in row order);
    ``segments`` the attention segments in order, each (length, P, suffix lengths): P 0 is
    one row attending causally to itself, P > 0 a shared prompt of P tokens followed by
    each row's rest, which attends to the prompt and causally to itself (positions
    continue at P). ``token_index`` [sum lengths] is the packed position of every row
    token, rows in order; ``starts`` [R] where each row's first token is.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    starts: list[int]
    lengths: list[int]
    segments: list[tuple[int, int, list[int]]]
    token_index: torch.Tensor

    def attention_masks(self, device: torch.device | str) -> list[tuple[int, torch.Tensor | None]]:
        """(length, mask) per segment: None for a causal row, else a boolean [L, L] (True = attend)."""
        out: list[tuple[int, torch.Tensor | None]] = []
        for length, prefix, parts in self.segments:
            if not prefix:
                out.append((length, None))
                continue
            part = torch.zeros(length, dtype=torch.long)  # 0 = the prompt, k = the k-th row's rest
            bounds = torch.tensor([prefix, *parts]).cumsum(0)
            for k in range(len(parts)):
                part[int(bounds[k]):int(bounds[k + 1])] = k + 1
            q, k_ = torch.arange(length)[:, None], torch.arange(length)[None, :]
            mask = (k_ <= q) & ((part[None, :] == 0) | (part[None, :] == part[:, None]))
            out.append((length, mask.to(device)))
        return out

    def targets(self, loss_masks: Sequence[Sequence[bool]] | None = None) -> tuple[torch.Tensor, ...]:
        """(pred, target, slot) [N]: token ``input_ids[slot]`` of the flat row-major token list is
        predicted by the hidden state at packed position ``pred``; every token but a row's first,
        or only the ``loss_masks`` tokens."""
        pred, target, slot = [], [], []
        flat = self.input_ids[0]
        offset = 0
        for r, n in enumerate(self.lengths):
            index = self.token_index[offset:offset + n]
            for j in range(1, n):
                if loss_masks is None or loss_masks[r][j]:
                    pred.append(int(index[j - 1]))
                    target.append(int(flat[index[j]]))
                    slot.append(offset + j)
            offset += n
        return torch.tensor(pred, dtype=torch.long), torch.tensor(target, dtype=torch.long), \
            torch.tensor(slot, dtype=torch.long)


def pack_sequences(rows: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[bool]] | None = None,
                   prompt_keys: Sequence[object] | None = None) -> PackedSequence:
    """Concatenate token rows; positions restart at 0 per row (module docstring example).

    With ``loss_masks``, rows that share their prompt (`prefix_units`) are packed as the
    prompt once followed by each row's rest: rows [1, 2, 7] and [1, 2, 8, 9] with prompt
    [1, 2] -> input_ids [[1, 2, 7, 8, 9]], position_ids [[0, 1, 2, 2, 3]]; the rows'
    logprobs are the same as packed apart (attention never crosses from one row's rest
    to another's), for P + 3 instead of 2P + 3 forwarded tokens. ``prompt_keys``: rows share
    a prompt only if their keys are equal too (`prefix_units`; a VLM's rows: their images).

    Raises:
        ValueError: no rows, or an empty row (column ``token_ids``).
    """
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError(f"cannot pack an empty micro-batch or an empty row; got lengths "
                         f"{[len(r) for r in rows]}; hint: column 'token_ids' needs >= 1 token per row")
    ids: list[int] = []
    positions: list[int] = []
    index: list[list[int]] = [[] for _ in rows]
    segments: list[tuple[int, int, list[int]]] = []
    for members, prefix in prefix_units(rows, loss_masks, prompt_keys):
        start = len(ids)
        ids += rows[members[0]][:prefix]
        positions += range(prefix)
        parts = []
        for i in members:
            rest = rows[i][prefix:]
            index[i] = list(range(start, start + prefix)) + list(range(len(ids), len(ids) + len(rest)))
            ids += rest
            positions += range(prefix, prefix + len(rest))
            parts.append(len(rest))
        segments.append((len(ids) - start, prefix, parts if prefix else []))
    lengths = [len(r) for r in rows]
    return PackedSequence(torch.tensor(ids, dtype=torch.long)[None, :], torch.tensor(positions)[None, :],
                          [ix[0] for ix in index], lengths, segments,
                          torch.tensor([t for ix in index for t in ix], dtype=torch.long))
