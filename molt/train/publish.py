"""The trainer publishes its own weights: where a policy version is born (molt.refit: the contract).

After optimizer step k the train stage calls `Publisher.publish` (version k+1) on every rank, for each
subscribed weights output whose ``every_steps`` divides the version:

1) all ranks gather the full Hugging Face-named state dict (molt.train.model.full_state_dict, a
   collective) and score the refit probe at temperature 1 (`policy_probe`: a forward, also collective);
2) rank 0 writes one safetensors file in ``dir`` (default: the run's scratch folder in /dev/shm, which
   the runner removes after the run, so the last files outlive the trainer; temp name, then a rename),
   digests every tensor beside the write, keeps the newest ``keep_versions`` files and sends the
   weight-version record. With ``transport: {type: nccl}`` (CUDA; unverified on GPUs) the record goes
   first, then rank 0 broadcasts the tensors to every engine worker (molt.train.nccl_send); an
   evaluation, which loads files, then takes a second output: ``policy: {weights: {transport: {type:
   nccl, num_engine_workers: 4}}}`` and ``train.config.publish: {eval_weights: {every_steps: 10}}``.

With tied embeddings only ``model.embed_tokens.weight`` is written, as in the HF folder. A LoRA policy
whose only trained parameters are its adapters publishes them alone over shm (`publish_adapter`: a peft
folder, record format "peft"; the engines serve one adapter per live version, molt.engines.vllm_lora);
with routers trained in full, or streamed, it publishes its merged weights (molt.train.lora.merge_lora).
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

from molt.refit import (ADAPTER_FILE, DEFAULT_ATOL, LOW_PRECISION_ATOL, NCCLTransport, Probe, PublishConfig, check_transport,
                        probe_token_ids, state_digests, weight_record)
from molt.schema import WEIGHT_VERSION_SCHEMA, batch_from_rows
from molt.runtime.stage import run_owned, scratch_folder
from molt.train.lora import adapter_state, adapters_only, outside_language_model, write_adapter_config
from molt.train.model import full_state_dict

if TYPE_CHECKING:
    from molt.policy import LoraConfig
    from molt.train.nccl_send import NCCLSender
    from molt.train.model import PolicyModel

logger = logging.getLogger(__name__)


class Publisher:
    """Publishes one output's weight versions (module docstring); one per subscribed output, on every rank."""

    def __init__(self, config: PublishConfig, model: PolicyModel, rank: int, where: str):
        """``where``: the YAML key of ``config`` (errors name it). Rank 0 of shm makes its folder.

        Raises:
            ValueError: a transport this process cannot use (molt.refit.check_transport).
        """
        check_transport(config.transport, f"{where}.transport")
        self.config, self.model, self.rank = config, model, rank
        self.folder: Path | None = None
        self.sender: NCCLSender | None = None  # rank 0 with nccl, at the first publication (on its GPU by then)
        self.written: list[Path] = []
        self.seconds = self.probe_seconds = 0.0  # the last publication's, and its probe forward's
        if rank == 0 and config.transport.type == "shm":
            if config.dir is None:
                self.folder = scratch_folder("molt-weights-")
            else:
                Path(config.dir).mkdir(parents=True, exist_ok=True)
                self.folder = Path(tempfile.mkdtemp(prefix="molt-weights-", dir=config.dir))
        if config.probe_tokens < 2:
            logger.warning("%s.probe_tokens < 2: no refit probe; refits are verified by tensor digests only", where)
        self.adapters = model.lora is not None and config.transport.type == "shm" and adapters_only(model)
        self.exclude = outside_language_model(model.lm) if self.adapters else None  # a VLM adapter's exclude_modules
        if model.lora is not None and not self.adapters:
            logger.warning("%s: refits ship the merged weights, not the adapter alone: %s", where,
                           "routers train in full" if config.transport.type == "shm" else "streamed refits")

    async def publish(self, version: int, send: Callable[[pa.RecordBatch], Awaitable[None]]) -> None:
        """Publish the model as ``version`` on every rank (collectives); rank 0 sends its record
        with ``send`` (after writing its file, or before the NCCL send)."""
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
            record = weight_record(state, version, fields["uri"], state_digests(state), self._probe(), fields["format"])
            await send(batch_from_rows([record], WEIGHT_VERSION_SCHEMA))
            await asyncio.to_thread(self.sender.send, state)
        else:
            assert self.folder is not None, "rank 0 of shm has a folder"
            if self.model.lora is not None and self.adapters:
                path = self.folder / f"policy_v{version}"
                record = publish_adapter(state, path, version, self._probe, self.model.lora, self.exclude)
            else:
                path = self.folder / f"policy_v{version}.safetensors"
                record = publish_weights(state, path, version, self._probe)
            self._prune(path)
            await send(batch_from_rows([record], WEIGHT_VERSION_SCHEMA))
        self.seconds = time.monotonic() - start
        logger.info("published version %d: %d tensors, %.1f MB in %.2fs (probe %.2fs)", version, len(state),
                    record["num_bytes"] / 1e6, self.seconds, self.probe_seconds)

    def _probe(self) -> Probe | None:
        """The trainer's refit probe of the weights (a collective); its duration in ``probe_seconds``."""
        start, self.probe_seconds = time.monotonic(), 0.0
        if self.config.probe_tokens < 2:
            return None
        model = self.model  # a VLM: text tokens below its image token (molt.models.vlm appends it last)
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
        """Close the NCCL sender; remove a folder outside the run's scratch folder. In the scratch
        folder the files stay until the runner removes it after every process has exited, so a
        consumer still reading the last version's record finds its file."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.folder is not None and not run_owned(self.folder):
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None


@torch.no_grad()
def policy_probe(model: PolicyModel, token_ids: list[int], atol: float | None = None) -> Probe:
    """The trainer's probe logprobs at temperature 1 (step 1 of molt.refit's probe).

    ``model`` is a molt.train.model.PolicyModel (FSDP2-sharded or not): its forward
    maps ``input_ids, position_ids`` [1, P] to the logprob [P] of each token given
    those before it, at ``model.temperature``, which is set to 1 for this call.
    With FSDP2 this is a collective: every rank must call it, in the same order
    as its other collectives. Runs in eval mode and restores the mode after.
    ``atol`` None picks DEFAULT_ATOL by the dtype the forward computed in.

    On CPU the forward runs on one intra-op thread: P tokens gain little from
    threads, and while other processes (the engine) hold the cores, two spinning
    OpenMP threads took 1-6 s here where one thread took 0.35 s.
    """
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
                    probe: Callable[[], Probe | None], lora: LoraConfig, exclude: str | None = None) -> dict[str, Any]:
    """Write the adapters ``state`` (molt.train.lora.adapter_state) as a peft folder ``folder`` atomically
    (``.tmp``, then a rename; ``exclude``: molt.train.lora.peft_config's) and return its `weight_record`:
    format "peft", uri the folder."""
    tmp = folder.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    record = publish_weights(state, tmp / ADAPTER_FILE, version, probe)
    write_adapter_config(tmp, lora, None, exclude=exclude)
    os.replace(tmp, folder)
    return {**record, "uri": f"file://{folder}", "format": "peft"}


def publish_weights(state: dict[str, torch.Tensor], path: Path, version: int,
                    probe: Probe | Callable[[], Probe | None] | None = None) -> dict[str, Any]:
    """Write ``state`` (HF names -> tensors) as one safetensors file at ``path``
    atomically (temp name, then rename) and return its `weight_record`.

    The digests are computed from the tensors in memory (what the trainer meant to
    send, not what reached the file), in a thread beside the write. ``probe`` may be
    a function computing the trainer's probe: it runs on the calling thread while the
    file is written (its forward overlaps the write: 0.43-0.52 s -> 0.26-0.39 s for the
    default model here).
    """
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    with ThreadPoolExecutor(2, thread_name_prefix="molt-publish") as pool:
        digesting = pool.submit(state_digests, state)
        writing = pool.submit(save_file, state, str(tmp), {"format": "pt", "policy_version": str(version)})
        probe = probe() if callable(probe) else probe
        writing.result()
        os.replace(tmp, path)
        digests = digesting.result()
    return weight_record(state, version, f"file://{path}", digests, probe)
