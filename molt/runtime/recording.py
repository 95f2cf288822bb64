"""Recorded edges: ``RUN_DIR/record/{edge}/{stage}.{replica}.arrow`` per producer replica, in the
uncompressed Arrow IPC stream format (a crash leaves every complete batch readable, a replayed
batch is bit-identical), reading them back, and a readable summary."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa


def edge_dirname(edge_name: str) -> str:
    """``a.out->b.in`` -> ``a.out--b.in``."""
    return edge_name.replace("->", "--")


class RecordWriter:
    """Append record batches to one Arrow IPC stream file, flushed after each; a resumed run
    keeps the first ``keep_batches`` of an existing file (those before its checkpoint).

    Raises:
        ValueError: the existing file holds fewer than ``keep_batches`` batches.
    """

    def __init__(self, path: Path, keep_batches: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: Any = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self.num_rows = self.num_batches = 0
        if keep_batches:
            self._keep_prefix(keep_batches)

    def _keep_prefix(self, count: int) -> None:
        kept: list[pa.RecordBatch] = []
        if self.path.is_file():
            with (pa.ipc.open_stream(pa.memory_map(str(self.path))) as reader,
                  contextlib.suppress(StopIteration, pa.ArrowException)):
                while len(kept) < count:
                    kept.append(reader.read_next_batch())
        if len(kept) < count:
            raise ValueError(f"recording {self.path} holds {len(kept)} complete batches but the "
                             f"checkpoint counted {count}; hint: resume from the run directory "
                             "that saved the checkpoint")
        tmp = self.path.with_name(f".{self.path.name}.resume")
        self._file = pa.OSFile(str(tmp), "wb")
        self._writer = pa.ipc.new_stream(self._file, kept[0].schema)
        for batch in kept:
            self.write(batch)
        os.replace(tmp, self.path)  # the open file continues under the final name

    def write(self, batch: pa.RecordBatch) -> None:
        if self._writer is None:
            self._file = pa.OSFile(str(self.path), "wb")
            self._writer = pa.ipc.new_stream(self._file, batch.schema)
        self._writer.write_batch(batch)
        self._file.flush()
        self.num_rows += batch.num_rows
        self.num_batches += 1

    def close(self) -> None:
        """Finish the file (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._file.close()
            self._writer = None


def recording_files(path: str | os.PathLike[str]) -> list[Path]:
    """The ``.arrow`` files of a recording: the file, or all under a folder, sorted.

    Raises:
        ValueError: the path does not exist or holds no ``.arrow`` file.
    """
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.exists():
        raise ValueError(f"recording {str(p)!r} does not exist; hint: recorded edges live "
                         "under RUN_DIR/record/EDGE/")
    files = sorted(p.rglob("*.arrow"))
    if not files:
        raise ValueError(f"recording folder {str(p)!r} holds no .arrow file")
    return files


def read_schema(path: str | os.PathLike[str]) -> pa.Schema:
    with _open(recording_files(path)[0]) as reader:
        return reader.schema


def read_batches(path: str | os.PathLike[str]) -> Iterator[pa.RecordBatch]:
    """Every batch of a recording, in order, each fully validated before it is yielded.

    Raises:
        ValueError: a file not Arrow IPC, or cut off or corrupt, naming its whole batches.
    """
    for f in recording_files(path):
        with _open(f) as reader:
            whole = 0
            try:
                for batch in reader:
                    batch.validate(full=True)
                    yield batch
                    whole += 1
            except (OSError, pa.ArrowInvalid) as e:
                raise ValueError(f"{f}: cut off or corrupt after {whole} whole batches: {e}; hint: "
                                 "a run killed while recording leaves its last batch incomplete"
                                 ) from None


def _open(path: Path) -> Any:
    try:
        return pa.ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        try:
            return pa.ipc.open_file(pa.memory_map(str(path)))
        except pa.ArrowInvalid as e:
            raise ValueError(f"{path}: not an Arrow IPC file: {e}") from None


def summarize(path: str | os.PathLike[str], tokenizer: Any = None, num_samples: int = 1) -> str:
    """Files, rows, columns with their docs, and sample rows; with a ``tokenizer``, decoded
    text marked ``policy |`` where ``loss_mask`` is true, else ``context |``."""
    files = recording_files(path)
    batches = [b for f in files for b in read_batches(f)]
    schema = read_schema(path)
    meta = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    lines = [f"{len(files)} file(s), {sum(b.num_rows for b in batches)} rows, "
             f"{len(batches)} batches; schema {meta}"]
    for f in schema:
        doc = (f.metadata or {}).get(b"doc", b"").decode()
        lines.append(f"  {f.name:<22} {str(f.type):<18} {doc}")
    rows = [r for b in batches for r in b.to_pylist()][:num_samples]
    for i, row in enumerate(rows):
        lines.append(f"sample {i}:")
        lines += [f"  {k}: {_short(v)}" for k, v in row.items()]
        if tokenizer is not None and row.get("token_ids"):
            lines += ["  text:", *_decode(tokenizer, row["token_ids"], row.get("loss_mask"))]
    return "\n".join(lines)


def _short(value: Any, limit: int = 160) -> str:
    """A value as JSON cut to ``limit`` characters; bytes as their size."""
    text = (json.dumps(value, default=lambda b: f"<{len(b)} bytes>") if not isinstance(value, bytes)
            else f"<{len(value)} bytes>")
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _decode(tokenizer: Any, token_ids: list[int], loss_mask: list[bool] | None) -> list[str]:
    mask = loss_mask or [False] * len(token_ids)
    lines, start = [], 0
    for i in range(1, len(token_ids) + 1):
        if i == len(token_ids) or mask[i] != mask[start]:
            who = "policy " if mask[start] else "context"
            lines += [f"    {who if n == 0 else ' ' * 7} | {line}"
                      for n, line in enumerate(tokenizer.decode(token_ids[start:i]).split("\n"))]
            start = i
    return lines
