"""NCCL refits through vLLM's weight-transfer API: the engine's end (the trainer's:
molt.train.nccl_send). Not yet run on a GPU; tests/test_gpu_refit.py runs it on CPU with a
file-backed backend. The weight-version record is the control plane:

    trainer (rank 0 = NCCL rank 0)             engine (rollout stage, VLLMEngine)
    1) record (digests, probe, uri, dtypes, shapes) on `weights`
                                               2) probe before; pause
    3) NCCLSender.send: trainer_init, then     3) TransferReceiver.receive: init (once), watch,
       send_weights (packed broadcast) <-->       start, update_weights, finish, unwatch
                                               4) relabel, clear prefix cache, resume; verify

vLLM hands the received tensors to ``model.load_weights``, which `MoltTransferWorkerExtension`
shadows with a wrapper digesting each tensor as consumed: the shm path's per-tensor check.
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
    """Joins the trainer's group on the first record (its first worker at NCCL rank
    ``rank_offset``), then takes each version."""

    def __init__(self, rank_offset: int = 1, workers_per_engine: int = 1,
                 digest: bool = True) -> None:
        self.rank_offset = rank_offset
        self.workers_per_engine = workers_per_engine
        self.digest = digest
        self.joined = False

    def init_info(self, record: dict[str, Any]) -> dict[str, Any]:  # a test backend overrides
        return worker_init_info(record["uri"], self.rank_offset, self.workers_per_engine)

    def update_info(self, record: dict[str, Any]) -> dict[str, Any]:
        return update_info(record)

    async def receive(self, llm: AsyncLLM, record: dict[str, Any]) -> list[dict[str, Any]]:
        """Step 2 of `VLLMEngine._refit`: each worker's {"digests", "seconds"}. ValueError for a
        malformed record (nothing touched); vLLM's error for a failed transfer."""
        from vllm.distributed.weight_transfer.base import (WeightTransferInitRequest,
                                                           WeightTransferUpdateRequest)

        info = self.update_info(record)
        if not self.joined:
            init = WeightTransferInitRequest(init_info=self.init_info(record))
            await llm.init_weight_transfer_engine(init)
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
    """vLLM's backend ("nccl"), the receiver, and the worker extension (a test backend's own
    MoltTransferWorkerExtension, so that vLLM's workers import and register it)."""

    backend: str
    receiver: TransferReceiver
    worker_extension: str = TRANSFER_WORKER_EXTENSION


def watching_loader(load: Callable[[Weights], Any], digests: dict[str, str],
                    digest: bool) -> Callable[[Weights], Any]:
    """``load`` recording ``digests[name]`` ("" without ``digest``) as it pulls each tensor."""
    def record(weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            digests[name] = tensor_digest(tensor) if digest else ""
            yield name, tensor

    def load_weights(weights: Weights) -> Any:
        return load(record(weights))

    return load_weights


class MoltTransferWorkerExtension(MoltWorkerExtension):
    """Mixed into vLLM's worker class; `self` is the worker."""

    def molt_watch_weights(self, digest: bool = True) -> None:
        """Record what the model's loader consumes until `molt_unwatch_weights`."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError("vLLM was started without weight_transfer_config; hint: start the "
                               "engine with the rollout's engine.transport set to the trainer's "
                               "publish transport type")
        model: nn.Module = engine.model
        consumed: dict[str, str] = {}
        self._molt_watch = (model, consumed, digest, time.perf_counter())
        loader = watching_loader(getattr(model, "load_weights"), consumed, digest)
        setattr(model, "load_weights", loader)

    def molt_unwatch_weights(self) -> dict[str, object]:
        """Stop recording; repack tied layers; {"digests" ({} without digest), "seconds"}."""
        model, consumed, digest, start = self._molt_watch
        model.__dict__.pop("load_weights", None)  # the class's load_weights again
        repack_tied_layers(model, set(consumed))
        seconds = time.perf_counter() - start
        logger.info("molt: received %d tensors through the weight-transfer API in %.2f s",
                    len(consumed), seconds)
        return {"digests": consumed if digest else {}, "seconds": seconds}
