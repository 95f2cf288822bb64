"""Evaluate: held-out accuracy of the policy, before training and every k versions, per task.

Runs its own engine, fed the trainer's weight records on ``weights`` (a broadcast edge). It
evaluates the initial weights; then, per task, once a version ``v % every_versions == 0`` is
published, the newest version received; at end of stream, the last version on every task not
yet evaluated at it. Refits are verified; a resumed run skips the versions its metrics file
holds. Metrics (molt.agents.evaluation) are logged at step = policy version
(``evaluate/gsm8k/pass@8``), a row per task sent on ``out``. Each record's file is hard-linked
here as it arrives, so the trainer's pruning cannot delete a version still to be evaluated.

    evaluate:
      class: stages.evaluate.Evaluate
      config: {task: {type: arithmetic, split: eval, num_problems: 500}, every_versions: 4}
      # or {tasks: {a: {task: {...}}, b: {task: {...}, samples: 8, every_versions: 16}}}
    edges:
      - {from: train.weights, to: evaluate.weights, kind: broadcast}
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import Field

from molt.agents import ChatTemplate
from molt.engines import EngineConfig, make_engine
from molt.engines.refit import FILE_FORMATS, apply_weight_record, link_weights, remove_weights
from molt.agents.evaluation import EVAL_SCHEMA, EvaluationConfig, Evaluator
from molt.policy import policy_field
from molt.runtime.stage import Port, Service, scratch_folder


class Evaluate(Service):
    """Weight-version records in; one evaluation row out per evaluated version and task."""

    class Config(EvaluationConfig):
        model: str = policy_field("model", "smollm2-135m-instruct")
        engine: EngineConfig = Field(default_factory=EngineConfig)
        tool_parser: str = policy_field("tool_parser", "hermes")

    config: Config
    inputs = {"weights": Port()}
    outputs = {"out": Port(schema=EVAL_SCHEMA)}

    def setup(self) -> None:
        from molt.models import resolve_model

        c, where = self.config, f"stages.{self.ctx.stage_id}.config"
        self.evaluator = Evaluator(self, c, where, "out")
        model_dir, replica = resolve_model(c.model), self.ctx.replica
        self.chat = ChatTemplate.for_model(model_dir, c.tool_parser, f"{where}.tool_parser")
        self.engine = make_engine(c.engine, str(model_dir), f"{where}.engine", replica,
                                  self.ctx.seed_for(replica))
        self.folder = scratch_folder("molt-eval-")
        self.newest: Path | None = None  # our newest link
        self.loading: Path | None = None  # the link an engine is loading

    async def run(self) -> None:
        # A receiver task links each record's file as it arrives, also while an evaluation runs.
        received: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        receiver = asyncio.create_task(self._receive(received))
        await self.evaluate(self.evaluator.due(self.engine.policy_version))  # the initial weights
        last: dict[str, Any] | None = None
        end = False
        while not end:
            # 1) every record received  2) keep the newest linked one  3) evaluate the due tasks
            waiting = [await received.get()]
            while not received.empty():
                waiting.append(received.get_nowait())
            end = waiting[-1] is None
            linked = [r for r in waiting if r is not None and r["uri"] is not None]
            last = linked[-1] if linked else last
            if last is not None:
                await self._load_and_evaluate(last, self.evaluator.due(last["policy_version"]))
        await receiver  # raises what the receiver raised
        # 4) end of stream: the final version, on every task
        if last is not None:
            await self._load_and_evaluate(last, self.evaluator.not_yet(last["policy_version"]))

    async def _receive(self, received: asyncio.Queue[dict[str, Any] | None]) -> None:
        """Put each weight record on ``received`` (`_keep`); None at the end."""
        try:
            while (item := await self.recv("weights")) is not None:
                if isinstance(item, pa.RecordBatch):
                    for record in item.to_pylist():
                        received.put_nowait(self._keep(record))
        finally:
            received.put_nowait(None)

    def _keep(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record with ``uri`` at our newest link to its file (the previous link removed unless
        being loaded); ``uri`` None if the file was pruned (a newer record follows)."""
        if record.get("format", "safetensors") not in FILE_FORMATS:
            raise ValueError(f"stage {self.ctx.stage_id!r}: weight record "
                             f"v{record['policy_version']} comes over {record['format']!r}; an "
                             "evaluation loads files; hint: feed it from a train output published "
                             "with transport {type: shm} (molt.train.publish)")
        source = Path(record["uri"].removeprefix("file://"))
        link = self.folder / f"v{record['policy_version']}{source.suffix}"
        if not link.exists():
            try:
                link_weights(source, link)
            except FileNotFoundError:
                self.log.warning("version %d was pruned before its record was read; a newer one "
                                 "follows", record["policy_version"])
                return {**record, "uri": None}
        previous, self.newest = self.newest, link
        if previous is not None and previous not in (self.loading, link):
            remove_weights(previous)
        return {**record, "uri": f"file://{link}"}

    async def _load_and_evaluate(self, record: dict[str, Any], names: list[str]) -> None:
        if not names:
            return
        # set before any await, so that `_keep` spares it
        self.loading = Path(record["uri"].removeprefix("file://"))
        try:
            if record["policy_version"] != self.engine.policy_version:
                await apply_weight_record(self.engine, record)
        finally:
            if self.loading != self.newest:
                remove_weights(self.loading)
            self.loading = None
        await self.evaluate(names)

    async def evaluate(self, names: list[str]) -> None:
        await self.evaluator.run(names)

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        if getattr(self, "folder", None) is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
