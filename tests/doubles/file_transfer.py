"""A file-backed vLLM weight-transfer backend for CPU tests (never used by a shipped pipeline).

It runs vLLM 0.32's whole weight-transfer lifecycle on the CPU build —
``AsyncLLM.init_weight_transfer_engine``, ``start_weight_update`` (layerwise reload),
``update_weights``, ``finish_weight_update`` — with the bytes read from a safetensors
file instead of an NCCL broadcast. Like ``NCCLWeightTransferEngine.receive_weights``
it sizes each tensor from the update info and hands the model's ``load_weights`` a
list of (name, tensor). Importing this module in vLLM's worker (it is the
``worker_extension_cls``) registers the backend ``molt_test_file`` there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from molt.engines.nccl_transfer import MoltTransferWorkerExtension, TransferReceiver

BACKEND = "molt_test_file"
EXTENSION = "tests.doubles.file_transfer.FileTransferWorkerExtension"


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    path: str


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """Checkpoint-format updates read from a file, in NCCL's start/update/finish lifecycle."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class also synchronizes an accelerator, which the CPU build lacks
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: FileUpdateInfo) -> None:
        weights = []
        with safe_open(info.path, framework="pt") as handle:
            for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
                tensor = handle.get_tensor(name)
                if tensor.dtype != getattr(torch, dtype_name) or list(tensor.shape) != shape:
                    raise ValueError(f"{name}: update info says {dtype_name} {shape}, the file "
                                     f"{tensor.dtype} {list(tensor.shape)}")
                weights.append((name, tensor))
        self.model.load_weights(weights)

    def shutdown(self) -> None:
        pass


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, FileWeightTransferEngine)


class FileTransferWorkerExtension(MoltTransferWorkerExtension):
    """Molt's transfer worker extension; naming it makes vLLM's worker import this module."""


class FileReceiver(TransferReceiver):
    """TransferReceiver for records whose ``uri`` is a safetensors file (no rendezvous)."""

    def init_info(self, record: dict[str, Any]) -> dict[str, Any]:
        return {}

    def update_info(self, record: dict[str, Any]) -> dict[str, Any]:
        return {**super().update_info(record), "path": record["uri"].removeprefix("file://")}
