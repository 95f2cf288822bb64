"""The math grader: answer extraction and value comparison, with exact scores."""

import pytest
from pydantic import TypeAdapter, ValidationError

from molt.tasks.graders import ExactGrader, Grade, GraderConfig, MathGrader, extract_answer, math_normal_form


@pytest.mark.parametrize("completion, answer, score", [
    ("The answer is \\boxed{42}.", "42", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("I think 3 then 5", "5", 1.0),
    ("I think 3 then 5", "3", 0.0),
    ("no number", "5", 0.0),
    ("0.5", "1/2", 1.0),
    ("The answer is -7.", "-7", 1.0),
    ("The answer is 7.", "-7", 0.0),
    ("#### -3", "-3", 1.0),
    ("It costs $1,234.50 in all", "1234.5", 1.0),
    ("12.0", "12", 1.0),
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{3} but then 4", "3", 1.0),
    ("5 + 5 = 10\n#### 10\nor maybe 11", "10", 1.0),
    ("\\boxed{x = 3}", "3", 1.0),
    ("\\boxed{12.0\\text{ eggs}}", "12", 1.0),
    ("\\boxed{a=b=c}", "3", 0.0),  # sympy fails to simplify it: compared as parsed
    ("\\boxed{our4)2w}", "3", 0.0),  # sympy cannot read it: compared as written
])
def test_math_grader_scores_exactly(completion, answer, score):
    assert MathGrader().grade(completion, answer).score == score


@pytest.mark.parametrize("completion, extracted", [
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}} and \\boxed{7}", "7"),
    ("#### 1,234", "1234"),
    ("I think 3 then 5", "5"),
    ("-7.", "-7"),
    ("a 1, 2, 3 list", "3"),
    ("no number", None),
    ("\\boxed{}", None),
    ("", None),
])
def test_extract_answer_prefers_boxed_then_hashes_then_the_last_number(completion, extracted):
    assert extract_answer(completion) == extracted


def test_no_answer_is_reported_as_none_with_score_zero():
    assert MathGrader().grade("I do not know", "4") == Grade(0.0, None)


def test_the_math_normal_form_writes_equal_values_alike():
    assert math_normal_form("1/2") == math_normal_form("0.50") == math_normal_form("\\frac{1}{2}") == "1/2"
    assert math_normal_form("-0") == "0" and math_normal_form("1/3") != math_normal_form("0.33")
    twelves = ("12", "12.0", "24/2", "$12", "\\frac{24}{2}", "x = 12", "12.0\\text{ eggs}")
    assert {a: math_normal_form(a) for a in twelves} == {a: "12" for a in twelves}
    assert math_normal_form("\\sqrt{8}") == math_normal_form("2\\sqrt{2}") == "2*sqrt(2)"


def test_exact_grader_strips_whitespace_and_can_ignore_case():
    assert ExactGrader().grade(" Paris\n", "Paris") == Grade(1.0, "Paris")
    assert ExactGrader().grade("paris", "Paris").score == 0.0
    assert ExactGrader(ignore_case=True).grade("paris", "Paris").score == 1.0


def test_grader_config_is_selected_by_type_and_rejects_unknown_types():
    adapter = TypeAdapter(GraderConfig)
    assert isinstance(adapter.validate_python({"type": "math"}), MathGrader)
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        adapter.validate_python({"type": "maths"})
