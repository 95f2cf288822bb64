"""NCCL refits through vLLM 0.32's weight-transfer API: trainer sender, engine receiver, worker hooks.

Unverified: not yet run on a GPU; written against the installed vLLM 0.32 source
(``vllm/distributed/weight_transfer/``, ``AsyncLLM``) and its docs page
(https://docs.vllm.ai/en/v0.32.0/training/weight_transfer/). The engine side runs on
CPU with a file-backed test backend through the same calls (tests/test_gpu_refit.py).

The weight-version record is the control plane (molt.refit); NCCL's
collectives make both sides meet. Version v, trainer rank 0 = NCCL rank 0:

    trainer (train stage, rank 0)              engine (rollout stage, VLLMEngine)
    1) state dict; record (digests, probe, uri, tensor_dtypes/shapes) on `weights`
                                               2) probe before; pause (mode "keep")
    3) NCCLSender.send: first vLLM's           3) TransferReceiver.receive: first
       trainer_init (rendezvous), then            init_weight_transfer_engine, then watch,
       send_weights (packed broadcast) <-->       start, update_weights, finish, unwatch
                                               4) relabel, clear prefix cache, resume; verify

vLLM's trainer drives the engines through a client; here each engine acts on the
record at its own rank offset (vLLM's trainer ships ``rank_offset=1`` to one client),
so the client does nothing. A version no engine takes blocks the trainer in NCCL:
`NCCLSender.send` raises after ``timeout_s``; the group is unusable after that.

Verification: the backends hand the received tensors to ``self.model.load_weights``,
looked up at each call (NCCL packed: ``post_unpack_func`` with (name, tensor) views of
the receive buffer; unpacked and IPC alike). `MoltTransferWorkerExtension` shadows it
on the model instance with a wrapper that digests each tensor as the loader consumes
it (a host copy on the receive stream, then XXH3, before the buffer is reused): the
shm path's per-tensor check, for a device-to-host copy and ~0.1 s/GB of hashing. Tied
layers that received nothing are processed again, as in molt.engines.vllm_worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from molt.engines.vllm_worker import MoltWorkerExtension, tied_unloaded_layers
from molt.refit import (NCCLTransport, master_address, tensor_digest, tensor_layout, transfer_uri, update_info,
                        worker_init_info)

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)
TRANSFER_WORKER_EXTENSION = "molt.engines.nccl_transfer.MoltTransferWorkerExtension"
Weights = Iterable[tuple[str, torch.Tensor]]


class StateDictSource(WeightSource):
    """vLLM ``WeightSource`` over rank 0's full HF-named state dict, moved to ``device`` as sent."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.state: dict[str, torch.Tensor] = {}

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.state.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.state.items():
            yield name, tensor.to(self.device)


class RecordDrivenClient:
    """A ``VLLMWeightSyncClient`` whose four calls do nothing: the engines act on the record."""

    init_weight_transfer_engine = start_weight_update = update_weights = finish_weight_update = staticmethod(
        lambda *args, **kwargs: None)


