"""The engine side of a refit (molt.refit): take a published version, load it, verify it.

`refit_from` takes the newest weight-version record waiting on a broadcast input (the train
stage's ``weights`` output), pins its file, and `apply_weight_record` loads it into an engine
and verifies it: every tensor's digest as the engine's loader consumed it (`iter_weights`) must
equal the trainer's, and the engine's probe must match the trainer's and must have changed
(molt.refit). A failure raises, naming the version and what differs; the stage then fails and
the run stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from safetensors import safe_open

from molt.engines.base import Engine
from molt.refit import Probe, check_probe, check_probe_changed, record_probe, tensor_digest, verify_refit

logger = logging.getLogger(__name__)


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
    return {name: tensor_digest(tensor) for name, tensor in iter_weights(path, None)}


async def apply_weight_record(engine: Engine, record: dict[str, Any]) -> bool:
    """Load the weights a weight-version record (molt.schema.WEIGHT_VERSION_SCHEMA row) points to into
    ``engine`` if they are newer, and verify the refit (molt.refit): every tensor's digest as the engine's
    loader consumed it (`verify_refit`), then the probe's steps 2-4 (the engine's probe before the load is
    cached from the previous refit). A record without a probe (empty ``probe_token_ids``) is verified by
    its digests only, with a warning.

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
    probe = record_probe(record)
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
    largest = check_probe(version, probe, after)
    if before is not None and after == before:  # identical weights are the only excuse (their digests asked only then)
        check_probe_changed(version, before, after, _same_weights(sent, held or engine.source_weight_digests()))
    engine.last_probe = (probe.token_ids, after)
    logger.info("refit to version %d verified: %d tensor digests equal the trainer's; probe |engine - trainer| "
                "<= %.2g (tolerance %g)", version, len(sent), largest, probe.atol)
    return True


async def refit_from(engine: Engine, port: Any, item: pa.RecordBatch) -> tuple[float, pa.RecordBatch] | None:
    """`apply_weight_record` of record batch ``item``, from broadcast input ``port`` (molt.ports.InputPort);
    the seconds it took and the record batch applied, or None if it was not newer.

    The record's file is pinned first (`pinned`): a trainer that keeps few versions may delete
    it once a newer one is written; then the newest record waiting on ``port`` is applied
    instead.

    Raises:
        FileNotFoundError: the file is gone and no newer record waits.
    """
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
                                "(a newer version replaced it); hint: raise policy.weights.keep_versions "
                                "(molt.refit.PublishConfig)") from None
    try:
        yield {**record, "uri": f"file://{link}"}
    finally:
        link.unlink(missing_ok=True)


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
