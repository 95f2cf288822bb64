"""The trainer publishes its own weights: where a policy version is born (contract: molt.refit).

After step k the train stage calls `Publisher.publish` (version k+1) on every rank: all ranks
gather the full state dict and score the refit probe; rank 0 writes a safetensors file (default:
in the run's scratch folder), keeps the newest ``keep_versions`` and sends the weight-version
record. With an NCCL transport the record goes first, then the tensors (molt.train.nccl_send).
A LoRA policy that trains adapters only publishes them alone, as a peft folder.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch

from molt.refit import (ADAPTER_FILE, DEFAULT_ATOL, LOW_PRECISION_ATOL, NCCLTransport, Probe,
                        PublishConfig, check_transport, probe_token_ids, state_digests,
                        weight_record)
from molt.schema import WEIGHT_VERSION_SCHEMA, batch_from_rows
from molt.runtime.stage import run_owned, scratch_folder
from molt.train.lora import (adapter_state, adapters_only, outside_language_model,
                             write_adapter_config)
from molt.train.model import full_state_dict

if TYPE_CHECKING:
    from molt.policy import LoraConfig
    from molt.train.nccl_send import NCCLSender
    from molt.train.model import PolicyModel

logger = logging.getLogger(__name__)


class Publisher:
    """Publishes one output's weight versions; one per subscribed output, on every rank."""

    def __init__(self, config: PublishConfig, model: PolicyModel, rank: int, where: str):
        """``where``: the YAML key of ``config``.

        Raises:
            ValueError: a transport this process cannot use.
        """
        check_transport(config.transport, f"{where}.transport")
        self.config, self.model, self.rank = config, model, rank
        self.folder: Path | None = None
        self.sender: NCCLSender | None = None  # made at the first publication, on its GPU by then
        self.written: list[Path] = []
        self.probe_seconds = 0.0  # of the last publication's probe
        if rank == 0 and config.transport.type == "shm":
            if config.dir is None:
                self.folder = scratch_folder("molt-weights-")
            else:
                Path(config.dir).mkdir(parents=True, exist_ok=True)
                self.folder = Path(tempfile.mkdtemp(prefix="molt-weights-", dir=config.dir))
        if config.probe_tokens < 2:
            logger.warning("%s.probe_tokens < 2: no refit probe; refits are verified by tensor "
                           "digests only", where)
        shm = config.transport.type == "shm"
        self.adapters = model.lora is not None and shm and adapters_only(model)
        self.exclude = outside_language_model(model.lm) if self.adapters else None
        if model.lora is not None and not self.adapters:
            logger.warning("%s: refits ship the merged weights, not the adapter alone: %s", where,
                           "routers train in full" if shm else "streamed refits")

    async def publish(self, version: int,
                      send: Callable[[pa.RecordBatch], Awaitable[None]]) -> None:
        """Publish the model as ``version`` (a collective); rank 0 sends the record by ``send``."""
        start = time.monotonic()
        state = adapter_state(self.model) if self.adapters else full_state_dict(self.model)
        if self.rank > 0:  # ranks > 0 only take part in the gather and the probe
            self._probe()
            return
        if isinstance(transport := self.config.transport, NCCLTransport):
            # 1) the record tells the engines what comes  2) they meet the send in NCCL
            if self.sender is None:
                from molt.train.nccl_send import NCCLSender

                self.sender = NCCLSender(transport)
            fields = self.sender.record_fields(state)
            record = weight_record(state, version, fields["uri"], state_digests(state),
                                   self._probe(), fields["format"])
            await send(batch_from_rows([record], WEIGHT_VERSION_SCHEMA))
            await asyncio.to_thread(self.sender.send, state)
        else:
            assert self.folder is not None, "rank 0 of shm has a folder"
            if self.model.lora is not None and self.adapters:
                path = self.folder / f"policy_v{version}"
                record = publish_adapter(state, path, version, self._probe, self.model.lora,
                                         self.exclude)
            else:
                path = self.folder / f"policy_v{version}.safetensors"
                record = publish_weights(state, path, version, self._probe)
            self._prune(path)
            await send(batch_from_rows([record], WEIGHT_VERSION_SCHEMA))
        logger.info("published version %d: %d tensors, %.1f MB in %.2fs (probe %.2fs)", version,
                    len(state), record["num_bytes"] / 1e6, time.monotonic() - start,
                    self.probe_seconds)

    def _probe(self) -> Probe | None:
        """The refit probe of the weights (a collective), timed in ``probe_seconds``."""
        start, self.probe_seconds = time.monotonic(), 0.0
        if self.config.probe_tokens < 2:
            return None
        model = self.model  # a VLM: text tokens below its image token (appended last)
        vocab = model.lm.config.get_text_config().vocab_size  # type: ignore[operator, union-attr]
        ids = probe_token_ids(min(vocab, model.vision.image_token_id) if model.vision else vocab,
                              self.config.probe_tokens)
        probe = policy_probe(model, ids, self.config.probe_atol)
        self.probe_seconds = time.monotonic() - start
        return probe

    def _prune(self, newest: Path) -> None:
        self.written.append(newest)
        while len(self.written) > self.config.keep_versions:
            if (old := self.written.pop(0)).is_dir():
                shutil.rmtree(old, ignore_errors=True)
            old.unlink(missing_ok=True)

    def close(self) -> None:
        """Close the NCCL sender; remove a folder outside the run's scratch folder (which the
        runner removes once consumers of the last record have exited)."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.folder is not None and not run_owned(self.folder):
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None


@torch.no_grad()
def policy_probe(model: PolicyModel, token_ids: list[int], atol: float | None = None) -> Probe:
    """The trainer's probe logprobs of ``token_ids`` at temperature 1 (a collective), on one CPU
    thread: OpenMP threads would contend with the engine's."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([token_ids], device=device)  # [1, P]
    position_ids = torch.arange(len(token_ids), device=device)[None]  # [1, P]
    temperature, training = model.temperature, model.training
    dtypes: list[torch.dtype] = []  # what the embedding returns: the forward's compute dtype
    embedding = model.lm.get_input_embeddings()  # type: ignore[operator]
    hook = embedding.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    threads = torch.get_num_threads()
    model.temperature = 1.0
    model.eval()
    torch.set_num_threads(1 if device.type == "cpu" else threads)
    try:
        logprobs = model(input_ids, position_ids)  # [P], 0 at the first token
    finally:
        model.temperature = temperature
        model.train(training)
        hook.remove()
        torch.set_num_threads(threads)
    atol = atol if atol is not None else DEFAULT_ATOL.get(dtypes[0], LOW_PRECISION_ATOL)
    return Probe(list(token_ids), logprobs[1:].float().cpu().tolist(), atol)


