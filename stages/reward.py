"""Reward: adds ``score`` by grading each row's completion against its task answer.

Reads the row's ``metadata`` JSON: ``completion_text`` (the decoded completion, put
there by the rollout stage for grading only; it never feeds training) and
``answer`` (put there by the dataset source). The grader is chosen by
``grader.type`` (:mod:`molt.tasks.graders`: ``math`` extracts ``\\boxed{}``, ``#### N`` or
the last number and compares by value; ``exact`` compares strings).
Logs ``score_mean`` and ``no_answer_fraction`` (completions with no answer found),
both over every row graded so far.
Example: answers ["57", "12"], completions ["It is 57.", "no idea"] -> score
[1.0, 0.0], score_mean 0.5, no_answer_fraction 0.5.

    reward: {class: stages.reward.Reward, config: {grader: {type: math}}}
"""

from __future__ import annotations

import json
from typing import ClassVar

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

    inputs: ClassVar[dict[str, Port]] = {"in": Port(reads=("metadata",))}
    outputs: ClassVar[dict[str, Port]] = {"out": Port(passes="in", writes=("score",))}
    config: Config

    def setup(self) -> None:
        self.totals = [0.0, 0.0, 0.0]  # sum of scores, answers not found, rows graded

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        # 1) read each row's metadata  2) grade  3) add score  4) report
        ids = (batch.column("sample_id").to_pylist() if "sample_id" in batch.schema.names
               else [None] * batch.num_rows)
        grades = [self._grade(meta, sid, i) for i, (meta, sid) in
                  enumerate(zip(batch.column("metadata").to_pylist(), ids))]
        scores = [g.score for g in grades]
        self.totals = [t + x for t, x in zip(self.totals, (sum(scores), sum(g.extracted is None for g in grades),
                                                            len(grades)))]
        if self.totals[2]:  # over every row graded so far
            self.metrics.log({"score_mean": self.totals[0] / self.totals[2],
                              "no_answer_fraction": self.totals[1] / self.totals[2]})
        return batch.append_column(COLUMNS["score"], pa.array(scores, pa.float32()))

    def _grade(self, metadata: str | None, sample_id: str | None, row: int) -> Grade:
        """The grade of the row's ``completion_text`` against its ``answer``, both from its metadata.

        Raises:
            ValueError: naming the sample_id (or row index) and the missing key.
        """
        where = f"sample_id {sample_id!r}" if sample_id is not None else f"row {row}"
        try:
            fields = json.loads(metadata) if metadata is not None else None
        except json.JSONDecodeError as e:
            raise ValueError(f"stage {self.ctx.stage_id!r}, {where}: column 'metadata' is not JSON; "
                             f"got {e.msg} at column {e.colno}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"stage {self.ctx.stage_id!r}, {where}: column 'metadata' must be a JSON object; "
                             f"got {metadata!r:.80}")
        for key in ("answer", "completion_text"):
            if fields.get(key) is None:
                raise ValueError(f"stage {self.ctx.stage_id!r}, {where}: metadata has no {key!r}; got keys "
                                 f"{sorted(fields)}; hint: the dataset source writes 'answer', the rollout "
                                 "stage writes 'completion_text'")
        return self.config.grader.grade(fields["completion_text"], fields["answer"])
