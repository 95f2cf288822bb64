"""DatasetSource: emits task prompts (arithmetic, GSM8K, JSONL, Parquet) for the rollout.

Each row is one prompt: ``prompt_id`` and ``metadata``, a JSON object with
``messages``, ``answer``, ``task``, ``split``, ``epoch`` and every other field of the
task record (see :mod:`molt.tasks`). The task is chosen by ``task.type``; records are
iterated by :class:`molt.tasks.cursor.PromptNode` (a ``torchdata.nodes`` node): epochs,
a seeded shuffle per epoch, and replica ``r`` of ``N`` taking a disjoint share.

``prompt_id`` is the record's id in the first epoch and ``{id}~e{epoch}`` after, so a
prompt group key never repeats within a run. ``state_dict()`` is the cursor
(``{"cursor": {"source": {"epoch": e, "position": p}}, "num_records": n,
"num_batches": b}``); a new instance given it by ``load_state_dict()`` continues with
the next prompt. ``checkpoint_every_batches: k`` emits a checkpoint ``Barrier(b)``
after every k-th batch (b = batches emitted so far; molt.runtime.checkpoint), which is what
``molt run --resume`` restarts from; with ``k * prompts_per_batch`` a multiple of the
pipeline's ``policy.groups_per_step`` each checkpoint falls on an optimizer-step boundary.
Example: 5 records, ``prompts_per_batch: 2``, one epoch -> batches of 2, 2, 1 rows.

    source:
      class: stages.dataset_source.DatasetSource
      config: {task: {type: gsm8k, path: data/gsm8k/train.jsonl}, prompts_per_batch: 8, num_epochs: 1}
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, ClassVar

import pyarrow as pa
from pydantic import Field
from torchdata.nodes import Batcher

from molt.schema import batch_from_rows, make_schema, resolve_fields
from molt.runtime.stage import Port, Source, StageConfig, StageContext
from molt.tasks import PromptNode, Record, Task, TaskConfig, prompt_batches
from molt.runtime.edges import Barrier

WRITES = ("prompt_id", "metadata")


class DatasetSource(Source):
    """Emits ``prompts_per_batch`` prompts per record batch until the task is exhausted."""

    class Config(StageConfig):
        task: TaskConfig = Field(description="the prompts: {type: arithmetic|gsm8k|jsonl|parquet, ...}")
        prompts_per_batch: int = Field(8, ge=1, description="prompts (rows) per emitted batch")
        num_epochs: int | None = Field(1, ge=1, description="passes over a finite task; null = forever")
        shuffle: bool | None = Field(None, description="reshuffle each epoch; default true (finite tasks)")
        seed: int | None = Field(None, description="seed of the per-epoch shuffle; None = the run's (molt.runtime.seeds)")
        checkpoint_every_batches: int = Field(0, ge=0, description="checkpoint barrier every k batches; 0 = none")

    outputs: ClassVar[dict[str, Port]] = {"out": Port(writes=WRITES)}
    config: Config

    def __init__(self, config: StageConfig, ctx: StageContext) -> None:
        super().__init__(config, ctx)
        self._pending: dict[str, Any] | None = None
        self._batches: Batcher[Record] | None = None
        self.num_batches = 0

    def setup(self) -> None:
        c, ctx = self.config, self.ctx
        self.schema = make_schema(resolve_fields(WRITES, "DatasetSource"), "trajectory")
        self.task: Task = c.task.load()
        self._warn_ignored()
        node = PromptNode(self.task, num_epochs=c.num_epochs, shuffle=c.shuffle is not False,
                          seed=ctx.seed_for("shuffle") if c.seed is None else c.seed,
                          replica=ctx.replica, num_replicas=ctx.num_replicas)
        self._batches = prompt_batches(node, c.prompts_per_batch)
        skipped = len(self.task.skipped)
        self.log.info("task %s: %s records (%d malformed skipped), replica %d of %d", c.task.type,
                      self.task.num_records if self.task.num_records is not None else "endless",
                      skipped, ctx.replica, ctx.num_replicas)
        self.metrics.log({"records_skipped": skipped}, reduce={"records_skipped": "sum"})
        if self._pending is not None:
            self.load_state_dict(self._pending)

    def _warn_ignored(self) -> None:
        c = self.config
        if self.task.num_records is None and c.num_epochs != 1:
            self.log.warning("stages.%s.config.num_epochs: ignored; the task is an endless stream "
                             "(task.num_problems: null)", self.ctx.stage_id)
        if self.task.num_records is None and c.shuffle:
            self.log.warning("stages.%s.config.shuffle: ignored; an endless stream is drawn at random "
                             "already", self.ctx.stage_id)

    def generate(self) -> Iterator[pa.RecordBatch | Barrier]:
        assert self._batches is not None, "setup() runs before generate()"
        every = self.config.checkpoint_every_batches
        for records in self._batches:
            # 1) next prompts from the cursor  2) encode as one batch  3) checkpoint barrier if due
            self.num_batches += 1
            yield batch_from_rows([self._row(r) for r in records], self.schema)
            if every and self.num_batches % every == 0:
                yield Barrier(self.num_batches)

    def _row(self, record: Record) -> dict[str, Any]:
        meta = {k: v for k, v in record.items() if k != "prompt_id"}
        prompt_id = record["prompt_id"] if record["epoch"] == 0 else f"{record['prompt_id']}~e{record['epoch']}"
        meta["task_prompt_id"] = record["prompt_id"]
        try:
            return {"prompt_id": prompt_id, "metadata": json.dumps(meta)}
        except TypeError as e:
            raise ValueError(f"prompt {prompt_id!r}: a task field is not JSON-serialisable; got {e}; "
                             "hint: keep record fields to strings, numbers, lists and dicts") from None

    def state_dict(self) -> dict[str, Any]:
        """The cursor: which prompt comes next (JSON-serialisable)."""
        if self._batches is None:
            return dict(self._pending or {})
        return {"cursor": self._batches.state_dict(), "num_records": self.task.num_records,
                "num_batches": self.num_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the last prompt emitted when ``state`` was taken.

        Raises:
            ValueError: no ``cursor`` key, or a task of another size than the saved one.
        """
        if "cursor" not in state:
            raise ValueError(f"stage {self.ctx.stage_id!r}: state has no 'cursor'; got keys {sorted(state)}; "
                             "hint: pass what DatasetSource.state_dict() returned")
        if self._batches is None:  # before setup(): apply once the task is loaded
            self._pending = state
            return
        if state.get("num_records") != self.task.num_records:
            raise ValueError(f"stage {self.ctx.stage_id!r}: saved cursor is for {state.get('num_records')} "
                             f"records; got a task of {self.task.num_records}; hint: resume with the same task config")
        self._batches.reset(state["cursor"])
        self.num_batches = state.get("num_batches", 0)