def publish_adapter(state: dict[str, torch.Tensor], folder: Path, version: int,
                    probe: Callable[[], Probe | None], lora: LoraConfig,
                    exclude: str | None = None) -> dict[str, Any]:
    """Write the adapters ``state`` as a peft folder atomically (``.tmp``, then a rename) and
    return its `weight_record`: format "peft", uri the folder."""
    tmp = folder.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    record = publish_weights(state, tmp / ADAPTER_FILE, version, probe)
    write_adapter_config(tmp, lora, None, exclude=exclude)
    os.replace(tmp, folder)
    return {**record, "uri": f"file://{folder}", "format": "peft"}


def publish_weights(state: dict[str, torch.Tensor], path: Path, version: int,
                    probe: Probe | Callable[[], Probe | None] | None = None) -> dict[str, Any]:
    """Write ``state`` as one safetensors file at ``path`` atomically; return its `weight_record`,
    digests of the tensors in memory. A callable ``probe`` runs during the write."""
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    with ThreadPoolExecutor(2, thread_name_prefix="molt-publish") as pool:
        digesting = pool.submit(state_digests, state)
        metadata = {"format": "pt", "policy_version": str(version)}
        writing = pool.submit(save_file, state, str(tmp), metadata)
        probe = probe() if callable(probe) else probe
        writing.result()
        os.replace(tmp, path)
        digests = digesting.result()
    return weight_record(state, version, f"file://{path}", digests, probe)
