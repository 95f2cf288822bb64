"""GSM8K: grade-school math word problems read from GSM8K-format JSON lines.

Each line is ``{"question": str, "answer": str}`` where the answer is a worked
solution ending in ``#### N`` (GSM8K, Cobbe et al. 2021, arXiv 2110.14168). The
record's ``answer`` is N with thousands separators removed; the worked solution is
kept as ``solution`` (metadata only; never shown to the policy). The file itself is
given by path and never copied into the project.

Example line: ``{"question": "Janet's ducks lay 16 eggs ...", "answer": "... #### 18"}``
at row 0 of ``test.jsonl`` -> ``{"prompt_id": "gsm8k-test-0", "messages": [{"role":
"user", "content": "Janet's ducks lay 16 eggs ...\\n" + instruction}], "answer": "18",
"task": "gsm8k", "split": "test", "solution": "..."}``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from molt.tasks.records import Record, RecordSet, read_jsonl, user_messages

#: Appended to every question; the math grader also accepts \boxed{} or a last number.
DEFAULT_INSTRUCTION = "Solve the problem step by step, then give the final answer on the last line as '#### N'."

_FINAL_RE = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def final_answer(solution: str) -> str:
    """The number after the closing ``####`` of a GSM8K solution, commas removed.

    Example: ``"... so 1,200 + 34 = 1234\\n#### 1,234"`` -> ``"1234"``.

    Raises:
        ValueError: the solution does not end with ``#### <number>``.
    """
    match = _FINAL_RE.search(solution.strip())
    if match is None:
        tail = solution.strip()[-40:]
        raise ValueError(f"'answer' does not end with '#### <number>'; got ...{tail!r}")
    return match.group(1).replace(",", "")


def gsm8k_record(obj: Mapping[str, Any], index: int, *, split: str, instruction: str) -> Record:
    """One GSM8K line as a task record (see the module docstring).

    Raises:
        ValueError: a missing or non-string ``question``/``answer``, or no final answer.
    """
    for key in ("question", "answer"):
        if not isinstance(obj.get(key), str):
            raise ValueError(f"missing string key {key!r}; got keys {sorted(obj)}")
    content = f"{obj['question'].strip()}\n{instruction}" if instruction else obj["question"].strip()
    return {"prompt_id": f"gsm8k-{split}-{index}", "messages": user_messages(content),
            "answer": final_answer(obj["answer"]), "task": "gsm8k", "split": split,
            "solution": obj["answer"]}


def read_gsm8k(path: str | Path, *, split: str | None = None, instruction: str = DEFAULT_INSTRUCTION,
               skip_malformed: bool = False) -> RecordSet:
    """Read a GSM8K-format JSONL file; ``split`` defaults to the file's stem (``test``).

    Raises:
        ValueError: ``"{path}:{line}: malformed line: ..."`` for bad JSON, missing keys,
            non-UTF-8 bytes or no ``#### N`` (unless ``skip_malformed``), or a missing file.
    """
    path = Path(path)
    name = split or path.stem
    return read_jsonl(path, lambda obj, i: gsm8k_record(obj, i, split=name, instruction=instruction),
                      skip_malformed=skip_malformed)
