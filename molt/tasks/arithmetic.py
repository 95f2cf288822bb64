"""Arithmetic word problems, generated: seeded, reproducible, split-safe.

Problem ``i`` of a split is drawn (with replacement) by ``random.Random(f"{seed}:{i}:{j}")`` for
the first ``j`` whose problem falls in that split. **Splits never overlap**: a problem's split is
``split_of(canonical(a, op, b))`` (records.py), whatever the task's other fields.
``style: plain`` asks "What is 23 + 45? Answer with just the number."; ``word`` (default) puts
a story before it ("Mia has 23 marbles and gets 45 more.").
"""

from __future__ import annotations

import operator
import random
from dataclasses import dataclass

from molt.tasks.records import Record, split_of, user_messages

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_NAMES = ("Mia", "Leo", "Ava", "Sam", "Noah", "Zoe", "Omar", "Lily", "Ben", "Emma")
_THINGS = ("marbles", "apples", "stickers", "coins", "books", "shells", "pencils", "cards")
_STORIES = {
    "+": "{name} has {a} {things} and gets {b} more.",
    "-": "{name} has {a} {things} and gives {b} of them away.",
    "*": "{name} fills {a} boxes with {b} {things} each.",
}
_MAX_DRAWS = 10_000
_MAX_COUNTED = 100_000  # (op, a, b) candidates `num_distinct` enumerates at most
INSTRUCTION = "Answer with just the number."


def canonical(a: int, op: str, b: int) -> str:
    """The problem's identity for splitting: ``canonical(42, "+", 17)`` -> ``"17+42"``."""
    if op in "+*":
        a, b = min(a, b), max(a, b)
    return f"{a}{op}{b}"


def asked(a: int, op: str, b: int) -> tuple[int, str, int]:
    """The problem as asked: ``b - a`` for ``a - b < 0`` (a story of giving away stays >= 0)."""
    return (b, op, a) if op == "-" and b > a else (a, op, b)


@dataclass(frozen=True)
class ArithmeticProblems:
    """Problem ``i`` of one split, ``0 <= i < num_records`` (None = unbounded): ``record(0)`` ->
    ``{"prompt_id": "arithmetic-train-s0-0", "messages": [...], "answer": "157", ..., "a": 90,
    "b": 67, "op": "+"}``."""

    seed: int = 0
    num_records: int | None = 1000
    split: str = "train"
    min_operand: int = 10
    max_operand: int = 99
    second_operand: tuple[int, int] | None = None  # (min, max) of b; None: as a's
    operations: tuple[str, ...] = ("+",)
    style: str = "word"
    skipped: tuple[str, ...] = ()

    def record(self, index: int) -> Record:
        """The record of problem ``index``.

        Raises:
            ValueError: no problem of this split in ``_MAX_DRAWS`` draws.
        """
        for j in range(_MAX_DRAWS):
            rng = random.Random(f"{self.seed}:{index}:{j}")
            op = rng.choice(self.operations)
            a, _, b = asked(rng.randint(self.min_operand, self.max_operand), op,
                            rng.randint(*self._second))
            if split_of(canonical(a, op, b)) == self.split:
                return self._record(index, rng, a, op, b)
        raise ValueError(f"arithmetic task: no {self.split!r} problem in {_MAX_DRAWS} draws; got "
                         f"operands {self.min_operand}..{self.max_operand}; hint: widen the "
                         "operand range")

    @property
    def _second(self) -> tuple[int, int]:
        return self.second_operand or (self.min_operand, self.max_operand)

    def num_distinct(self) -> int | None:
        """How many problems (a, op, b as asked) this split holds; None if over `_MAX_COUNTED`."""
        (low, high), firsts = self._second, range(self.min_operand, self.max_operand + 1)
        if len(self.operations) * len(firsts) * (high - low + 1) > _MAX_COUNTED:
            return None
        problems = {asked(a, op, b) for op in self.operations for a in firsts
                    for b in range(low, high + 1)}
        return sum(split_of(canonical(a, op, b)) == self.split for a, op, b in problems)

    def _record(self, index: int, rng: random.Random, a: int, op: str, b: int) -> Record:
        question = f"What is {a} {op} {b}? {INSTRUCTION}"
        if self.style == "word":
            story = _STORIES[op].format(name=rng.choice(_NAMES), things=rng.choice(_THINGS),
                                        a=a, b=b)
            question = f"{story} {question}"
        return {"prompt_id": f"arithmetic-{self.split}-s{self.seed}-{index}",
                "messages": user_messages(question), "answer": str(_OPS[op](a, b)),
                "task": "arithmetic", "split": self.split, "a": a, "b": b, "op": op}
