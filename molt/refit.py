"""What trainer (molt.train.publish) and engine (molt.engines.refit) share of a refit: the
record (`weight_record`); the transport, ``shm`` (a safetensors file in shared memory) or
``nccl`` (vLLM's weight-transfer API: the trainer, NCCL rank 0, broadcasts to the engine
workers, ranks 1.., the record's uri naming the group); tensor digests, which must be equal
(`verify_refit`); and the probe.

**The probe**: after a refit the engine must compute what the trainer computes. Digests prove
that the engine's loader consumed exactly the published bytes; they cannot prove that the engine
then computes with them: a reload that leaves a repacked kernel stale, corrupts a MoE layout
(notes/vllm-cpu.md), or maps a tensor to the wrong parameter passes the digests.
The probe checks the function itself, on P fixed tokens x[0..P-1]:

1) at publication the trainer scores the probe with its own model at temperature 1
   (raw logprobs, no temperature or other processing):
       lp_train[t] = log_softmax(f(x[:t]))[x[t]],   t = 1..P-1        # [P-1]
   For an FSDP2 model this forward is a collective: every train rank runs it.
   The record carries x (``probe_token_ids``), lp_train (``probe_logprobs``) and
   the tolerance (``probe_atol``).
2) after loading, the engine scores the same tokens (`Engine.prompt_logprobs`,
   the same formula): lp_engine [P-1].
3) match: max_t |lp_engine[t] - lp_train[t]| <= atol.
4) change: lp_engine must differ from the engine's probe before the load (at any
   position, bit for bit), unless the new weights' digests equal those of the
   weights it held before (identical weights give identical logprobs). This
   catches a refit that did not reach the model when the step moved the
   trainer's probe by less than atol.
A failure raises RuntimeError with the version, the largest difference and its
position; the rollout stage then fails and the run stops.

Tolerance (``policy.weights.probe_atol``, `PublishConfig`; by default from the dtype the
trainer's forward computed in): the fp32 vLLM engine against the fp32 trainer
differs by at most 2e-5 to 6e-5 on the 32 probe tokens here, so fp32 gets 1e-3;
after one step at lr 1e-4 an engine whose tied lm_head stayed stale differed by
0.04. A bf16 trainer forward differs from the fp32 engine by up to 0.6 (mean 0.08),
so bf16 gets 1.0: the match then catches only gross corruption, and step 4 (exact)
is what catches a refit that did not take.

Worked example (x = [5, 7, 9, 11], atol = 1e-3): trainer [-10.20, -9.80, -11.00];
an engine at [-10.2001, -9.7998, -11.0002] after the load matches (max diff 2e-4);
one at [-10.20, -9.70, -11.00] fails: "differ by 0.1 at position 2 (token id 9;
tolerance 0.001)".
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, urlsplit

import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)


class ShmTransport(BaseModel):
    """Safetensors in a shared-memory folder + vLLM's reload_weights (the default)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["shm"] = "shm"


class NCCLTransport(BaseModel):
    """NCCL broadcast from the trainer's rank 0; an engine's config needs only ``type``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["nccl"]
    master_address: str = Field(
        "127.0.0.1", description="the trainer's rank 0 (rendezvous); 'auto': its host's address "
        "on the default route, for engines on other hosts")
    master_port: int = Field(29551, ge=1024, le=65535, description="free TCP port, one per run")
    num_engine_workers: int = Field(1, ge=1, description="workers of all rollout replicas "
                                    "(replicas x TP x PP x DP)")
    packed: bool = Field(True, description="pack tensors into fixed-size chunks")
    buffer_mib: int = Field(1024, ge=1, description="packed chunk size (MiB)")
    num_buffers: int = Field(2, ge=1, description="packed chunks in flight")
    timeout_s: float = Field(600.0, gt=0, description="longest wait for the engines (s)")


class IPCTransport(BaseModel):
    """CUDA IPC for an engine on the trainer's GPU; not wired yet."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["ipc"]


AnyTransport = ShmTransport | NCCLTransport | IPCTransport
TransportConfig = Annotated[AnyTransport, Field(discriminator="type")]


class PublishConfig(BaseModel):
    """How the trainer publishes its weights on one output (``policy.weights``)."""

    model_config = ConfigDict(extra="forbid")
    every_steps: int = Field(1, ge=1, description="publish when policy_version % k == 0")
    dir: str | None = Field(
        None, description="folder of the weight files; None: the run's scratch folder in shared "
        "memory, which outlives the trainer")
    keep_versions: int = Field(2, ge=1, description="newest weight files kept")
    probe_tokens: int = Field(32, ge=0, description="length P of the refit probe; < 2 = none")
    probe_atol: float | None = Field(
        None, gt=0, description="largest |engine - trainer| probe logprob accepted (nats); None: "
        "1e-3 for an fp32 trainer forward, else 1.0")
    transport: TransportConfig = Field(default_factory=ShmTransport, description="shm or nccl")


