"""How refit weights travel from the trainer to the engines: ``transport: {type: ...}``.

``shm`` (default): a safetensors file in shared memory + vLLM's ``reload_weights``.
``nccl``: vLLM 0.32's weight-transfer API (molt.engines.nccl_transfer), the trainer's
rank 0 broadcasting to every engine worker; CUDA only, one GPU per NCCL rank.
``ipc``: CUDA IPC for an engine on the trainer's GPU; refused for now (`check_transport`).

For ``nccl`` the weight-version record is the control plane: ``format`` "nccl", a ``uri``
with the rendezvous and wire parameters, and ``tensor_dtypes``/``tensor_shapes`` beside
``tensor_names`` to size the receive buffers. Example: 2 rollout replicas of 1 worker,
``{type: nccl, num_engine_workers: 2}``: the uri is ``nccl://127.0.0.1:29551?world_size=3&
packed=1&buffer_bytes=1073741824&num_buffers=2``, the trainer NCCL rank 0, replica 0's
worker rank 1, replica 1's rank 2. Pure: no vLLM or CUDA needed.
"""

from __future__ import annotations

import logging
import socket
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, urlsplit

import torch
from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)


class ShmTransport(BaseModel):
    """Safetensors in a shared-memory folder + vLLM's reload_weights (the default)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["shm"] = "shm"


class NCCLTransport(BaseModel):
    """NCCL broadcast from the trainer's rank 0 to every engine worker; an engine needs only ``type``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["nccl"]
    master_address: str = Field("127.0.0.1", description="address of the trainer's rank 0 (rendezvous TCPStore); "
                                "'auto': its host's address on the default route, for engines on other hosts")
    master_port: int = Field(29551, ge=1024, le=65535, description="free TCP port; one per run on a host")
    num_engine_workers: int = Field(1, ge=1, description="workers of all rollout replicas (replicas x TP x PP x DP)")
    packed: bool = Field(True, description="pack tensors into fixed-size chunks (vLLM's default for trainers)")
    buffer_mib: int = Field(1024, ge=1, description="packed chunk size (MiB), as vLLM's 1 GiB default")
    num_buffers: int = Field(2, ge=1, description="packed chunks in flight (double buffering)")
    timeout_s: float = Field(600.0, gt=0, description="longest wait for the engines to take one version (s)")


class IPCTransport(BaseModel):
    """CUDA IPC handles for an engine on the trainer's GPU (vLLM's ``ipc`` backend); not wired yet."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["ipc"]


AnyTransport = ShmTransport | NCCLTransport | IPCTransport
TransportConfig = Annotated[AnyTransport, Field(discriminator="type")]


def check_transport(transport: AnyTransport, where: str, cuda_available: bool | None = None) -> None:
    """Refuse (ValueError naming ``{where}.type``, ``where`` being the YAML path of the transport)
    ``nccl``/``ipc`` without CUDA (default: ``torch.cuda.is_available()``), and ``ipc`` (not wired)."""
    if transport.type == "shm":
        return
    if not (torch.cuda.is_available() if cuda_available is None else cuda_available):
        raise ValueError(f"{where}.type: {transport.type!r} needs CUDA GPUs; got none in this process "
                         f"(torch {torch.__version__}); hint: use {{type: shm}} on CPU")
    if transport.type == "ipc":
        raise ValueError(f"{where}.type: 'ipc' is not wired yet: CUDA IPC needs the engine to confirm each "
                         "update before the trainer frees its buffers, and the weight edge is one-way; "
                         "hint: use {type: nccl} (engines on other GPUs) or {type: shm}")


def engine_backend(transport: AnyTransport, where: str) -> str | None:
    """vLLM's ``weight_transfer_config.backend`` for an engine (None for ``shm``); warns about
    fields set on the engine side, where the record's uri wins."""
    if transport.type == "shm":
        return None
    ignored = sorted(transport.model_fields_set - {"type"})
    if ignored:
        logger.warning("%s: %s ignored on the engine side (the record's uri wins)", where, ", ".join(ignored))
    return transport.type


