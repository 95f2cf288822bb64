"""Graders: score a completion against a reference answer (1.0 right, 0.0 wrong).

YAML selects one of :data:`GraderConfig` by ``type:``. A completion is right iff the normal
form (equal answers, equal strings) of its answer is the reference's; majority votes count the
same normal forms (``Grade.extracted``). The completion text never feeds training.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from functools import lru_cache
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
    """One graded completion: ``score`` in {0.0, 1.0}; ``extracted`` the answer found in the
    grader's normal form, None if none."""

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


@lru_cache(maxsize=4096)  # a reference is graded once per sample
def math_normal_form(answer: str) -> str:
    """An answer's value as one string: a plain number as a reduced fraction (``"12.0"``,
    ``"24/2"``, ``"$12"`` -> ``"12"``), else math-verify's parse (``x = v`` as ``v``) simplified
    by sympy (``"\\sqrt{8}"`` -> ``"2*sqrt(2)"``), else the text stripped."""
    if (number := _as_fraction(answer)) is not None:
        return str(number)
    from math_verify import parse
    from math_verify.utils import timeout
    from sympy import Basic, Eq, Symbol, nsimplify, simplify

    seconds = _timeout_s()
    parsed = parse(f"${answer}$", parsing_timeout=seconds)  # type: ignore[arg-type]
    if not parsed or not isinstance(value := parsed[0], Basic):  # sympy could not read it
        return str(parsed[0]) if parsed else answer.strip()
    value = value.rhs if isinstance(value, Eq) and isinstance(value.lhs, Symbol) else value
    try:  # decimals as fractions: "12.0" is "12" here too
        return str(timeout(seconds)(lambda: simplify(nsimplify(value, rational=True)))())
    except Exception:  # noqa: BLE001 - a timeout, or sympy failing on an odd expression ("a=b=c")
        return str(value)


def _timeout_s() -> int | None:
    """math-verify's timeout: it uses SIGALRM, so in the main thread only."""
    return _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _math_verify_match(extracted: str, answer: str) -> bool:
    from math_verify import parse, verify

    seconds = _timeout_s()
    gold = parse(f"${answer}$", parsing_timeout=seconds)  # type: ignore[arg-type]
    pred = parse(f"${extracted}$", parsing_timeout=seconds)  # type: ignore[arg-type]
    return bool(gold and pred and verify(gold, pred, timeout_seconds=seconds))


def parse_count_colour(text: str) -> tuple[int | None, str | None]:
    """The first count (1-9 or one..nine) and colour word, any case, None where there is none:
    ``"Three RED shapes."`` -> ``(3, "red")``."""
    count, colour = _COUNT_RE.search(text), _COLOUR_RE.search(text)
    number = None
    if count:
        word = count.group().lower()
        number = int(word) if word.isdigit() else _COUNT_WORDS.index(word) + 1
    return number, colour.group().lower() if colour else None


class _Grader(FrozenConfig):
    def answer(self, completion: str) -> str | None:
        """The answer ``completion`` gives; None if none."""
        return completion.strip() or None

    def normal_form(self, answer: str) -> str | None:
        """``answer`` written so that equal answers are equal strings; None if it has none."""
        raise NotImplementedError

    def grade(self, completion: str, answer: str) -> Grade:
        found = self.answer(completion)
        got = None if found is None else self.normal_form(found)
        return Grade(float(got is not None and got == self.normal_form(str(answer))), got)


class MathGrader(_Grader):
    """Final-answer math: `extract_answer`, compared by value (`math_normal_form`)."""

    type: Literal["math"] = "math"

    def answer(self, completion: str) -> str | None:
        return extract_answer(completion)

    def normal_form(self, answer: str) -> str | None:
        return math_normal_form(answer)

    def grade(self, completion: str, answer: str) -> Grade:
        """As `_Grader.grade`; answers that are not both plain numbers and differ in normal form
        are still right if math-verify finds them equal (``"(x+1)^2"``, ``"x^2+2x+1"``)."""
        got = super().grade(completion, answer)
        if got.score or got.extracted is None or _as_fraction(str(answer)) is not None:
            return got
        return Grade(float(_math_verify_match(str(self.answer(completion)), str(answer))),
                     got.extracted)


class ExactGrader(_Grader):
    """Whole-completion string match after stripping whitespace (optionally case-folded):
    ``grade(" Paris\\n", "Paris")`` -> ``Grade(1.0, "Paris")``."""

    type: Literal["exact"] = "exact"
    ignore_case: bool = False

    def normal_form(self, answer: str) -> str | None:
        return answer.strip().casefold() if self.ignore_case else answer.strip()


class ShapesGrader(_Grader):
    """Count and colour of a picture (shapes.py): ``grade("three red", "3 red")`` ->
    ``Grade(1.0, "3 red")``."""

    type: Literal["shapes"] = "shapes"

    def normal_form(self, answer: str) -> str | None:
        parts = parse_count_colour(answer)
        return " ".join(str(part) for part in parts if part is not None) or None


GraderConfig = Annotated[Union[MathGrader, ExactGrader, ShapesGrader], Field(discriminator="type")]
