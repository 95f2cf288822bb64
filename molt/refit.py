"""A refit, both sides of it: how weights travel, what the record says, how it is verified.

Where a version is born: the trainer (molt.train.publish: after its optimizer step, on every
rank, it gathers the full state dict, scores the probe and, on rank 0, publishes). Where it is
checked: the engine (molt.engines.refit: load, digests, probe). What they share is here:

- **the record** (molt.schema.WEIGHT_VERSION_SCHEMA, one row per version, `weight_record`):
  ``policy_version``, where the weights are (``uri``, ``format``), every tensor's name, digest,
  dtype and shape, and the trainer's probe;
- **the transport** (``transport: {type: ...}``): ``shm`` (default), a safetensors file in shared
  memory + vLLM's ``reload_weights``; ``nccl``, vLLM 0.32's weight-transfer API
  (molt.train.nccl_send, molt.engines.nccl_transfer), the trainer's rank 0 broadcasting to every
  engine worker; CUDA only, one GPU per NCCL rank; ``ipc``, CUDA IPC for an engine on the
  trainer's GPU, refused for now (`check_transport`). For ``nccl`` the record is the control
  plane: ``format`` "nccl", a ``uri`` with the rendezvous and wire parameters, and
  ``tensor_dtypes``/``tensor_shapes`` beside ``tensor_names`` to size the receive buffers.
  Example: 2 rollout replicas of 1 worker, ``{type: nccl, num_engine_workers: 2}``: the uri is
  ``nccl://127.0.0.1:29551?world_size=3&packed=1&buffer_bytes=1073741824&num_buffers=2``, the
  trainer NCCL rank 0, replica 0's worker rank 1, replica 1's rank 2;
- **digests** (`tensor_digest`): the trainer digests every tensor from memory while it publishes;
  each engine digests every tensor as its loader consumes it; the two must be equal
  (`verify_refit`), so stale, missing or different bytes are named tensor by tensor. XXH3-128:
  about 0.07 s per 540 MB here, where BLAKE2b took 0.9 s on each side;
- **the probe**, below.

Cost per refit of the 135M default model (bench/refit.py, 2 cores): the write (0.25 s, with the
trainer's digests and probe forward beside it) and the engine's in-place reload (about 0.5 s, plus
0.1-0.15 s of engine-side digests) dominate; the engine's probe request takes 0.09 s.

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


class PublishConfig(BaseModel):
    """How the trainer publishes its weights on one output (molt.train.publish; policy.weights)."""

    model_config = ConfigDict(extra="forbid")
    every_steps: int = Field(1, ge=1, description="publish after every k-th step (policy_version % k == 0)")
    dir: str | None = Field(None, description="folder for the weight files; None: the run's scratch folder "
                            "in shared memory (molt.runtime.stage.scratch_folder), which outlives the trainer")
    keep_versions: int = Field(2, ge=1, description="newest weight files kept")
    probe_tokens: int = Field(32, ge=0, description="length P of the refit probe (below); < 2 = none")
    probe_atol: float | None = Field(None, gt=0, description="largest |engine - trainer| probe logprob "
                                     "accepted; None: 1e-3 for an fp32 trainer forward, 1.0 for bf16")
    transport: TransportConfig = Field(default_factory=ShmTransport, description="{type: shm}: a safetensors "
                                       "file in dir; {type: nccl}: vLLM's weight-transfer API (module docstring)")


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
                         "policy.weights.transport.num_engine_workers to the rollout's total workers")
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


ADAPTER_FILE = "adapter_model.safetensors"  # a peft adapter folder's tensors, beside adapter_config.json
PEFT_PREFIX = "base_model.model."  # how peft's files name the model's modules


def merge_adapter(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """A LoRA-adapted linear's merged weight (Hu et al. 2021, arXiv:2106.09685): ``weight`` [out, in] +
    ``scaling`` (alpha / rank) * ``lora_b`` [out, rank] @ ``lora_a`` [rank, in], computed in fp32 and cast
    back to ``weight``'s dtype."""
    return (weight.float() + scaling * (lora_b.float() @ lora_a.float())).to(weight.dtype)


def tensor_digest(tensor: torch.Tensor) -> str:
    """Fingerprint a tensor's dtype, shape and raw bytes.

    XXH3-128 (xxhash) of ``"{dtype}|{shape}|"`` followed by the bytes: about 8 GB/s
    on one core here (BLAKE2b: 0.6 GB/s), and it releases the GIL, so digesting
    overlaps other work. It is not a cryptographic hash (a refit guards against
    bugs, not adversaries), but a change of any byte changes it except with
    probability about 2**-128.

    Returns:
        32 hex digits; equal for two tensors exactly when (barring collisions)
        dtype, shape and every byte are equal.
    """
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    hasher = xxhash.xxh3_128()
    hasher.update(f"{flat.dtype}|{tuple(tensor.shape)}|".encode())
    hasher.update(flat.view(torch.uint8).numpy().data)
    return hasher.hexdigest()


