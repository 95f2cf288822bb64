"""Task records, and the readers of file-backed tasks.

A record is one prompt with its reference answer, a string::

    {"prompt_id": "gsm8k-test-0", "messages": [{"role": "user", "content": "..."}],
     "answer": "18", "task": "gsm8k", "split": "test", ...any other task fields}
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

Record = dict[str, Any]
EVAL_FRACTION = 0.1  # held out of every generated task family: no task's config moves a problem
#: (parsed object, 0-based record index) -> record; ValueError, KeyError or TypeError if malformed.
Converter = Callable[[Mapping[str, Any], int], Record]


@dataclass
class RecordSet:
    """The records of one file, and a "where: why" per malformed row skipped."""

    records: list[Record]
    skipped: list[str] = field(default_factory=list)

    @property
    def num_records(self) -> int | None:
        return len(self.records)

    def record(self, index: int) -> Record:
        return self.records[index]


def read_prompts(batch: Any) -> list[tuple[str, dict[str, Any]]]:
    """``(prompt_id, task record)`` of each row of a prompt batch (JSON in ``metadata``)."""
    return list(zip(batch.column("prompt_id").to_pylist(),
                    (json.loads(m) if m else {} for m in batch.column("metadata").to_pylist())))


def split_of(identity: str) -> str:
    """``"eval"`` iff sha256(identity)'s first 8 bytes / 2**64 < `EVAL_FRACTION`, else train."""
    digest = hashlib.sha256(identity.encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < EVAL_FRACTION else "train"


def user_messages(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def check_messages(messages: Any) -> list[dict[str, str]]:
    """``messages`` if it is a non-empty list of ``{role, content}`` string dicts.

    Raises:
        ValueError: naming the first bad message.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"'messages' must be a non-empty list; got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f"'messages'[{i}] must be {{'role': str, 'content': str}}; "
                             f"got {m!r:.80}")
    return messages


def generic_record(obj: Mapping[str, Any], index: int, *, stem: str, split: str) -> Record:
    """A record from a row with ``messages`` (or ``prompt``) and ``answer``, other fields kept:
    ``{"prompt": "2+2?", "answer": 4}`` at index 0 of ``qa.jsonl`` -> ``{"prompt_id": "qa-0",
    "messages": [user: "2+2?"], "answer": "4", "task": "qa", "split": split}``.

    Raises:
        ValueError: no ``answer``, or neither ``messages`` nor ``prompt``.
    """
    if "answer" not in obj or obj["answer"] is None:
        raise ValueError("missing key 'answer'")
    if "messages" in obj:
        messages = check_messages(obj["messages"])
    elif isinstance(obj.get("prompt"), str):
        messages = user_messages(obj["prompt"])
    else:
        raise ValueError("missing key 'messages' (or a string 'prompt')")
    extra = {k: v for k, v in obj.items() if k not in ("messages", "prompt")}
    return {**extra, "prompt_id": str(obj.get("prompt_id", f"{stem}-{index}")),
            "messages": messages, "answer": str(obj["answer"]), "task": str(obj.get("task", stem)),
            "split": str(obj.get("split", split))}


def _open_checked(path: Path, what: str) -> bytes:
    if not path.is_file():
        raise ValueError(f"{what}: no such file; got {str(path)!r}; hint: give an existing path")
    return path.read_bytes()


def _reject(path: Path, line_no: int, why: str, skip_malformed: bool, skipped: list[str]) -> None:
    message = f"{path}:{line_no}: malformed line: {why}"
    if not skip_malformed:
        raise ValueError(f"{message}; hint: fix the line or set skip_malformed: true to count and "
                         "skip it")
    skipped.append(message)


def read_jsonl(path: Path, convert: Converter, *, skip_malformed: bool = False) -> RecordSet:
    """One record per non-blank line, by ``convert``; with ``skip_malformed`` a line that is not
    UTF-8, not a JSON object, or that ``convert`` rejects is logged and kept in ``skipped``.

    Raises:
        ValueError: ``"{path}:{line}: malformed line: {why}"`` (lines from 1), or a missing file.
    """
    data = _open_checked(path, "jsonl task path")
    records: list[Record] = []
    skipped: list[str] = []
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object; got {type(obj).__name__}")
            records.append(convert(obj, len(records)))
        except UnicodeDecodeError as e:
            why = f"not UTF-8 ({e.reason} at byte {e.start})"
            _reject(path, line_no, why, skip_malformed, skipped)
        except json.JSONDecodeError as e:
            _reject(path, line_no, f"bad JSON ({e.msg}, column {e.colno})", skip_malformed, skipped)
        except (ValueError, KeyError, TypeError) as e:
            _reject(path, line_no, str(e), skip_malformed, skipped)
    if skipped:
        log.warning("%s: skipped %d malformed line(s); first: %s", path, len(skipped), skipped[0])
    return RecordSet(records, skipped)


def read_parquet(path: Path, *, split: str, skip_malformed: bool = False) -> RecordSet:
    """`generic_record` of each row.

    Raises:
        ValueError: ``"{path}: row {i}: {why}"`` (rows from 0) unless ``skip_malformed``, or a
            missing file.
    """
    import pyarrow.parquet as pq

    _open_checked(path, "parquet task path")
    records: list[Record] = []
    skipped: list[str] = []
    for i, row in enumerate(pq.read_table(path).to_pylist()):
        try:
            records.append(generic_record(row, len(records), stem=path.stem, split=split))
        except ValueError as e:
            if not skip_malformed:
                raise ValueError(f"{path}: row {i}: {e}; hint: fix the row or set "
                                 "skip_malformed: true") from None
            skipped.append(f"{path}: row {i}: {e}")
    if skipped:
        log.warning("%s: skipped %d malformed row(s); first: %s", path, len(skipped), skipped[0])
    return RecordSet(records, skipped)


class Task(Protocol):
    """Records by index; ``num_records`` None = unbounded."""

    @property
    def num_records(self) -> int | None: ...

    @property
    def skipped(self) -> Sequence[str]: ...

    def record(self, index: int) -> Record: ...
