"""Graders: score a completion against a reference answer (1.0 right, 0.0 wrong).

YAML selects one of :data:`GraderConfig` by ``type:``. The math grader extracts the final answer
(:func:`extract_answer`) and compares it by value (:func:`answers_match`). The completion text is
used for grading only; it never feeds training.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Annotated, Literal, NamedTuple, Union

from pydantic import Field

from molt.config import FrozenConfig

#: A number as a model writes it: optional minus, thousands separators, decimals or a/b.
_NUMBER = r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER.replace(r"(?<![\w.])", "") + ")")
_BOXED = "\\boxed{"
_MATH_VERIFY_TIMEOUT_S = 5
_COUNT_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_COUNT_RE = re.compile(r"\b(?:[1-9]|" + "|".join(_COUNT_WORDS) + r")\b", re.IGNORECASE)
_COLOUR_RE = re.compile(r"\b(?:red|green|blue|yellow)\b", re.IGNORECASE)


class Grade(NamedTuple):
    """One graded completion: ``score`` in {0.0, 1.0}; ``extracted`` None = no answer found."""

    score: float
    extracted: str | None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces; None if unclosed."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def _clean_number(text: str) -> str:
    """``"$1,234"`` -> ``"1234"``; other text stripped."""
    stripped = text.strip().lstrip("$").strip()
    candidate = stripped.replace(",", "")
    return candidate if _NUMBER_RE.fullmatch(candidate) else text.strip()


def extract_answer(completion: str) -> str | None:
    """The content of the last ``\\boxed{...}``, else the number after the last ``####``, else
    the last number, without thousands separators or a leading ``$``; None if none."""
    boxed = _last_boxed(completion)
    if boxed:
        return _clean_number(boxed)
    hashes = _HASHES_RE.findall(completion)
    if hashes:
        return _clean_number(hashes[-1])
    numbers = _NUMBER_RE.findall(completion)
    return _clean_number(numbers[-1]) if numbers else None


def _as_fraction(text: str) -> Fraction | None:
    candidate = _clean_number(text)
    if not _NUMBER_RE.fullmatch(candidate):
        return None
    try:
        return Fraction(candidate)
    except (ValueError, ZeroDivisionError):
        return None


def _math_verify_match(extracted: str, answer: str) -> bool:
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    timeout = _MATH_VERIFY_TIMEOUT_S if main else None  # its timeout uses SIGALRM: main thread only
    gold = parse(f"${answer}$", parsing_timeout=timeout)  # type: ignore[arg-type]
    pred = parse(f"${extracted}$", parsing_timeout=timeout)  # type: ignore[arg-type]
    return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout))


def answers_match(extracted: str, answer: str) -> bool:
    """True if ``extracted`` equals ``answer`` as a value: plain numbers exactly as fractions
    (``"0.5"`` == ``"1/2"``), else symbolically by math-verify (``"\\frac{1}{2}"`` == ``"0.5"``)."""
    left, right = _as_fraction(extracted), _as_fraction(answer)
    if left is not None and right is not None:
        return left == right
    return _math_verify_match(extracted, answer)


def parse_count_colour(text: str) -> tuple[int | None, str | None]:
    """The first count (1-9 or one..nine) and colour word, any case, None where there is none:
    ``"Three RED shapes."`` -> ``(3, "red")``."""
    count, colour = _COUNT_RE.search(text), _COLOUR_RE.search(text)
    number = None
    if count:
        word = count.group().lower()
        number = int(word) if word.isdigit() else _COUNT_WORDS.index(word) + 1
    return number, colour.group().lower() if colour else None


class MathGrader(FrozenConfig):
    """Final-answer math grading: extract (boxed, ####, last number), then compare by value."""

    type: Literal["math"] = "math"

    def grade(self, completion: str, answer: str) -> Grade:
        extracted = extract_answer(completion)
        if extracted is None:
            return Grade(0.0, None)
        return Grade(1.0 if answers_match(extracted, str(answer)) else 0.0, extracted)


class ExactGrader(FrozenConfig):
    """Whole-completion string match after stripping whitespace (optionally case-folded)."""

    type: Literal["exact"] = "exact"
    ignore_case: bool = False

    def grade(self, completion: str, answer: str) -> Grade:
        """``grade(" Paris\\n", "Paris")`` -> ``Grade(1.0, "Paris")``."""
        got, want = completion.strip(), str(answer).strip()
        if not got:
            return Grade(0.0, None)
        if self.ignore_case:
            return Grade(float(got.casefold() == want.casefold()), got)
        return Grade(float(got == want), got)


class ShapesGrader(FrozenConfig):
    """Count and colour of a shapes picture (shapes.py): 1.0 iff both are right."""

    type: Literal["shapes"] = "shapes"

    def grade(self, completion: str, answer: str) -> Grade:
        """``grade("three red", "3 red")`` -> ``Grade(1.0, "3 red")``."""
        got = parse_count_colour(completion)
        extracted = " ".join(str(part) for part in got if part is not None) or None
        return Grade(float(None not in got and got == parse_count_colour(str(answer))), extracted)


GraderConfig = Annotated[Union[MathGrader, ExactGrader, ShapesGrader], Field(discriminator="type")]