def state_digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> `tensor_digest` of every tensor of ``state``, in its order."""
    return {name: tensor_digest(tensor) for name, tensor in state.items()}


def verify_refit(version: int, sent: dict[str, str], loaded: dict[str, str]) -> None:
    """Check that the engine loaded exactly the tensors the trainer exported.

    ``sent`` maps tensor names to the trainer's :func:`tensor_digest` (the
    weight-version record's ``tensor_names``/``tensor_digests``), ``loaded`` the
    digests the engine computed as its loader consumed each tensor.

    Raises:
        RuntimeError: naming the tensors that differ or were not loaded.
    """
    bad = sorted(n for n, d in sent.items() if loaded.get(n) != d)
    if bad:
        raise RuntimeError(f"refit to version {version} is not verified: {len(bad)} tensor(s) differ "
                           f"or were not loaded, e.g. {bad[:5]}")


PROBE_SEED = 20240601  # the probe tokens are the same for every version and run
DEFAULT_ATOL = {torch.float32: 1e-3}  # by the trainer forward's compute dtype; others: LOW_PRECISION_ATOL
LOW_PRECISION_ATOL = 1.0


@dataclasses.dataclass(frozen=True)
class Probe:
    """A trainer's probe: token ids [P], its logprobs [P-1] and the accepted difference."""

    token_ids: list[int]
    logprobs: list[float]
    atol: float


def probe_token_ids(vocab_size: int, num_tokens: int = 32) -> list[int]:
    """P pseudo-random token ids in [0, vocab_size), fixed by PROBE_SEED.

    Random ids need no tokenizer and reach rows of the (tied) embedding that
    natural text rarely does. Example: probe_token_ids(49152, 4) gives the same
    4 ids on every call, run and machine.
    """
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()


def check_probe(version: int, probe: Probe, engine_logprobs: list[float]) -> float:
    """Step 3: the engine's probe logprobs [P-1] must be within ``probe.atol`` of the trainer's;
    returns the largest difference.

    Raises:
        RuntimeError: naming the version, the largest difference and its position.
    """
    if len(engine_logprobs) != len(probe.logprobs):
        raise RuntimeError(f"refit to version {version} failed the probe: the engine returned "
                           f"{len(engine_logprobs)} logprobs for {len(probe.logprobs)} probe positions")
    diffs = (torch.tensor(engine_logprobs, dtype=torch.float64)
             - torch.tensor(probe.logprobs, dtype=torch.float64)).abs()  # [P-1]
    diffs = torch.where(diffs.isnan(), torch.inf, diffs)  # a NaN fails too
    if (largest := float(diffs.max()) if diffs.numel() else 0.0) <= probe.atol:
        return largest
    index = int(diffs.argmax())
    position = index + 1  # position in the probe sequence of the scored token
    raise RuntimeError(
        f"refit to version {version} failed the probe: engine and trainer logprobs differ by "
        f"{largest:.3g} at position {position} (token id {probe.token_ids[position]}; "
        f"tolerance {probe.atol:g}): the engine does not compute what the trainer exported; "
        "hint: a reload that corrupts or skips weights, or a bf16 side (raise "
        "policy.weights.probe_atol)")


def check_probe_changed(version: int, before: list[float], after: list[float], same_weights: bool) -> None:
    """Step 4: the engine's probe must change across a refit whose weights changed.

    Raises:
        RuntimeError: if ``after`` equals ``before`` bit for bit while ``same_weights`` is false.
    """
    if after == before and not same_weights:
        raise RuntimeError(
            f"refit to version {version} failed the probe: the engine's probe logprobs did not change "
            "although the weights' digests did; the engine still computes with the previous weights")


def weight_record(state: dict[str, torch.Tensor], version: int, uri: str, digests: dict[str, str],
                  probe: Probe | None = None, format: str = "safetensors") -> dict[str, Any]:
    """The weight-version record (a molt.schema.WEIGHT_VERSION_SCHEMA row) announcing ``state``
    (HF names -> tensors) as version ``version`` at ``uri``, with each tensor's ``digests``
    (`tensor_digest`, in ``state`` order), dtype and shape, and the trainer's ``probe``
    (None: a record without a probe)."""
    assert list(digests) == list(state), "one digest per tensor, in state order"
    return {"policy_version": version, "uri": uri, "format": format,
            "num_bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "tensor_names": list(digests), "tensor_digests": list(digests.values()), **tensor_layout(state),
            "probe_token_ids": probe.token_ids if probe else [], "probe_logprobs": probe.logprobs if probe else [],
            "probe_atol": probe.atol if probe else None, "created_unix_s": time.time()}


def record_probe(record: dict[str, Any]) -> Probe | None:
    """The trainer's probe in a record, or None if it has none."""
    token_ids = record.get("probe_token_ids") or []
    if not token_ids:
        return None
    return Probe(list(token_ids), list(record["probe_logprobs"]), float(record["probe_atol"]))
