"""Arrow list columns <-> padded tensors, for stages that apply tensor functions.

``padded(batch, "loss_mask", torch.bool)`` turns a ``list<bool>`` column of N rows
into a right-padded ``[N, T]`` tensor (``T`` = longest row; padding = 0/False) and
``unpadded(values, lengths, pa.float32())`` turns a ``[N, T]`` tensor back into a
list column whose row ``i`` has ``lengths[i]`` values.
Example: rows ``[[1, 2], [3]]`` -> ``[[1, 2], [3, 0]]`` -> ``[[1, 2], [3]]``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch


def row_lengths(batch: pa.RecordBatch, column: str) -> np.ndarray:
    """[N] number of values in each row of a list column (null rows count 0)."""
    return np.array(batch.column(column).value_lengths().fill_null(0).to_numpy(zero_copy_only=False))


def padded(batch: pa.RecordBatch, column: str, dtype: torch.dtype) -> torch.Tensor:
    """[N, T] right-padded tensor of a list column.

    Raises:
        ValueError: the column is missing or holds nulls inside a row.
    """
    if column not in batch.schema.names:
        raise ValueError(f"column {column!r} is not in the batch; got {batch.schema.names}")
    lengths = row_lengths(batch, column)
    flat = batch.column(column).flatten()
    if flat.null_count:
        raise ValueError(f"column {column!r}: a row holds null values; per-token columns are dense")
    values = torch.from_numpy(np.array(flat.to_numpy(zero_copy_only=False)))  # a writable copy
    out = torch.zeros((len(lengths), int(lengths.max(initial=0))), dtype=dtype)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(lengths, dtype=torch.long))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.zeros(0, np.int64)
    cols = torch.arange(len(values)) - torch.repeat_interleave(torch.as_tensor(starts, dtype=torch.long),
                                                                torch.as_tensor(lengths, dtype=torch.long))
    out[rows, cols] = values.to(dtype)
    return out


def unpadded(values: torch.Tensor, lengths: np.ndarray, type_: pa.DataType) -> pa.ListArray:
    """A list column from a ``[N, T]`` tensor, row ``i`` cut to ``lengths[i]``."""
    keep = torch.arange(values.shape[1])[None, :] < torch.as_tensor(lengths)[:, None]
    flat = values[keep].detach().cpu().numpy()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=type_))
