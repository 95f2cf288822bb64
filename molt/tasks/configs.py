"""Task configs, selected by their YAML ``type:``::

    task: {type: arithmetic, seed: 0, num_problems: 1000, split: train}
    task: {type: gsm8k, path: /data/gsm8k/train.jsonl}
    task: {type: jsonl, path: prompts.jsonl, split: train}
    task: {type: parquet, path: prompts.parquet}
    task: {type: shapes, seed: 0, num_problems: 1000, split: train}
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, field_validator, model_validator

from molt.config import FrozenConfig
from molt.tasks.arithmetic import ArithmeticProblems
from molt.tasks.gsm8k import DEFAULT_INSTRUCTION, read_gsm8k
from molt.tasks.records import (Record, RecordSet, Task, generic_record, read_jsonl,
                                read_parquet)
from molt.tasks.shapes import ShapeProblems

_DRAWS_PER_PROBLEM = 100  # `distinct` gives up after as many draws per problem


class _TaskConfig(FrozenConfig):
    """A task's config; ``load()`` builds the task."""

    def load(self) -> Task:
        raise NotImplementedError

    def preflight(self, where: str) -> None:
        """Load the task before the run starts (`Stage.preflight`), to refuse a bad dataset.

        Raises:
            ValueError: naming ``where`` (the task's YAML key) and the problem.
        """
        try:
            self.load()
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def distinct(self) -> list[Record]:
        """The records an evaluation grades, no problem twice: every record of a file."""
        task = self.load()
        return [task.record(i) for i in range(task.num_records or 0)]


class _GeneratedTask(_TaskConfig):
    """A generated task; ``problems`` builds it from the fields."""

    problems: ClassVar[type[ArithmeticProblems] | type[ShapeProblems]]
    seed: int = 0
    num_problems: int | None = Field(1000, ge=1, description="problems per epoch; null = endless")
    split: Literal["train", "eval"] = "train"

    def load(self) -> ArithmeticProblems | ShapeProblems:
        return self.problems(num_records=self.num_problems,
                             **self.model_dump(exclude={"type", "num_problems"}))

    def distinct(self) -> list[Record]:
        """``num_problems`` distinct problems (alike but for id and wording is one) drawn without
        replacement; all of the split's if it holds no more.

        Raises:
            ValueError: an endless task.
        """
        task, wanted = self.load(), self.num_problems
        if wanted is None:
            raise ValueError("num_problems: an evaluation needs a number; got null")
        wanted = min(wanted, task.num_distinct() or wanted)
        found: dict[str, Record] = {}
        for index in range(wanted * _DRAWS_PER_PROBLEM):
            if len(found) == wanted:
                break
            record = task.record(index)
            found.setdefault(json.dumps({**record, "prompt_id": 0, "messages": 0}), record)
        return list(found.values())

    def pool(self) -> str:
        """What the task draws its problems from: tasks of other pools share no problem."""
        return f"the {self.split} split of {getattr(self, 'type')}"


class ArithmeticTask(_GeneratedTask):
    """Generated arithmetic problems (arithmetic.py)."""

    problems = ArithmeticProblems
    type: Literal["arithmetic"] = "arithmetic"
    min_operand: int = Field(10, ge=0, description="smallest operand (inclusive)")
    max_operand: int = Field(99, ge=0, description="largest operand (inclusive)")
    second_operand: tuple[int, int] | None = Field(
        None, description="[min, max] of the second operand (inclusive); null: as the first's")
    operations: tuple[Literal["+", "-", "*"], ...] = Field(("+",), min_length=1)
    style: Literal["word", "plain"] = "word"

    @model_validator(mode="after")
    def _check_range(self) -> ArithmeticTask:
        if self.min_operand > self.max_operand:
            raise ValueError(f"min_operand must be <= max_operand; got {self.min_operand} > "
                             f"{self.max_operand}; hint: swap them")
        second = self.second_operand
        if second is not None and not 0 <= second[0] <= second[1]:
            raise ValueError("second_operand must be [min, max] with 0 <= min <= max; "
                             f"got {list(second)}")
        return self


class ShapesTask(_GeneratedTask):
    """Generated count-and-colour pictures (shapes.py), for vision-language models."""

    problems = ShapeProblems
    type: Literal["shapes"] = "shapes"
    min_shapes: int = Field(1, ge=1, le=4, description="fewest shapes in a scene (inclusive)")
    max_shapes: int = Field(4, ge=1, le=4, description="most shapes in a scene (inclusive)")

    @model_validator(mode="after")
    def _check_range(self) -> ShapesTask:
        if self.min_shapes > self.max_shapes:
            raise ValueError(f"min_shapes must be <= max_shapes; got {self.min_shapes} > "
                             f"{self.max_shapes}; hint: swap them")
        return self


class _FileTask(_TaskConfig):
    """A task read from a file, which must exist when the pipeline loads."""

    path: Path
    num_problems: int | None = Field(None, ge=1, description="use the first N records; null = all")
    skip_malformed: bool = Field(False, description="count and log bad lines instead of failing")

    @field_validator("path")
    @classmethod
    def _exists(cls, path: Path) -> Path:
        if not path.is_file():
            raise ValueError(f"no such file; got {str(path)!r}; "
                             "hint: paths are relative to where `molt run` starts")
        return path

    def pool(self) -> str:
        return f"the file {self.path.resolve()}"

    def first(self, records: RecordSet) -> RecordSet:
        """The first ``num_problems`` records.

        Raises:
            ValueError: no record is left, or two share a ``prompt_id`` (the group key).
        """
        chosen = RecordSet(records.records[:self.num_problems], records.skipped)
        if not chosen.records:
            raise ValueError(f"{self.path}: no records ({len(records.skipped)} malformed lines "
                             "skipped); hint: a task needs at least one prompt")
        first_row: dict[str, int] = {}
        for row, record in enumerate(chosen.records):
            if (earlier := first_row.setdefault(record["prompt_id"], row)) != row:
                raise ValueError(f"{self.path}: rows {earlier} and {row} have the same prompt_id "
                                 f"{record['prompt_id']!r}; it keys a prompt's group, so their "
                                 "rollouts would be graded as one group; hint: give every record "
                                 "its own prompt_id")
        return chosen


class GSM8KTask(_FileTask):
    """A GSM8K-format JSONL file (``question``, ``answer`` ending in ``#### N``)."""

    type: Literal["gsm8k"] = "gsm8k"
    split: str | None = Field(None, description="default: the file's stem (train, test)")
    instruction: str = DEFAULT_INSTRUCTION

    def load(self) -> Task:
        return self.first(read_gsm8k(self.path, split=self.split, instruction=self.instruction,
                                     skip_malformed=self.skip_malformed))


class JSONLTask(_FileTask):
    """JSON lines whose rows already have ``messages`` (or ``prompt``) and ``answer``."""

    type: Literal["jsonl"] = "jsonl"
    split: str = "train"

    def load(self) -> RecordSet:
        convert = partial(generic_record, stem=self.path.stem, split=self.split)
        return self.first(read_jsonl(self.path, convert, skip_malformed=self.skip_malformed))


class ParquetTask(_FileTask):
    """A Parquet file whose rows have ``messages`` (or ``prompt``) and ``answer``."""

    type: Literal["parquet"] = "parquet"
    split: str = "train"

    def load(self) -> RecordSet:
        return self.first(read_parquet(self.path, split=self.split,
                                       skip_malformed=self.skip_malformed))


TaskConfig = Annotated[Union[ArithmeticTask, ShapesTask, GSM8KTask, JSONLTask, ParquetTask],
                       Field(discriminator="type")]