def check_transport(transport: AnyTransport, where: str,
                    cuda_available: bool | None = None) -> None:
    """Raises ValueError naming ``{where}.type`` for ``nccl`` without CUDA and for ``ipc``."""
    if transport.type == "shm":
        return
    if not (torch.cuda.is_available() if cuda_available is None else cuda_available):
        raise ValueError(f"{where}.type: {transport.type!r} needs CUDA GPUs; got none in this "
                         f"process (torch {torch.__version__}); hint: use {{type: shm}} on CPU")
    if transport.type == "ipc":
        raise ValueError(f"{where}.type: 'ipc' is not wired yet: CUDA IPC needs the engine to "
                         "confirm each update before the trainer frees its buffers, and the "
                         "weight edge is one-way; hint: use {type: nccl} (engines on other "
                         "GPUs) or {type: shm}")


def engine_backend(transport: AnyTransport, where: str) -> str | None:
    """vLLM's ``weight_transfer_config.backend``."""
    if transport.type == "shm":
        return None
    if ignored := sorted(transport.model_fields_set - {"type"}):
        logger.warning("%s: %s ignored on the engine side (the record's uri wins)", where,
                       ", ".join(ignored))
    return transport.type


def master_address(transport: NCCLTransport) -> str:
    """``master_address``, 'auto' resolved to the host's address on its default route."""
    if transport.master_address != "auto":
        return transport.master_address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # connecting a UDP socket sends no packet; it picks the source address
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def transfer_uri(transport: NCCLTransport) -> str:
    return (f"nccl://{master_address(transport)}:{transport.master_port}"
            f"?world_size={transport.num_engine_workers + 1}&packed={int(transport.packed)}"
            f"&buffer_bytes={transport.buffer_mib * 2**20}&num_buffers={transport.num_buffers}")


