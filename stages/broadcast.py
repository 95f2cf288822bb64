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
the digests and the probe (its engine must match within ``probe_atol``). With
``transport: {type: nccl}`` (CUDA; unverified on GPUs) no file is written: the record
(format "nccl", the rendezvous uri, every tensor's digest, dtype and shape) goes out
first, then rank 0 broadcasts the tensors to every engine worker over vLLM's
weight-transfer API (molt.engines.nccl_transfer), waiting until they have taken them;
every subscriber of ``weights`` must then be an engine with ``engine.transport: {type:
nccl}`` counted in ``num_engine_workers`` (an evaluation takes files: give it a second
broadcast with ``transport: {type: shm}``, also fused into the train stage and fed by
its own ``{from: train, to: eval_broadcast}`` edge, as pipelines/gsm8k_gpu.yaml does). With tied
embeddings only ``model.embed_tokens.weight`` is written, as in the HF folder. Step records are
passed on ``out`` (e.g. to a sink). A resumed trainer's resume record (``num_rows``
0) is always exported, whatever ``every_steps``, and not passed on.

    broadcast: {class: stages.broadcast.Broadcast, colocate_with: train}
    edges:
      - {from: train, to: broadcast}
      - {from: broadcast.weights, to: rollout.weights, kind: broadcast, feedback: true}
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import pyarrow as pa
from pydantic import Field

from molt.engines.probe import Probe, policy_probe, probe_token_ids
from molt.engines.transport import NCCLTransport, ShmTransport, TransportConfig, check_transport
from molt.engines.weights import publish_weights, state_digests, weight_record
from molt.schema import WEIGHT_VERSION_SCHEMA, batch_from_rows
from molt.stage import Port, Service, StageConfig, run_owned, scratch_folder
from molt.train.handoff import policy_handle
from molt.train.model import full_state_dict
from molt.edges import Barrier

if TYPE_CHECKING:
    from molt.engines.nccl_transfer import NCCLSender


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
        transport: TransportConfig = Field(default_factory=ShmTransport, description="{type: shm}: a safetensors "
                                           "file in dir; {type: nccl}: vLLM's weight-transfer API (module docstring)")

    config: Config
    inputs: ClassVar[dict[str, Port]] = {"in": Port(reads=(pa.field("policy_version", pa.int32()),
                                                           pa.field("num_rows", pa.int64())))}
    outputs: ClassVar[dict[str, Port]] = {"out": Port(passes="in"), "weights": Port(schema=WEIGHT_VERSION_SCHEMA)}

    def setup(self) -> None:
        self.handle = policy_handle(self.config.train_stage)
        self.handle.consumers += 1
        check_transport(self.config.transport, f"stages.{self.ctx.stage_id}.config.transport")
        self.folder: Path | None = None
        self.sender: NCCLSender | None = None  # rank 0 with nccl, at the first export (on its GPU by then)
        if self.ctx.rank == 0 and self.config.transport.type == "shm":
            if self.config.dir is None:
                self.folder = scratch_folder("molt-weights-")
            else:
                Path(self.config.dir).mkdir(parents=True, exist_ok=True)
                self.folder = Path(tempfile.mkdtemp(prefix="molt-weights-", dir=self.config.dir))
        self.written: list[Path] = []
        self.probe_seconds = 0.0  # the last trainer probe's forward
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
                await self.export(version)
            if not resumed:
                await self.send("out", item)
            self.handle.ack(step)

    async def export(self, version: int) -> None:
        """Gather the full state dict (collective); on rank 0 publish it: its record on ``weights``
        (after writing its file, or before the NCCL send)."""
        if self.handle.model is None:
            raise ValueError(f"stage {self.ctx.stage_id!r}: no train stage {self.config.train_stage!r} in this "
                             "process; hint: set colocate_with and train_stage to the train stage's id")
        start = time.monotonic()
        state = full_state_dict(self.handle.model)
        if self.ctx.rank > 0:  # ranks > 0 only take part in the gather and the probe
            self._probe()
            return
        if isinstance(transport := self.config.transport, NCCLTransport):
            # 1) the record tells the engines what comes  2) they meet the send in NCCL
            if self.sender is None:
                from molt.engines.nccl_transfer import NCCLSender

                self.sender = NCCLSender(transport)
            fields = self.sender.record_fields(state)
            record = weight_record(state, version, fields["uri"], state_digests(state), self._probe(), fields["format"])
            await self.send("weights", batch_from_rows([record], WEIGHT_VERSION_SCHEMA))
            await asyncio.to_thread(self.sender.send, state)
        else:
            assert self.folder is not None, "rank 0 of shm has a folder"
            path = self.folder / f"policy_v{version}.safetensors"
            record = publish_weights(state, path, version, self._probe)  # the probe's forward overlaps the write
            self._prune(Path(record["uri"].removeprefix("file://")))
            await self.send("weights", batch_from_rows([record], WEIGHT_VERSION_SCHEMA))
        self.log.info("published version %d: %d tensors, %.1f MB in %.2fs (probe %.2fs)", version, len(state),
                      record["num_bytes"] / 1e6, time.monotonic() - start, self.probe_seconds)
        self.handle.export_seconds = time.monotonic() - start
        self.metrics.log({"export_seconds": self.handle.export_seconds, "probe_seconds": self.probe_seconds,
                          "policy_version": version}, step=version)

    def _probe(self) -> Probe | None:
        """The trainer's refit probe of the new weights: a forward, so a collective (all ranks);
        its duration in ``probe_seconds``."""
        start, self.probe_seconds = time.monotonic(), 0.0
        if self.config.probe_tokens < 2:
            return None
        model = self.handle.model  # a VLM: text tokens below its image token (molt.models.vlm appends it last)
        vocab = model.lm.config.get_text_config().vocab_size
        ids = probe_token_ids(min(vocab, model.vision.image_token_id) if model.vision else vocab, self.config.probe_tokens)
        probe = policy_probe(self.handle.model, ids, self.config.probe_atol)
        self.probe_seconds = time.monotonic() - start
        return probe

    def _prune(self, newest: Path) -> None:
        self.written.append(newest)
        while len(self.written) > self.config.keep_versions:
            self.written.pop(0).unlink(missing_ok=True)

    def close(self) -> None:
        if getattr(self, "sender", None) is not None:
            self.sender.close()  # type: ignore[union-attr]
            self.sender = None
        # In the run's scratch folder the files stay until the runner removes it after every process
        # has exited, so a consumer still reading the last version's record finds its file.
        if getattr(self, "folder", None) is not None and not run_owned(self.folder):  # type: ignore[arg-type]
            shutil.rmtree(self.folder, ignore_errors=True)  # type: ignore[arg-type]
        self.folder = None
