"""NCCL refits through vLLM 0.32's weight-transfer API: the engine's receiver and worker hooks
(the trainer's sender: molt.train.nccl_send).

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
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from molt.engines.vllm_worker import MoltWorkerExtension, repack_tied_layers
from molt.refit import tensor_digest, update_info, worker_init_info

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)
TRANSFER_WORKER_EXTENSION = "molt.engines.nccl_transfer.MoltTransferWorkerExtension"
Weights = Iterable[tuple[str, torch.Tensor]]


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
        repack_tied_layers(model, set(consumed))
        seconds = time.perf_counter() - start
        logger.info("molt: received %d tensors through the weight-transfer API in %.2f s", len(consumed), seconds)
        return {"digests": consumed if digest else {}, "seconds": seconds}