class NCCLSender:
    """The trainer's end (train rank 0, molt.train.publish). Unverified on a GPU. ``device``
    defaults to the current CUDA device, read here: the send runs on a thread that starts on 0."""

    def __init__(self, transport: NCCLTransport, device: torch.device | None = None) -> None:
        self.transport = transport
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.source = StateDictSource(self.device)
        self._engine: TrainerWeightTransferEngine | None = None
        self.last_send_seconds = 0.0

    def record_fields(self, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The record's ``format``, ``uri``, ``tensor_dtypes`` and ``tensor_shapes`` for ``state``."""
        return {"format": "nccl", "uri": transfer_uri(self.transport), **tensor_layout(state)}

    def send(self, state: dict[str, torch.Tensor]) -> None:
        """Broadcast ``state`` to every engine worker after its record went out; blocks (use
        ``asyncio.to_thread`` in a stage loop). RuntimeError if the engines did not take it within
        ``timeout_s`` (the NCCL group is then stuck) or vLLM's send failed (its error chained)."""
        self.source.state = state
        errors: list[BaseException] = []
        start = time.perf_counter()

        def work() -> None:
            try:
                if self.device.type == "cuda":  # a thread starts on device 0
                    torch.cuda.set_device(self.device)
                if self._engine is None:
                    self._engine = self._open()
                self._engine.send_weights()
            except BaseException as error:  # carried to the caller below
                errors.append(error)

        thread = threading.Thread(target=work, name="molt-nccl-send", daemon=True)
        thread.start()
        thread.join(self.transport.timeout_s)
        if thread.is_alive():
            raise RuntimeError(f"NCCL weight transfer not taken within {self.transport.timeout_s:g} s; the "
                               f"engines did not join ({transfer_uri(self.transport)}); hint: check that every "
                               "rollout replica has engine.transport {type: nccl} and is still reading weights, and "
                               "that num_engine_workers is the rollout's replicas x tensor_parallel_size")
        if errors:
            raise RuntimeError(f"NCCL weight transfer failed on the trainer: {errors[0]!r}") from errors[0]
        self.last_send_seconds = time.perf_counter() - start

    def _open(self) -> TrainerWeightTransferEngine:
        """vLLM's trainer engine: rendezvous with every engine worker (blocks until they join)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        t = self.transport
        info = NCCLTrainerInitInfo(master_address(t), t.master_port, world_size=t.num_engine_workers + 1, rank=0,
                                   packed=t.packed, packed_buffer_size_bytes=t.buffer_mib * 2**20,
                                   packed_num_buffers=t.num_buffers)
        return WeightTransferTrainerFactory.trainer_init(info, client=RecordDrivenClient(), source=self.source)

    def close(self) -> None:
        """Destroy the NCCL group; idempotent."""
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.shutdown()


class TransferReceiver:
    """The engine's end: joins the trainer's group on the first record (its first worker at NCCL
    rank ``rank_offset``, molt.refit.rank_offset), then takes each version;
    ``digest``: digest every received tensor (module docstring)."""

    def __init__(self, rank_offset: int = 1, workers_per_engine: int = 1, digest: bool = True) -> None:
        self.rank_offset = rank_offset
        self.workers_per_engine = workers_per_engine
        self.digest = digest
        self.joined = False

    def init_info(self, record: dict[str, Any]) -> dict[str, Any]:  # overridable, as update_info
        return worker_init_info(record["uri"], self.rank_offset, self.workers_per_engine)

    def update_info(self, record: dict[str, Any]) -> dict[str, Any]:
        return update_info(record)

    async def receive(self, llm: AsyncLLM, record: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one version into an engine the caller paused (and then relabels, clears the prefix
        cache of, resumes: VLLMEngine.load_weights' steps 1, 3, 4); each worker's {"digests", "seconds"}.
        Raises ValueError for a malformed record (nothing touched); vLLM's error for a failed
        transfer, after which the weights are undefined (a layerwise reload was under way)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

        info = self.update_info(record)
        # 1) join the group once  2) watch the loader  3) start, receive, finish  4) unwatch: digests
        if not self.joined:
            await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=self.init_info(record)))
            self.joined = True
        await llm.collective_rpc("molt_watch_weights", args=(self.digest,))
        try:
            await llm.start_weight_update()
            await llm.update_weights(WeightTransferUpdateRequest(update_info=info))
            await llm.finish_weight_update()
        finally:
            results = await llm.collective_rpc("molt_unwatch_weights")
        return results


@dataclass
class WeightTransfer:
    """How a VLLMEngine takes refits over vLLM's weight-transfer API: vLLM's
    ``weight_transfer_config.backend`` ("nccl"), the receiver that acts on each record, and
    the worker extension (it must subclass MoltTransferWorkerExtension; a test backend
    names its own so that vLLM's workers import and register it)."""

    backend: str
    receiver: TransferReceiver
    worker_extension: str = TRANSFER_WORKER_EXTENSION


def watching_loader(load: Callable[[Weights], Any], digests: dict[str, str],
                    digest: bool) -> Callable[[Weights], Any]:
    """Wrap a model's ``load_weights``: as the loader pulls each (name, tensor),
    ``digests[name] = tensor_digest(tensor)`` ("" when ``digest`` is false)."""
    def record(weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            digests[name] = tensor_digest(tensor) if digest else ""
            yield name, tensor

    def load_weights(weights: Weights) -> Any:
        return load(record(weights))

    return load_weights


class MoltTransferWorkerExtension(MoltWorkerExtension):
    """Mixed into vLLM's worker class; `self` is the worker (molt_load_weights included)."""

    def molt_watch_weights(self, digest: bool = True) -> None:
        """Record what the transfer target's loader consumes until `molt_unwatch_weights`;
        call before ``start_weight_update``. RuntimeError without ``weight_transfer_config``."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError("vLLM was started without weight_transfer_config; hint: start the engine "
                               "with the rollout's engine.transport set to the trainer's publish transport type")
        model: nn.Module = engine.model
        consumed: dict[str, str] = {}
        self._molt_watch = (model, consumed, digest, time.perf_counter())
        setattr(model, "load_weights", watching_loader(getattr(model, "load_weights"), consumed, digest))

    def molt_unwatch_weights(self) -> dict[str, object]:
        """Stop recording; repack tied layers; return {"digests": name -> tensor_digest of each
        tensor consumed ({} when watched with digest=False), "seconds": since the watch began}."""
        model, consumed, digest, start = self._molt_watch
        model.__dict__.pop("load_weights", None)  # the class's load_weights again
        for layer in tied_unloaded_layers(model, set(consumed)):
            layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr, operator]
        seconds = time.perf_counter() - start
        logger.info("molt: received %d tensors through the weight-transfer API in %.2f s", len(consumed), seconds)
        return {"digests": consumed if digest else {}, "seconds": seconds}
