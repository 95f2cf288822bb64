"""Step planning (rows to ranks and micro-batches) and sequence packing.

`plan_step`: 1) rows longest first, each to the rank with the fewest tokens so far (LPT; ties to
the lowest rank); 2) per rank, first-fit decreasing into micro-batches of at most ``max_tokens``
tokens (a longer row alone); 3) every rank gets the same number M of micro-batches. Rows are
never split. Example: lengths [5, 4, 3, 2], world_size 2, max_tokens 6 -> dp_rank [0, 1, 1, 0],
micro_batch [0, 0, 1, 1], M = 2.

`pack_sequences` concatenates a micro-batch's rows into one sequence [1, S] whose
``position_ids`` restart at 0 per row: rows [7, 8, 9] and [4, 5] -> input_ids [[7, 8, 9, 4, 5]],
position_ids [[0, 1, 2, 0, 1]], starts [0, 3].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepPlan:
    """Placement of every row of a step: ``dp_rank[i]``, ``micro_batch[i]``; M per rank."""

    dp_rank: list[int]
    micro_batch: list[int]
    num_micro_batches: int


def balance_ranks(lengths: Sequence[int], world_size: int) -> list[int]:
    """Rank of each row (step 1 of the module docstring)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}; hint: set pack's "
                         "world_size to the train stage's world_size")
    totals = [0] * world_size
    ranks = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (totals[r], r))
        ranks[i] = rank
        totals[rank] += lengths[i]
    return ranks


def fill_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[int]:
    """Bin of each row (step 2). Example: [3, 5, 2, 4], max_tokens 6 -> [2, 0, 1, 1]."""
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
    """Place every row of one step on a rank and a micro-batch (module docstring)."""
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
    """(row indices, shared prompt length P) of rows with the same prompt (tokens before the
    first loss token) and ``prompt_keys``. Example: rows [1, 2, 7], [1, 2, 8, 9], [3, 4], masks
    [F, F, T], [F, F, T, T], [F, T] -> [([0, 1], 2), ([2], 0)].
    """
    if loss_masks is None:
        return [([i], 0) for i in range(len(rows))]
    units: dict[tuple[object, ...], list[int]] = {}
    order: list[tuple[object, ...] | int] = []
    for i, (row, mask) in enumerate(zip(rows, loss_masks)):
        prompt = next((j for j, m in enumerate(mask) if m), len(row))
        if 1 <= prompt < len(row):
            key = tuple(row[:prompt]) if prompt_keys is None else (*row[:prompt], prompt_keys[i])
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
    """One micro-batch as one sequence [1, S]; ``token_index`` [sum lengths]: each row token's
    position. ``segments``: (length, P, rest lengths): one causal row (P 0), or a shared prompt
    then each row's rest, attending to the prompt and causally to itself.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    starts: list[int]
    lengths: list[int]
    segments: list[tuple[int, int, list[int]]]
    token_index: torch.Tensor

    def attention_masks(self, device: torch.device | str) -> list[tuple[int, torch.Tensor | None]]:
        """(length, mask) per segment: None for a causal row, else bool [L, L] (True = attend)."""
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

    def targets(self,
                loss_masks: Sequence[Sequence[bool]] | None = None) -> tuple[torch.Tensor, ...]:
        """(pred, target, slot) [N]: row token ``slot`` (rows in order), id ``target``, predicted
        at packed position ``pred``, for every token but a row's first, or the ``loss_masks``."""
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
        return tuple(torch.tensor(x, dtype=torch.long) for x in (pred, target, slot))


def pack_sequences(rows: Sequence[Sequence[int]],
                   loss_masks: Sequence[Sequence[bool]] | None = None,
                   prompt_keys: Sequence[object] | None = None) -> PackedSequence:
    """Concatenate token rows (module docstring); with ``loss_masks``, a shared prompt once:
    [1, 2, 7], [1, 2, 8, 9] -> input_ids [[1, 2, 7, 8, 9]], position_ids [[0, 1, 2, 2, 3]].

    Raises:
        ValueError: no rows, or an empty row (column ``token_ids``).
    """
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError(f"cannot pack an empty micro-batch or an empty row; got lengths "
                         f"{[len(r) for r in rows]}; hint: column 'token_ids' needs >= 1 token "
                         "per row")
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
            index[i] = [*range(start, start + prefix), *range(len(ids), len(ids) + len(rest))]
            ids += rest
            positions += range(prefix, prefix + len(rest))
            parts.append(len(rest))
        segments.append((len(ids) - start, prefix, parts if prefix else []))
    return PackedSequence(torch.tensor(ids, dtype=torch.long)[None, :],
                          torch.tensor(positions)[None, :], [ix[0] for ix in index],
                          [len(r) for r in rows], segments,
                          torch.tensor([t for ix in index for t in ix], dtype=torch.long))
