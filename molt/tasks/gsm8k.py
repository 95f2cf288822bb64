"""GSM8K (Cobbe et al. 2021, arXiv 2110.14168): math word problems from a JSON-lines file.

A line ``{"question": q, "answer": "... #### 18"}`` at row 0 of ``test.jsonl`` ->
``{"prompt_id": "gsm8k-test-0", "messages": [user: q + "\\n" + instruction], "answer": "18",
"task": "gsm8k", "split": "test", "solution": "... #### 18"}`` (metadata, never prompted).
"""

from __future__ import annotations

import re
from functools import partial
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from molt.tasks.records import Record, RecordSet, read_jsonl, user_messages

#: Appended to every question; the math grader also accepts \boxed{} or a last number.
DEFAULT_INSTRUCTION = ("Solve the problem step by step, then give the final answer on the last "
                       "line as '#### N'.")

_FINAL_RE = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def final_answer(solution: str) -> str:
    """The number after the closing ``####`` of a solution, commas removed: ``"... #### 1,234"``
    -> ``"1234"``.

    Raises:
        ValueError: the solution does not end with ``#### <number>``.
    """
    match = _FINAL_RE.search(solution.strip())
    if match is None:
        tail = solution.strip()[-40:]
        raise ValueError(f"'answer' does not end with '#### <number>'; got ...{tail!r}")
    return match.group(1).replace(",", "")


def gsm8k_record(obj: Mapping[str, Any], index: int, *, split: str, instruction: str) -> Record:
    """One GSM8K line as a record.

    Raises:
        ValueError: a missing or non-string ``question``/``answer``, or no final answer.
    """
    for key in ("question", "answer"):
        if not isinstance(obj.get(key), str):
            raise ValueError(f"missing string key {key!r}; got keys {sorted(obj)}")
    question = obj["question"].strip()
    content = f"{question}\n{instruction}" if instruction else question
    return {"prompt_id": f"gsm8k-{split}-{index}", "messages": user_messages(content),
            "answer": final_answer(obj["answer"]), "task": "gsm8k", "split": split,
            "solution": obj["answer"]}


def read_gsm8k(path: str | Path, *, split: str | None = None,
               instruction: str = DEFAULT_INSTRUCTION, skip_malformed: bool = False) -> RecordSet:
    """Read a GSM8K-format JSONL file; ``split`` defaults to the file's stem (``test``).

    Raises:
        ValueError: as `read_jsonl`.
    """
    path = Path(path)
    convert = partial(gsm8k_record, split=split or path.stem, instruction=instruction)
    return read_jsonl(path, convert, skip_malformed=skip_malformed)
