"""DatasetSource: emits task prompts for the rollout.

Each row is one prompt: ``prompt_id`` and ``metadata``, the task record as JSON (``messages``,
``answer``, ``epoch``, ...; molt.tasks). Records come from molt.tasks.cursor.PromptNode: epochs,
a seeded shuffle per epoch, replica r of N taking a disjoint share. ``prompt_id`` is the
record's id in epoch 0, ``{id}~e{epoch}`` after.
``checkpoint_every_batches: k`` emits ``Barrier(b)`` after every k-th batch (b = batches so
far; on a step boundary if ``k * prompts_per_batch`` is a multiple of ``policy.groups_per_step``);
the state is the cursor: a resumed run goes on with the next prompt.
Example: 5 records, ``prompts_per_batch: 2``, one epoch -> batches of 2, 2, 1 rows.

    source:
      class: stages.dataset_source.DatasetSource
      config: {task: {type: gsm8k, path: data/gsm8k/train.jsonl}, prompts_per_batch: 8}
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pydantic import Field
from torchdata.nodes import Batcher

from molt.schema import batch_from_rows, make_schema, resolve_fields
from molt.runtime.stage import Port, Source, StageConfig
from molt.tasks import PromptNode, Record, Task, TaskConfig, prompt_batches
from molt.runtime.edges import Barrier

WRITES = ("prompt_id", "metadata")


class DatasetSource(Source):
    """Emits ``prompts_per_batch`` prompts per record batch until the task is exhausted."""

    class Config(StageConfig):
        task: TaskConfig = Field(description="{type: arithmetic|gsm8k|jsonl|parquet, ...}")
        prompts_per_batch: int = Field(8, ge=1)
        num_epochs: int | None = Field(1, ge=1, description="passes over the task; null = forever")
        shuffle: bool | None = Field(None, description="reshuffle each epoch; default true")
        seed: int | None = Field(None, description="of the shuffle; None = the run's")
        checkpoint_every_batches: int = Field(0, ge=0, description="0 = no checkpoint barriers")

    outputs = {"out": Port(writes=WRITES)}
    config: Config
    _pending: dict[str, Any] | None = None  # a state given before setup()
    _batches: Batcher[Record] | None = None
    num_batches = 0

    def setup(self) -> None:
        c, ctx = self.config, self.ctx
        self.schema = make_schema(resolve_fields(WRITES, "DatasetSource"), "trajectory")
        self.task: Task = c.task.load()
        endless = self.task.num_records is None
        if endless and c.num_epochs != 1:
            self.log.warning("stages.%s.config.num_epochs: ignored; the task is an endless stream "
                             "(task.num_problems: null)", ctx.stage_id)
        if endless and c.shuffle:
            self.log.warning("stages.%s.config.shuffle: ignored; an endless stream is drawn at "
                             "random already", ctx.stage_id)
        node = PromptNode(self.task, num_epochs=c.num_epochs, shuffle=c.shuffle is not False,
                          seed=ctx.seed_for("shuffle") if c.seed is None else c.seed,
                          replica=ctx.replica, num_replicas=ctx.num_replicas)
        self._batches = prompt_batches(node, c.prompts_per_batch)
        skipped = len(self.task.skipped)
        self.log.info("task %s: %s records (%d malformed skipped), replica %d of %d", c.task.type,
                      "endless" if endless else self.task.num_records, skipped, ctx.replica,
                      ctx.num_replicas)
        self.metrics.log({"records_skipped": skipped}, reduce={"records_skipped": "sum"})
        if self._pending is not None:
            self.load_state_dict(self._pending)

    def generate(self) -> Iterator[pa.RecordBatch | Barrier]:
        assert self._batches is not None, "setup() runs before generate()"
        every = self.config.checkpoint_every_batches
        for records in self._batches:
            self.num_batches += 1
            yield batch_from_rows([self._row(r) for r in records], self.schema)
            if every and self.num_batches % every == 0:
                yield Barrier(self.num_batches)

    def _row(self, record: Record) -> dict[str, Any]:
        meta = {k: v for k, v in record.items() if k != "prompt_id"}
        meta["task_prompt_id"] = record["prompt_id"]
        pid, epoch = record["prompt_id"], record["epoch"]
        prompt_id = pid if epoch == 0 else f"{pid}~e{epoch}"
        try:
            return {"prompt_id": prompt_id, "metadata": json.dumps(meta)}
        except TypeError as e:
            raise ValueError(f"prompt {prompt_id!r}: a task field is not JSON-serialisable; got "
                             f"{e}; hint: keep record fields to strings, numbers, lists and dicts"
                             ) from None

    def state_dict(self) -> dict[str, Any]:
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
            raise ValueError(f"stage {self.ctx.stage_id!r}: state has no 'cursor'; got keys "
                             f"{sorted(state)}; hint: pass what DatasetSource.state_dict() "
                             "returned")
        if self._batches is None:  # before setup()
            self._pending = state
            return
        if state.get("num_records") != self.task.num_records:
            raise ValueError(f"stage {self.ctx.stage_id!r}: saved cursor is for "
                             f"{state.get('num_records')} records; got a task of "
                             f"{self.task.num_records}; hint: resume with the same task config")
        self._batches.reset(state["cursor"])
        self.num_batches = state.get("num_batches", 0)