def tensor_layout(state: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    """The record's ``tensor_dtypes`` [N] ("bfloat16", ...) and ``tensor_shapes`` [N][rank]."""
    return {"tensor_dtypes": [str(t.dtype).split(".")[-1] for t in state.values()],
            "tensor_shapes": [list(t.shape) for t in state.values()]}


def update_info(record: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``NCCLWeightTransferUpdateInfo``; ValueError for lists of unequal length."""
    names, dtypes, shapes = record["tensor_names"], record["tensor_dtypes"], record["tensor_shapes"]
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"weight record v{record['policy_version']}: tensor_names, tensor_dtypes "
                         f"and tensor_shapes differ in length; got {len(names)}, {len(dtypes)}, "
                         f"{len(shapes)}")
    return {"names": list(names), "dtype_names": list(dtypes), "shapes": [list(s) for s in shapes]}


def worker_init_info(uri: str, rank_offset: int, workers_per_engine: int) -> dict[str, Any]:
    """vLLM's ``NCCLWeightTransferInitInfo`` for an engine whose first worker is NCCL rank
    ``rank_offset``; ValueError for a bad uri or ranks outside the group."""
    parts = urlsplit(uri)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if (parts.scheme != "nccl" or parts.hostname is None or parts.port is None
            or "world_size" not in query):
        raise ValueError("weight record uri must be nccl://host:port?world_size=N&...; "
                         f"got {uri!r}")
    world_size = int(query["world_size"])
    if rank_offset < 1 or rank_offset + workers_per_engine > world_size:
        raise ValueError(f"engine workers at NCCL ranks {rank_offset}.."
                         f"{rank_offset + workers_per_engine - 1} do not fit a group of "
                         f"{world_size} (rank 0 = trainer); hint: set "
                         "policy.weights.transport.num_engine_workers to the rollout's "
                         "total workers")
    return {"master_address": parts.hostname, "master_port": parts.port, "rank_offset": rank_offset,
            "world_size": world_size, "packed": query.get("packed", "0") == "1",
            "packed_buffer_size_bytes": int(query.get("buffer_bytes", 2**30)),
            "packed_num_buffers": int(query.get("num_buffers", 2))}


def rank_offset(replica: int, workers_per_engine: int) -> int:
    return 1 + replica * workers_per_engine  # of its first worker; rank 0 is the trainer


def check_covers(expected: set[str], record: dict[str, Any]) -> None:
    """ValueError for a record lacking tensors of the engine's model (vLLM only warns)."""
    if missing := sorted(expected - set(record["tensor_names"])):
        raise ValueError(f"weight record v{record['policy_version']} lacks {len(missing)} tensors "
                         f"of the model, e.g. {missing[:3]}; hint: export the full state dict")


ADAPTER_FILE = "adapter_model.safetensors"  # a peft adapter folder's tensors
PEFT_PREFIX = "base_model.model."  # how peft's files name the model's modules


def merge_adapter(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  scaling: float) -> torch.Tensor:
    """W + scaling * B @ A in fp32, W [out, in], A [rank, in], B [out, rank] (LoRA, Hu et
    al. 2021, arXiv:2106.09685)."""
    return (weight.float() + scaling * (lora_b.float() @ lora_a.float())).to(weight.dtype)


def tensor_digest(tensor: torch.Tensor) -> str:
    """32 hex digits of XXH3-128 (not cryptographic; it releases the GIL) over dtype, shape
    and raw bytes."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    hasher = xxhash.xxh3_128()
    hasher.update(f"{flat.dtype}|{tuple(tensor.shape)}|".encode())
    hasher.update(flat.view(torch.uint8).numpy().data)
    return hasher.hexdigest()


def state_digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_digest(tensor) for name, tensor in state.items()}


def verify_refit(version: int, sent: dict[str, str], loaded: dict[str, str]) -> None:
    """RuntimeError naming the tensors (name -> digest) ``loaded`` lacks or has other than
    ``sent``."""
    if bad := sorted(n for n, d in sent.items() if loaded.get(n) != d):
        raise RuntimeError(f"refit to version {version} is not verified: {len(bad)} tensor(s) "
                           f"differ or were not loaded, e.g. {bad[:5]}")


PROBE_SEED = 20240601  # the probe tokens are the same for every version and run
DEFAULT_ATOL = {torch.float32: 1e-3}  # by the trainer forward's dtype; others: LOW_PRECISION_ATOL
LOW_PRECISION_ATOL = 1.0


@dataclasses.dataclass(frozen=True)
class Probe:
    """Token ids [P], the trainer's logprobs [P-1] and the accepted difference."""

    token_ids: list[int]
    logprobs: list[float]
    atol: float


def probe_token_ids(vocab_size: int, num_tokens: int = 32) -> list[int]:
    """P pseudo-random token ids in [0, vocab_size), the same on every run: they need no
    tokenizer and reach embedding rows that text rarely does."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()


def check_probe(version: int, probe: Probe, engine_logprobs: list[float]) -> float:
    """Step 3: the largest |engine - trainer| probe logprob difference; RuntimeError naming
    it and its position when over ``probe.atol``."""
    if len(engine_logprobs) != len(probe.logprobs):
        raise RuntimeError(f"refit to version {version} failed the probe: the engine returned "
                           f"{len(engine_logprobs)} logprobs for {len(probe.logprobs)} probe "
                           "positions")
    diffs = (torch.tensor(engine_logprobs, dtype=torch.float64)
             - torch.tensor(probe.logprobs, dtype=torch.float64)).abs()  # [P-1]
    diffs = torch.where(diffs.isnan(), torch.inf, diffs)  # a NaN fails too
    if (largest := float(diffs.max()) if diffs.numel() else 0.0) <= probe.atol:
        return largest
    position = int(diffs.argmax()) + 1  # of the scored token in the probe sequence
    raise RuntimeError(
        f"refit to version {version} failed the probe: engine and trainer logprobs differ by "
        f"{largest:.3g} at position {position} (token id {probe.token_ids[position]}; "
        f"tolerance {probe.atol:g}): the engine does not compute what the trainer exported; "
        "hint: a reload that corrupts or skips weights, or a bf16 side (raise "
        "policy.weights.probe_atol)")


def check_probe_changed(version: int, before: list[float], after: list[float],
                        same_weights: bool) -> None:
    """Step 4: RuntimeError if ``after == before`` unless ``same_weights``."""
    if after == before and not same_weights:
        raise RuntimeError(
            f"refit to version {version} failed the probe: the engine's probe logprobs did not "
            "change although the weights' digests did; the engine still computes with the "
            "previous weights")


def weight_record(state: dict[str, torch.Tensor], version: int, uri: str, digests: dict[str, str],
                  probe: Probe | None = None, format: str = "safetensors") -> dict[str, Any]:
    """The record announcing ``state`` (HF names -> tensors) as ``version`` at ``uri``."""
    assert list(digests) == list(state), "one digest per tensor, in state order"
    return {"policy_version": version, "uri": uri, "format": format,
            "num_bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "tensor_names": list(digests), "tensor_digests": list(digests.values()),
            **tensor_layout(state),
            "probe_token_ids": probe.token_ids if probe else [],
            "probe_logprobs": probe.logprobs if probe else [],
            "probe_atol": probe.atol if probe else None, "created_unix_s": time.time()}


def record_probe(record: dict[str, Any]) -> Probe | None:
    if not (token_ids := record.get("probe_token_ids") or []):
        return None
    return Probe(list(token_ids), list(record["probe_logprobs"]), float(record["probe_atol"]))
