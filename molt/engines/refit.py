"""The engine side of a refit (molt.refit): take a published version, load it, verify it.

Every tensor's digest as the engine's loader consumed it must equal the trainer's, and the
engine's probe must match the trainer's and must have changed; a failure raises, naming the
version and what differs. A LoRA record (format "peft") names an adapter folder instead.
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
from molt.refit import (ADAPTER_FILE, PEFT_PREFIX, Probe, check_probe, check_probe_changed,
                        merge_adapter, record_probe, tensor_digest, verify_refit)

logger = logging.getLogger(__name__)
FILE_FORMATS = ("safetensors", "peft")  # records whose weights are files (a LoRA adapter: a folder)


def check_weights_file(path: str) -> None:
    """Raises ValueError unless `path` is an existing .safetensors file."""
    if not path.endswith(".safetensors") or not os.path.isfile(path):
        raise ValueError(f"weights must be an existing .safetensors file; got {path!r}; "
                         "hint: export with safetensors.torch.save_file, ideally to /dev/shm")


def iter_weights(path: str,
                 digests: dict[str, str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a safetensors file; ``digests`` gets each one's digest as it is yielded,
    so it covers exactly what the consumer received."""
    with safe_open(path, framework="pt") as handle:
        for name in handle.keys():
            tensor = handle.get_tensor(name)
            if digests is not None:
                digests[name] = tensor_digest(tensor)
            yield name, tensor


def read_adapter(folder: str | Path) -> tuple[dict[str, torch.Tensor], float]:
    """A peft LoRA folder's tensors (``X.lora_A.weight`` [rank, in], ``X.lora_B.weight``
    [out, rank]) and scaling alpha / rank; ValueError for a folder missing either file."""
    folder = Path(folder)
    if not (folder / "adapter_config.json").is_file() or not (folder / ADAPTER_FILE).is_file():
        raise ValueError(f"{folder} is not a peft adapter folder: it needs adapter_config.json and "
                         f"{ADAPTER_FILE}")
    config = json.loads((folder / "adapter_config.json").read_text())
    return load_file(folder / ADAPTER_FILE), float(config["lora_alpha"]) / float(config["r"])


def merged_checkpoint(model_dir: str | Path, adapter: dict[str, torch.Tensor], scaling: float
                      ) -> dict[str, torch.Tensor]:
    """The model folder's checkpoint with an adapter merged (``X.weight`` += scaling * B @ A);
    ValueError naming an adapted weight the checkpoint lacks."""
    state = {name: tensor for shard in sorted(Path(model_dir).glob("*.safetensors"))
             for name, tensor in load_file(shard).items()}
    for name in (n for n in adapter if ".lora_A." in n):
        weight = f"{name.removeprefix(PEFT_PREFIX).split('.lora_A.')[0]}.weight"
        weight = weight if weight in state else checkpoint_name(model_dir, weight)
        if weight not in state:
            raise ValueError(f"cannot merge the adapter's {name}: the checkpoint of {model_dir} "
                             f"has no {weight}; hint: serve adapters with an engine that takes "
                             "them")
        lora_b = adapter[name.replace(".lora_A.", ".lora_B.")]
        state[weight] = merge_adapter(state[weight], adapter[name], lora_b, scaling)
    return state


def checkpoint_name(model_dir: str | Path, name: str) -> str:
    """The name ``save_pretrained`` gives ``model_dir``'s transformers parameter ``name`` (a LLaVA's
    ``model.language_model.X`` is ``language_model.model.X``)."""
    from transformers.core_model_loading import revert_weight_conversion

    model = _meta_model(str(model_dir))
    return next(iter(revert_weight_conversion(model, {name: torch.empty(0, device="meta")})))


@functools.cache
def _meta_model(model_dir: str) -> Any:  # a transformers PreTrainedModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def file_digests(path: str) -> dict[str, str]:
    return {name: tensor_digest(tensor) for name, tensor in iter_weights(path, None)}


async def apply_weight_record(engine: Engine, record: dict[str, Any]) -> bool:
    """Load a weight-version record into ``engine`` if newer and verify it (module docstring);
    True when a refit happened. Without a probe, only digests are verified (a warning). A
    streamed record is never skipped: the trainer's collective send waits for every engine.

    Raises:
        RuntimeError: a digest mismatch (naming the tensors) or a failed probe (naming the
            version, the largest difference and its position).
    """
    version = int(record["policy_version"])
    streamed = record.get("format", "safetensors") not in FILE_FORMATS  # being sent: take it
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
        logger.warning("refit to version %d: the record has no probe; only digests were verified",
                       version)
        return True
    after = await engine.prompt_logprobs(probe.token_ids)
    largest = check_probe(version, probe, after)
    if before is not None and after == before:  # only identical weights excuse it
        same = _same_weights(sent, held or engine.source_weight_digests())
        check_probe_changed(version, before, after, same)
    engine.last_probe = (probe.token_ids, after)
    logger.info("refit to version %d verified: %d tensor digests equal the trainer's; probe "
                "|engine - trainer| <= %.2g (tolerance %g)", version, len(sent), largest,
                probe.atol)
    return True


async def refit_from(engine: Engine, port: Any, item: pa.RecordBatch
                     ) -> tuple[float, pa.RecordBatch] | None:
    """`apply_weight_record` of ``item``: (seconds, batch applied), or None if not newer. If the
    trainer deleted its file already, the newest record waiting on ``port`` is applied instead;
    FileNotFoundError if none is newer."""
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
            newest = newer.to_pylist()[-1] if isinstance(newer, pa.RecordBatch) else None
            if newest is None or newest["policy_version"] <= record["policy_version"]:
                raise
            logger.info("weights of version %d were replaced before loading; taking version %d",
                        record["policy_version"], newest["policy_version"])
            item = newer
    return None


@contextlib.contextmanager
def pinned(record: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The record with its file (or adapter folder) hard-linked under a name of this process for
    the duration; FileNotFoundError naming the version and the file, when it is gone."""
    if record.get("format", "safetensors") not in FILE_FORMATS:
        yield record
        return
    source = Path(record["uri"].removeprefix("file://"))
    link = source.with_name(f".pin-{os.getpid()}-{source.name}")
    try:
        link_weights(source, link)
    except FileNotFoundError:
        raise FileNotFoundError(f"weights of version {record['policy_version']} are gone: {source} "
                                "was deleted (a newer version replaced it); hint: raise "
                                "policy.weights.keep_versions (molt.refit.PublishConfig)") from None
    try:
        yield {**record, "uri": f"file://{link}"}
    finally:
        remove_weights(link)


def link_weights(source: Path, link: Path) -> None:
    """Hard-link (or copy) a weights file or adapter folder at ``link``; FileNotFoundError,
    leaving nothing, when ``source`` (or one of its files) is gone."""
    files = [(f, link / f.name) for f in source.iterdir()] if source.is_dir() else [(source, link)]
    try:
        if source.is_dir():
            link.mkdir()
        for file, dest in files:
            try:
                os.link(file, dest)
            except OSError:  # another file system (a copy raises FileNotFoundError too)
                shutil.copy(file, dest)
    except FileNotFoundError:
        remove_weights(link)
        raise


def remove_weights(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


async def _probe_before(engine: Engine, probe: Probe | None) -> list[float] | None:
    if probe is None:
        return None
    if engine.last_probe is not None and engine.last_probe[0] == probe.token_ids:
        return engine.last_probe[1]
    return await engine.prompt_logprobs(probe.token_ids)


def _same_weights(sent: dict[str, str], held: dict[str, str]) -> bool:
    return bool(held) and all(held.get(name) == digest for name, digest in sent.items())
