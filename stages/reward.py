"""Reward: adds ``score`` by grading each row's completion against its task answer.

Reads the row's ``metadata`` JSON: ``completion_text`` (written by the rollout, for grading
only) and ``answer`` (from the dataset source); ``grader.type`` picks the grader
(molt.tasks.graders). Logs ``score_mean`` and ``no_answer_fraction`` (no answer extracted) over
every row graded so far.
Example: answers ["57", "12"], completions ["It is 57.", "no idea"] -> score [1.0, 0.0],
score_mean 0.5, no_answer_fraction 0.5.

    reward: {class: stages.reward.Reward, config: {grader: {type: math}}}
"""

from __future__ import annotations

import json

import pyarrow as pa
from pydantic import Field

from molt.tasks.graders import Grade, GraderConfig, MathGrader
from molt.schema import COLUMNS
from molt.runtime.stage import Port, StageConfig, Transform


class Reward(Transform):
    """Adds ``score`` (float32, 1.0 right / 0.0 wrong) from ``metadata``."""

    class Config(StageConfig):
        grader: GraderConfig = Field(default_factory=MathGrader,  # type: ignore[assignment]
                                     description="{type: math} or {type: exact, ignore_case: bool}")

    inputs = {"in": Port(reads=("metadata",))}
    outputs = {"out": Port(passes="in", writes=("score",))}
    config: Config

    def setup(self) -> None:
        self.score_sum, self.num_no_answer, self.num_graded = 0.0, 0, 0

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        # 1) read each row's metadata  2) grade  3) add score  4) report
        ids = (batch.column("sample_id").to_pylist() if "sample_id" in batch.schema.names
               else [None] * batch.num_rows)
        metadata = batch.column("metadata").to_pylist()
        grades = [self._grade(m, sid, i) for i, (m, sid) in enumerate(zip(metadata, ids))]
        scores = [g.score for g in grades]
        self.score_sum += sum(scores)
        self.num_no_answer += sum(g.extracted is None for g in grades)
        self.num_graded += len(grades)
        if self.num_graded:
            self.metrics.log({"score_mean": self.score_sum / self.num_graded,
                              "no_answer_fraction": self.num_no_answer / self.num_graded})
        return batch.append_column(COLUMNS["score"], pa.array(scores, pa.float32()))

    def _grade(self, metadata: str | None, sample_id: str | None, row: int) -> Grade:
        """The grade of the row's ``completion_text`` against its ``answer``.

        Raises:
            ValueError: ``metadata`` is not a JSON object or lacks a key; naming the row.
        """
        where = f"stage {self.ctx.stage_id!r}, " + (
            f"sample_id {sample_id!r}" if sample_id is not None else f"row {row}")
        try:
            fields = json.loads(metadata) if metadata is not None else None
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: column 'metadata' is not JSON; got {e.msg} at column "
                             f"{e.colno}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"{where}: column 'metadata' must be a JSON object; got "
                             f"{metadata!r:.80}")
        for key in ("answer", "completion_text"):
            if fields.get(key) is None:
                raise ValueError(f"{where}: metadata has no {key!r}; got keys {sorted(fields)}; "
                                 "hint: the dataset source writes 'answer', the rollout stage "
                                 "writes 'completion_text'")
        return self.config.grader.grade(fields["completion_text"], fields["answer"])
