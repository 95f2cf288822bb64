"""Broadcast: publishes the trainer's weights after each step (or every k steps).

Fused into the train group (``colocate_with: train``), so it runs on every rank: on
each step record it gathers the full Hugging Face-named state dict (a collective
over all ranks: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``) and
scores the refit probe, ``probe_tokens`` fixed token ids, with the model at
temperature 1 (a forward, so also a collective; molt.engines.probe); rank 0 writes
it as one safetensors file in ``dir`` (default: the run's scratch folder in /dev/shm,
which the runner removes after the run, so the last files outlive this stage for the
consumers still reading their records; temp name, then an atomic rename), keeps the
newest ``keep_versions`` files, digests every tensor (molt.engines.weights.tensor_digest)
and sends a weight-version record (molt.schema.WEIGHT_VERSION_SCHEMA, ``policy_version``
= optimizer steps done, the probe) on ``weights``; the rollout loads it and verifies
the digests and the probe (its engine must match within ``probe_atol``). With tied
embeddings only ``model.embed_tokens.weight`` is written, as in the HF folder. Step records are
passed on ``out`` (e.g. to a sink). A resumed trainer's resume record (``num_rows``
0) is always exported, whatever ``every_steps``, and not passed on.

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

from molt.engines.probe import Probe, policy_probe, probe_token_ids
from molt.engines.weights import publish_weights
from molt.schema import WEIGHT_VERSION_SCHEMA, batch_from_rows
from molt.stage import Port, Service, StageConfig, run_owned, scratch_folder
from molt.train.handoff import policy_handle
from molt.train.model import full_state_dict
from molt.transport import Barrier


class Broadcast(Service):
    """Step records in; weight-version records out on ``weights``, step records on ``out``."""

    class Config(StageConfig):
        train_stage: str = Field("train", description="id of the train stage this is fused into")
        every_steps: int = Field(1, ge=1, description="export after every k-th step (policy_version % k == 0)")
        dir: str | None = Field(None, description="folder for the weight files; None: the run's scratch folder "
                                "in shared memory (molt.stage.scratch_folder), which outlives this stage")
        keep_versions: int = Field(2, ge=1, description="newest weight files kept")
        probe_tokens: int = Field(32, ge=0, description="length P of the refit probe (molt.engines.probe); < 2 = none")
        probe_atol: float | None = Field(None, gt=0, description="largest |engine - trainer| probe logprob "
                                         "accepted; None: 1e-3 for an fp32 trainer forward, 1.0 for bf16")

    config: Config
    inputs: ClassVar[dict[str, Port]] = {"in": Port(reads=(pa.field("policy_version", pa.int32()),
                                                           pa.field("num_rows", pa.int64())))}
    outputs: ClassVar[dict[str, Port]] = {"out": Port(passes="in"), "weights": Port(schema=WEIGHT_VERSION_SCHEMA)}

    def setup(self) -> None:
        self.handle = policy_handle(self.config.train_stage)
        self.handle.consumers += 1
        self.folder: Path | None = None
        if self.ctx.rank == 0:
            if self.config.dir is None:
                self.folder = scratch_folder("molt-weights-")
            else:
                Path(self.config.dir).mkdir(parents=True, exist_ok=True)
                self.folder = Path(tempfile.mkdtemp(prefix="molt-weights-", dir=self.config.dir))
        self.written: list[Path] = []
        if self.config.probe_tokens < 2:
            self.log.warning("probe_tokens < 2: no refit probe; refits are verified by tensor digests only")

    async def run(self) -> None:
        while (item := await self.recv("in")) is not None:
            if isinstance(item, Barrier):
                await self.barrier(item.step)
                continue
            # 1) export if due (all ranks)  2) publish (rank 0)  3) ack the train stage
            step = int(item.column("step")[-1].as_py())
            version = int(item.column("policy_version")[-1].as_py())
            resumed = item.column("num_rows")[-1].as_py() == 0
            if version % self.config.every_steps == 0 or resumed:
                record = self.export(version)
                if record is not None:
                    await self.send("weights", record)
            if not resumed:
                await self.send("out", item)
            self.handle.ack(step)

    def export(self, version: int) -> pa.RecordBatch | None:
        """Gather the full state dict (collective); on rank 0 write it and return its record."""
        if self.handle.model is None:
            raise ValueError(f"stage {self.ctx.stage_id!r}: no train stage {self.config.train_stage!r} in this "
                             "process; hint: set colocate_with and train_stage to the train stage's id")
        start = time.monotonic()
        state = full_state_dict(self.handle.model)
        probe_start = time.monotonic()
        probe, probe_seconds = self._probe(), time.monotonic() - probe_start
        if self.folder is None:  # ranks > 0 only take part in the gather
            return None
        record = publish_weights(state, self.folder / f"policy_v{version}.safetensors", version, probe)
        self._prune(Path(record["uri"].removeprefix("file://")))
        self.log.info("published version %d: %d tensors, %.1f MB in %.2fs (probe %.2fs)", version, len(state),
                      record["num_bytes"] / 1e6, time.monotonic() - start, probe_seconds)
        self.handle.export_seconds = time.monotonic() - start
        self.metrics.log({"export_seconds": self.handle.export_seconds, "probe_seconds": probe_seconds,
                          "policy_version": version}, step=version)
        return batch_from_rows([record], WEIGHT_VERSION_SCHEMA)

    def _probe(self) -> Probe | None:
        """The trainer's refit probe of the new weights: a forward, so a collective (all ranks)."""
        if self.config.probe_tokens < 2:
            return None
        model = self.handle.model  # a VLM: text tokens below its image token (molt.models.vlm appends it last)
        vocab = model.lm.config.get_text_config().vocab_size
        ids = probe_token_ids(min(vocab, model.vision.image_token_id) if model.vision else vocab, self.config.probe_tokens)
        return policy_probe(self.handle.model, ids, self.config.probe_atol)

    def _prune(self, newest: Path) -> None:
        self.written.append(newest)
        while len(self.written) > self.config.keep_versions:
            self.written.pop(0).unlink(missing_ok=True)

    def close(self) -> None:
        # In the run's scratch folder the files stay until the runner removes it after every process
        # has exited, so a consumer still reading the last version's record finds its file.
        if getattr(self, "folder", None) is not None and not run_owned(self.folder):  # type: ignore[arg-type]
            shutil.rmtree(self.folder, ignore_errors=True)  # type: ignore[arg-type]
        self.folder = None
