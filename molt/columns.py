"""Arrow list columns of N rows <-> right-padded [N, T] tensors (T = longest row, padding 0).

Example: rows ``[[1, 2], [3]]`` -> `padded` ``[[1, 2], [3, 0]]`` -> `unpadded` ``[[1, 2], [3]]``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch


def row_lengths(batch: pa.RecordBatch, column: str) -> np.ndarray:
    """[N] values in each row of a list column (null rows count 0)."""
    lengths = batch.column(column).value_lengths().fill_null(0)
    return np.array(lengths.to_numpy(zero_copy_only=False))


def padded(batch: pa.RecordBatch, column: str, dtype: torch.dtype) -> torch.Tensor:
    """[N, T] tensor of a list column; ValueError if it is missing or holds nulls in a row."""
    if column not in batch.schema.names:
        raise ValueError(f"column {column!r} is not in the batch; got {batch.schema.names}")
    lengths = row_lengths(batch, column)
    flat = batch.column(column).flatten()
    if flat.null_count:
        raise ValueError(f"column {column!r}: a row holds null values; per-token columns are "
                         "dense")
    values = torch.from_numpy(np.array(flat.to_numpy(zero_copy_only=False)))  # a writable copy
    out = torch.zeros((len(lengths), int(lengths.max(initial=0))), dtype=dtype)
    counts = torch.as_tensor(lengths, dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    starts = torch.cumsum(counts, 0) - counts
    cols = torch.arange(len(values)) - torch.repeat_interleave(starts, counts)
    out[rows, cols] = values.to(dtype)
    return out


def unpadded(values: torch.Tensor, lengths: np.ndarray, type_: pa.DataType) -> pa.ListArray:
    """A list column of a ``[N, T]`` tensor, row ``i`` cut to ``lengths[i]``."""
    keep = torch.arange(values.shape[1])[None, :] < torch.as_tensor(lengths)[:, None]
    flat = values[keep].detach().cpu().numpy()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=type_))