def master_address(transport: NCCLTransport) -> str:
    """``master_address``, with 'auto' resolved to this host's address on its default route (the
    source address of a UDP socket connected towards a private address: no packet is sent),
    loopback on a host without one."""
    if transport.master_address != "auto":
        return transport.master_address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def transfer_uri(transport: NCCLTransport) -> str:
    """The record's ``uri``: rendezvous and wire parameters (module docstring)."""
    return (f"nccl://{master_address(transport)}:{transport.master_port}?world_size={transport.num_engine_workers + 1}"
            f"&packed={int(transport.packed)}&buffer_bytes={transport.buffer_mib * 2**20}"
            f"&num_buffers={transport.num_buffers}")


def tensor_layout(state: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    """The record's ``tensor_dtypes`` [N] (vLLM's names) and ``tensor_shapes`` [N][rank], in ``state``
    order. Example: {"w": zeros(2, 3), "b": zeros(3, dtype=bfloat16)} ->
    {"tensor_dtypes": ["float32", "bfloat16"], "tensor_shapes": [[2, 3], [3]]}."""
    return {"tensor_dtypes": [str(t.dtype).split(".")[-1] for t in state.values()],
            "tensor_shapes": [list(t.shape) for t in state.values()]}


def update_info(record: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``NCCLWeightTransferUpdateInfo`` fields (names, dtype_names, shapes [N]) from a
    record; ValueError if its per-tensor lists differ in length."""
    names, dtypes, shapes = record["tensor_names"], record["tensor_dtypes"], record["tensor_shapes"]
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"weight record v{record['policy_version']}: tensor_names, tensor_dtypes and "
                         f"tensor_shapes differ in length; got {len(names)}, {len(dtypes)}, {len(shapes)}")
    return {"names": list(names), "dtype_names": list(dtypes), "shapes": [list(s) for s in shapes]}


def worker_init_info(uri: str, rank_offset: int, workers_per_engine: int) -> dict[str, Any]:
    """vLLM's ``NCCLWeightTransferInitInfo`` fields, from a record's ``uri``, for the engine whose
    first worker is NCCL rank ``rank_offset``. ValueError for a uri not ``nccl://host:port?...``
    or ranks that do not fit the group (naming the knob to raise)."""
    parts = urlsplit(uri)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if parts.scheme != "nccl" or parts.hostname is None or parts.port is None or "world_size" not in query:
        raise ValueError(f"weight record uri must be nccl://host:port?world_size=N&...; got {uri!r}")
    world_size = int(query["world_size"])
    if rank_offset < 1 or rank_offset + workers_per_engine > world_size:
        raise ValueError(f"engine workers at NCCL ranks {rank_offset}..{rank_offset + workers_per_engine - 1} do "
                         f"not fit a group of {world_size} (rank 0 = trainer); hint: set "
                         "stages.<broadcast>.config.transport.num_engine_workers to the rollout's total workers")
    return {"master_address": parts.hostname, "master_port": parts.port, "rank_offset": rank_offset,
            "world_size": world_size, "packed": query.get("packed", "0") == "1",
            "packed_buffer_size_bytes": int(query.get("buffer_bytes", 2**30)),
            "packed_num_buffers": int(query.get("num_buffers", 2))}


def rank_offset(replica: int, workers_per_engine: int) -> int:
    """NCCL rank of rollout replica ``replica``'s first worker; e.g. 2 workers each: 1, 3, 5, ..."""
    return 1 + replica * workers_per_engine  # the trainer is rank 0


def check_covers(expected: set[str], record: dict[str, Any]) -> None:
    """Refuse (ValueError) a record lacking tensors of the engine's checkpoint (vLLM only warns)."""
    missing = sorted(expected - set(record["tensor_names"]))
    if missing:
        raise ValueError(f"weight record v{record['policy_version']} lacks {len(missing)} tensors of the model, "
                         f"e.g. {missing[:3]}; hint: export the full state dict")
