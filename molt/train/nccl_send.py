"""The trainer's end of an NCCL refit (the engine's: molt.engines.nccl_transfer): rank 0
broadcasts the state dict to the engine workers through vLLM's weight-transfer engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from molt.refit import NCCLTransport, master_address, tensor_layout, transfer_uri

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine


class StateDictSource(WeightSource):
    """vLLM ``WeightSource`` over rank 0's full state dict, moved to ``device`` as sent."""

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

    init_weight_transfer_engine = start_weight_update = update_weights = finish_weight_update = (
        staticmethod(lambda *args, **kwargs: None))


class NCCLSender:
    """The trainer's end, on train rank 0 (``device``: by default the current CUDA device)."""

    def __init__(self, transport: NCCLTransport, device: torch.device | None = None) -> None:
        self.transport = transport
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.source = StateDictSource(self.device)
        self._engine: TrainerWeightTransferEngine | None = None

    def record_fields(self, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The record's ``format``, ``uri``, ``tensor_dtypes`` and ``tensor_shapes``."""
        return {"format": "nccl", "uri": transfer_uri(self.transport), **tensor_layout(state)}

    def send(self, state: dict[str, torch.Tensor]) -> None:
        """Broadcast ``state`` to every engine worker after its record went out; blocks.

        Raises:
            RuntimeError: the engines did not take it within ``timeout_s``, or the send failed.
        """
        self.source.state = state
        errors: list[BaseException] = []

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
            raise RuntimeError(f"NCCL weight transfer not taken within "
                               f"{self.transport.timeout_s:g} s; the engines did not join "
                               f"({transfer_uri(self.transport)}); hint: "
                               "check that every rollout replica has engine.transport {type: nccl} "
                               "and is still reading weights, and that num_engine_workers is the "
                               "rollout's replicas x tensor_parallel_size")
        if errors:
            raise RuntimeError(f"NCCL weight transfer failed on the trainer: "
                               f"{errors[0]!r}") from errors[0]

    def _open(self) -> TrainerWeightTransferEngine:
        """vLLM's trainer engine: rendezvous with every engine worker (blocks until they join)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        t = self.transport
        info = NCCLTrainerInitInfo(master_address(t), t.master_port,
                                   world_size=t.num_engine_workers + 1, rank=0, packed=t.packed,
                                   packed_buffer_size_bytes=t.buffer_mib * 2**20,
                                   packed_num_buffers=t.num_buffers)
        return WeightTransferTrainerFactory.trainer_init(info, client=RecordDrivenClient(),
                                                         source=self.source)

    def close(self) -> None:
        """Destroy the NCCL group; idempotent."""
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.shutdown()
