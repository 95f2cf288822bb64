"""Broadcast: publishes the trainer's weights after each step (or every k steps).

Fused into the train group (``colocate_with: train``), so it runs on every rank: on
each step record it gathers the full Hugging Face-named state dict (a collective
over all ranks: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``);
rank 0 writes it as one safetensors file in ``dir`` (temp name, then an atomic
rename), keeps the newest ``keep_versions`` files, digests every tensor
(molt.engines.weights.tensor_digest) and sends a weight-version record
(molt.schema.WEIGHT_VERSION_SCHEMA, ``policy_version`` = optimizer steps done) on
``weights``; the rollout loads it and verifies the digests. With tied embeddings
only ``model.embed_tokens.weight`` is written, as in the HF folder. Step records are
passed on ``out`` (e.g. to a sink).

    broadcast: {class: stages.broadcast.Broadcast, colocate_with: train}
    edges:
      - {from: train, to: broadcast}
      - {from: broadcast.weights, to: rollout.weights, kind: broadcast, feedback: true}
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import ClassVar

import pyarrow as pa
from pydantic import Field

from molt.engines.weights import publish_weights
from molt.schema import WEIGHT_VERSION_SCHEMA, batch_from_rows
from molt.stage import Port, Service, StageConfig
from molt.train.handoff import policy_handle
from molt.train.model import full_state_dict
from molt.transport import Barrier


class Broadcast(Service):
    """Step records in; weight-version records out on ``weights``, step records on ``out``."""

    class Config(StageConfig):
        train_stage: str = Field("train", description="id of the train stage this is fused into")
        every_steps: int = Field(1, ge=1, description="export after every k-th step (policy_version % k == 0)")
        dir: str = Field("/dev/shm", description="folder for the weight files (shared memory on one host)")
        keep_versions: int = Field(2, ge=1, description="newest weight files kept")

    config: Config
    inputs: ClassVar[dict[str, Port]] = {"in": Port(reads=(pa.field("policy_version", pa.int32()),))}
    outputs: ClassVar[dict[str, Port]] = {"out": Port(passes="in"), "weights": Port(schema=WEIGHT_VERSION_SCHEMA)}

    def setup(self) -> None:
        self.handle = policy_handle(self.config.train_stage)
        self.handle.consumers += 1
        self.folder: Path | None = None
        if self.ctx.rank == 0:
            Path(self.config.dir).mkdir(parents=True, exist_ok=True)
            self.folder = Path(tempfile.mkdtemp(prefix="molt-weights-", dir=self.config.dir))
        self.written: list[Path] = []

    async def run(self) -> None:
        while (item := await self.recv("in")) is not None:
            if isinstance(item, Barrier):
                await self.barrier(item.step)
                continue
            # 1) export if due (all ranks)  2) publish (rank 0)  3) ack the train stage
            step = int(item.column("step")[-1].as_py())
            version = int(item.column("policy_version")[-1].as_py())
            if version % self.config.every_steps == 0:
                record = self.export(version)
                if record is not None:
                    await self.send("weights", record)
            await self.send("out", item)
            self.handle.ack(step)

    def export(self, version: int) -> pa.RecordBatch | None:
        """Gather the full state dict (collective); on rank 0 write it and return its record."""
        if self.handle.model is None:
            raise ValueError(f"stage {self.ctx.stage_id!r}: no train stage {self.config.train_stage!r} in this "
                             "process; hint: set colocate_with and train_stage to the train stage's id")
        start = time.monotonic()
        state = full_state_dict(self.handle.model)
        if self.folder is None:  # ranks > 0 only take part in the gather
            return None
        record = publish_weights(state, self.folder / f"policy_v{version}.safetensors", version)
        self._prune(Path(record["uri"].removeprefix("file://")))
        self.log.info("published version %d: %d tensors, %.1f MB in %.2fs", version, len(state),
                      record["num_bytes"] / 1e6, time.monotonic() - start)
        self.metrics.log({"export_seconds": time.monotonic() - start, "policy_version": version}, step=version)
        return batch_from_rows([record], WEIGHT_VERSION_SCHEMA)

    def _prune(self, newest: Path) -> None:
        self.written.append(newest)
        while len(self.written) > self.config.keep_versions:
            self.written.pop(0).unlink(missing_ok=True)

    def close(self) -> None:
        if getattr(self, "folder", None) is not None:
            shutil.rmtree(self.folder, ignore_errors=True)  # type: ignore[arg-type]
            self.folder = None
