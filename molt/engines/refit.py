"""The engine side of a refit (molt.refit): take a published version, load it, verify it.

`refit_from` takes the newest weight-version record waiting on a broadcast input (the train
stage's ``weights`` output), pins its file, and `apply_weight_record` loads it into an engine
and verifies it: every tensor's digest as the engine's loader consumed it (`iter_weights`) must
equal the trainer's, and the engine's probe must match the trainer's and must have changed
(molt.refit). A failure raises, naming the version and what differs; the stage then fails and
the run stops. A LoRA trainer's record (format "peft") names an adapter folder instead, which the
engine serves as that version (`Engine.load_adapter`); its digests are those of the adapter's tensors.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from molt.engines.base import Engine
from molt.refit import (ADAPTER_FILE, PEFT_PREFIX, Probe, check_probe, check_probe_changed, merge_adapter, record_probe,
                        tensor_digest, verify_refit)

logger = logging.getLogger(__name__)
FILE_FORMATS = ("safetensors", "peft")  # records whose weights are files (a LoRA adapter: a folder)


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


def read_adapter(folder: str | Path) -> tuple[dict[str, torch.Tensor], float]:
    """A peft LoRA folder (molt.train.publish.publish_adapter): its tensors under the file's names
    (``base_model.model.X.lora_A.weight`` [rank, in], ``...lora_B.weight`` [out, rank]) and its scaling
    alpha / rank.

    Raises:
        ValueError: the folder lacks adapter_config.json or adapter_model.safetensors.
    """
    folder = Path(folder)
    if not (folder / "adapter_config.json").is_file() or not (folder / ADAPTER_FILE).is_file():
        raise ValueError(f"{folder} is not a peft adapter folder: it needs adapter_config.json and {ADAPTER_FILE}")
    config = json.loads((folder / "adapter_config.json").read_text())
    return load_file(folder / ADAPTER_FILE), float(config["lora_alpha"]) / float(config["r"])


def merged_checkpoint(model_dir: str | Path, adapter: dict[str, torch.Tensor], scaling: float
                      ) -> dict[str, torch.Tensor]:
    """The model folder's weights, checkpoint-named, with a peft adapter (`read_adapter`'s tensors and
    scaling) merged into each weight it adapts (``X.weight`` += scaling * B @ A, molt.refit.merge_adapter):
    a full refit. An adapter names the model's modules; where the checkpoint stores a weight under
    another name (a LLaVA's ``model.language_model.X`` is its ``language_model.model.X``), `checkpoint_name`.

    Raises:
        ValueError: an adapted module's weight is not in the checkpoint, naming it.
    """
    state = {name: tensor for shard in sorted(Path(model_dir).glob("*.safetensors")) for name, tensor in
             load_file(shard).items()}
    for name in (n for n in adapter if ".lora_A." in n):
        weight = f"{name.removeprefix(PEFT_PREFIX).split('.lora_A.')[0]}.weight"
        weight = weight if weight in state else checkpoint_name(model_dir, weight)
        if weight not in state:
            raise ValueError(f"cannot merge the adapter's {name}: the checkpoint of {model_dir} has no {weight}; "
                             "hint: serve adapters with an engine that takes them")
        state[weight] = merge_adapter(state[weight], adapter[name], adapter[name.replace(".lora_A.", ".lora_B.")],
                                      scaling)
    return state


def checkpoint_name(model_dir: str | Path, name: str) -> str:
    """The name under which ``model_dir``'s checkpoint stores its transformers model's parameter ``name``, as
    ``save_pretrained`` writes it (transformers' ``revert_weight_conversion``, on the model built on the meta
    device once per folder)."""
    from transformers.core_model_loading import revert_weight_conversion

    return next(iter(revert_weight_conversion(_meta_model(str(model_dir)), {name: torch.empty(0, device="meta")})))


@functools.cache
def _meta_model(model_dir: str) -> Any:  # a transformers PreTrainedModel
    """``model_dir``'s transformers model on the meta device: its module names, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # a vision-language folder: as molt.models.images.VisionProcessor.of tells one
        return (AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
                ).from_config(config)


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
    streamed = record.get("format", "safetensors") not in FILE_FORMATS  # the trainer is sending it: take it
    if version <= engine.policy_version and not streamed:
        return False
    probe = record_probe(record)
    before = await _probe_before(engine, probe)
    held = dict(engine.last_weight_digests)  # {} until the first refit
    if streamed:
        await engine.receive_weights(record)
    elif record.get("format") == "peft":
        await engine.load_adapter(record["uri"].removeprefix("file://"), version)
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
    """`apply_weight_record` of record batch ``item``, from broadcast input ``port`` (molt.runtime.ports.InputPort);
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
    """The record with its safetensors file (or an adapter folder's files) hard-linked under a name of
    this process for the duration (they stay readable even if their writer deletes them); streamed
    records as they are.

    Raises:
        FileNotFoundError: naming the version and the file, when it no longer exists.
    """
    if record.get("format", "safetensors") not in FILE_FORMATS:
        yield record
        return
    source = Path(record["uri"].removeprefix("file://"))
    link = source.with_name(f".pin-{os.getpid()}-{source.name}")
    try:
        link_weights(source, link)
    except FileNotFoundError:
        raise FileNotFoundError(f"weights of version {record['policy_version']} are gone: {source} was deleted "
                                "(a newer version replaced it); hint: raise policy.weights.keep_versions "
                                "(molt.refit.PublishConfig)") from None
    try:
        yield {**record, "uri": f"file://{link}"}
    finally:
        remove_weights(link)


def link_weights(source: Path, link: Path) -> None:
    """Hard-link a weights file, or each file of an adapter folder into a new folder, at ``link``
    (copied where hard links cannot reach: another file system).

    Raises:
        FileNotFoundError: ``source`` (or one of its files) is gone; nothing is left at ``link``.
    """
    files = [(f, link / f.name) for f in source.iterdir()] if source.is_dir() else [(source, link)]
    try:
        if source.is_dir():
            link.mkdir()
        for file, dest in files:
            try:
                os.link(file, dest)
            except OSError:  # another file system: a copy (which raises FileNotFoundError too if the file is gone)
                shutil.copy(file, dest)
    except FileNotFoundError:
        remove_weights(link)
        raise


def remove_weights(path: Path) -> None:
    """Remove a weights file or adapter folder, if there."""
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


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
