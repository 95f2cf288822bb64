"""Evaluate: held-out greedy accuracy of the policy, before training and every k versions.

Runs its own engine (vLLM by default) on the policy's model and listens to the weight broadcast on
``weights`` (a ``kind: broadcast`` edge). It evaluates the initial weights at start; then, whenever a
version ``v`` with ``v % every_versions == 0`` has been published, the newest version received (``v``
unless newer ones were waiting or its file was pruned); and at end of stream the last version it saw
if not evaluated yet (the final accuracy). Refits are verified (molt.engines.weights).

One evaluation: every problem of ``task`` (e.g. the arithmetic ``eval`` split, which never overlaps
``train``), one greedy completion each (``max_new_tokens``), graded by ``grader`` against the task's
answer. It logs, at step = policy version (keys prefixed by the stage id, e.g. ``evaluate/accuracy``)::

    accuracy           p = correct / n
    accuracy_stderr    sqrt(p (1 - p) / n)   (binomial standard error of p)
    accuracy_baseline  p of the first evaluation (version 0 in a fresh run)
    num_problems, policy_version, seconds

and sends one row per evaluation on ``out`` (EVAL_SCHEMA). Example: 500 problems, 120 right -> accuracy 0.24,
stderr sqrt(0.24 * 0.76 / 500) = 0.019.

Weight files: a record's file is hard-linked into this stage's own folder as it arrives, so the
broadcast's pruning (``keep_versions``) or its exit cannot delete a version still to be evaluated;
only the newest link (and one being loaded) is kept. A file pruned before its record was read is
skipped for the newer one. The task is loaded once before the run starts (`preflight_task`).

    evaluate:
      class: stages.evaluate.Evaluate
      config: {task: {type: arithmetic, split: eval, num_problems: 500}, every_versions: 4}
    edges:
      - {from: broadcast.weights, to: evaluate.weights, kind: broadcast}
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
from pydantic import Field

from molt.agents import ChatTemplate, SingleTurn, run_episode
from molt.engines.base import SamplingParams
from molt.engines.config import EngineConfig, make_engine
from molt.engines.weights import apply_weight_record
from molt.graders import GraderConfig, MathGrader
from molt.schema import batch_from_rows, make_schema
from molt.stage import Port, Service, StageConfig, scratch_folder
from molt.tasks import TaskConfig, preflight_task

EVAL_SCHEMA = make_schema([
    pa.field("policy_version", pa.int32(), metadata={b"doc": b"optimizer steps in the evaluated weights"}),
    pa.field("accuracy", pa.float64(), metadata={b"doc": b"fraction of problems answered right, greedy"}),
    pa.field("accuracy_stderr", pa.float64(), metadata={b"doc": b"binomial standard error sqrt(p(1-p)/n)"}),
    pa.field("num_problems", pa.int64(), metadata={b"doc": b"problems evaluated"}),
    pa.field("seconds", pa.float64(), metadata={b"doc": b"wall time of the evaluation"}),
], "eval")


class Evaluate(Service):
    """Weight-version records in; one evaluation row out per evaluated version."""

    class Config(StageConfig):
        task: TaskConfig = Field(description="held-out problems, e.g. {type: arithmetic, split: eval}")
        model: str = Field("smollm2-135m-instruct", description="the policy's initial model (as the rollout's)")
        engine: EngineConfig = Field(default_factory=EngineConfig)
        every_versions: int = Field(1, ge=1, description="evaluate versions divisible by this")
        max_new_tokens: int = Field(24, ge=1, description="per completion")
        grader: GraderConfig = Field(default_factory=MathGrader,  # type: ignore[assignment]
                                     description="{type: math} or {type: exact}")

    config: Config
    inputs: ClassVar[dict[str, Port]] = {"weights": Port()}
    outputs: ClassVar[dict[str, Port]] = {"out": Port(schema=EVAL_SCHEMA)}

    @classmethod
    def preflight(cls, config: StageConfig, where: str) -> None:
        preflight_task(config.task, f"{where}.task")  # type: ignore[attr-defined]  # an Evaluate.Config

    def setup(self) -> None:
        from molt.models import resolve_model

        c = self.config
        task = c.task.load()
        if task.num_records is None:
            raise ValueError(f"stages.{self.ctx.stage_id}.config.task: evaluation needs a finite task; got an "
                             "endless stream; hint: set task.num_problems")
        self.problems = [task.record(i) for i in range(task.num_records)]
        model_dir, replica = resolve_model(c.model), self.ctx.replica
        self.chat = ChatTemplate.for_model(model_dir)
        self.engine = make_engine(c.engine, str(model_dir), f"stages.{self.ctx.stage_id}.config.engine", replica,
                                  self.ctx.seed_for(replica))
        self.params = SamplingParams(temperature=0.0, max_new_tokens=c.max_new_tokens)
        self.folder = scratch_folder("molt-eval-")
        self.newest: Path | None = None  # our newest link
        self.loading: Path | None = None  # the link an engine is loading
        self.evaluated: list[int] = []
        self.log.info("%d held-out problems, every %d versions", len(self.problems), c.every_versions)

    async def run(self) -> None:
        # A receiver task links each record's file as it arrives, also while an evaluation runs.
        received: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        receiver = asyncio.create_task(self._receive(received))
        await self.evaluate()
        last: dict[str, Any] | None = None
        due = end = False  # due: a version divisible by every_versions was published since the last evaluation
        while not end:
            # 1) every record received  2) keep the newest linked one  3) load + evaluate if due
            waiting = [await received.get()]
            while not received.empty():
                waiting.append(received.get_nowait())
            end = waiting[-1] is None
            records = [r for r in waiting if r is not None]
            due = due or any(r["policy_version"] % self.config.every_versions == 0 for r in records)
            last = next((r for r in reversed(records) if r["uri"] is not None), last)  # older links: gone
            if due and last is not None and last["policy_version"] not in self.evaluated:
                await self._load_and_evaluate(last)
                due = False
        await receiver  # raises what the receiver raised
        # 4) end of stream: the final version
        if last is not None and last["policy_version"] not in self.evaluated:
            await self._load_and_evaluate(last)

    async def _receive(self, received: asyncio.Queue[dict[str, Any] | None]) -> None:
        """Put each weight record on ``received`` with ``uri`` at our hard link (None: pruned); None at the end."""
        try:
            while (item := await self.recv("weights")) is not None:
                if isinstance(item, pa.RecordBatch):
                    for record in item.to_pylist():
                        received.put_nowait(self._keep(record))
        finally:
            received.put_nowait(None)

    def _keep(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record with ``uri`` at a hard link of its file in our folder, now our newest link (the
        previous one is dropped unless an engine is loading it); ``uri`` None if the broadcast had
        already pruned the file (it prunes only after writing a newer one, whose record follows)."""
        if record.get("format", "safetensors") != "safetensors":
            raise ValueError(f"stage {self.ctx.stage_id!r}: weight record v{record['policy_version']} comes over "
                             f"{record['format']!r}; an evaluation loads files; hint: feed it from a broadcast "
                             "stage with transport {type: shm} (stages.broadcast docstring)")
        source = Path(record["uri"].removeprefix("file://"))
        link = self.folder / f"v{record['policy_version']}.safetensors"
        if not link.exists():
            try:
                os.link(source, link)
            except FileNotFoundError:
                self.log.warning("version %d was pruned before its record was read; a newer one follows",
                                 record["policy_version"])
                return {**record, "uri": None}
            except OSError:  # another file system: copy instead
                shutil.copy(source, link)
        previous, self.newest = self.newest, link
        if previous is not None and previous not in (self.loading, link):
            previous.unlink(missing_ok=True)
        return {**record, "uri": f"file://{link}"}

    async def _load_and_evaluate(self, record: dict[str, Any]) -> None:
        self.loading = Path(record["uri"].removeprefix("file://"))  # set before any await: `_link` spares it
        try:
            await apply_weight_record(self.engine, record)
        finally:
            if self.loading != self.newest:
                self.loading.unlink(missing_ok=True)
            self.loading = None
        await self.evaluate()

    async def evaluate(self) -> float:
        """Greedy accuracy of the engine's current weights on every problem; logs and sends it."""
        start, version = time.monotonic(), self.engine.policy_version
        results = await asyncio.gather(*(self._solve(i, p) for i, p in enumerate(self.problems)))
        n, accuracy = len(results), sum(results) / max(len(results), 1)
        stderr = math.sqrt(accuracy * (1 - accuracy) / max(n, 1))
        seconds = time.monotonic() - start
        values = {"accuracy": accuracy, "accuracy_stderr": stderr, "num_problems": n, "policy_version": version,
                  "seconds": seconds}
        if not self.evaluated:
            values["accuracy_baseline"] = accuracy
        self.evaluated.append(version)
        self.metrics.log(values, step=version)
        self.log.info("eval version %d: accuracy %.3f +- %.3f (%d problems, %.1fs)", version, accuracy, stderr, n,
                      seconds)
        await self.send("out", batch_from_rows([{k: values[k] for k in EVAL_SCHEMA.names}], EVAL_SCHEMA))
        return accuracy

    async def _solve(self, index: int, problem: dict[str, Any]) -> float:
        request_id = f"eval-v{self.engine.policy_version}-{index}"
        episode = await run_episode(self.engine, self.chat, SingleTurn(), problem, self.params, request_id,
                                    1, self.config.engine.max_model_len)
        return self.config.grader.grade(episode.completion_text, str(problem["answer"])).score

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        if getattr(self, "folder", None) is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
