"""Turn a model name or path into a local Hugging Face folder, offline first. In this order:

1. a local folder holding ``config.json``, returned as it is;
2. a built-in name, made once in `default_cache_dir`: ``smollm2-135m-instruct`` (smollm2.py),
   ``-moe`` (upcycle.py) and ``-vlm`` of either (vlm.py); or any other folder in that cache
   (a train stage's ``export_model``);
3. a hub id ``org/name``, fetched with ``huggingface_hub.snapshot_download``.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from molt.models.smollm2 import ensure_smollm2

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MOE = "smollm2-135m-instruct-moe"
VLM_SOURCES = {f"{DEFAULT_MODEL}-vlm": DEFAULT_MODEL, f"{DEFAULT_MOE}-vlm": DEFAULT_MOE}
BUILT_IN = (DEFAULT_MODEL, DEFAULT_MOE, *VLM_SOURCES)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")  # a leading "." or "/" is a path
# What training and vLLM need; skips ONNX, GGUF and .bin duplicates.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def default_cache_dir() -> Path:
    """``$MOLT_CACHE/models``, else ``~/.cache/molt/models``."""
    root = os.environ.get("MOLT_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "molt"
    return base / "models"


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """A local Hugging Face folder for ``name_or_path``; hub snapshots go to ``cache_dir/hub``,
    or without ``cache_dir`` to huggingface_hub's own cache.

    Raises:
        ValueError: saying which of the three kinds of name failed, and why.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return _check_local_folder(path)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if name_or_path in BUILT_IN:
        return _built_in(name_or_path, cache)
    if "/" not in name_or_path and (cache / name_or_path / "config.json").is_file():
        return (cache / name_or_path).resolve()
    if _HUB_ID.match(name_or_path):
        return _download_from_hub(name_or_path, Path(cache_dir) / "hub" if cache_dir else None)
    raise ValueError(
        f"model: not a local folder, a built-in name, a model in the cache {str(cache)!r} or a "
        f"hub id (org/name); got {name_or_path!r}; hint: give an existing Hugging Face folder, "
        f"one of {list(BUILT_IN)}, the export_model name of a finished run (e.g. `molt run "
        "pipelines/sft.yaml` first) or a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'"
    )


def prepare(name: str, cache_dir: Path | None = None) -> Path:
    """`resolve_model` now, logging where the folder lies (``molt models prepare NAME``)."""
    folder = resolve_model(name, cache_dir)
    logger.info("model %s ready: %s (%.0f MB)", name, folder, folder_size_bytes(folder) / 1e6)
    return folder


def export_path(name_or_path: str) -> Path:
    """Where ``export_model`` writes: a name into the model cache; a path (holding '/') itself.

    Raises:
        ValueError: a built-in name.
    """
    if name_or_path in BUILT_IN:
        raise ValueError(f"export_model: {name_or_path!r} is a built-in model's name; "
                         "hint: choose another name")
    if "/" in name_or_path:
        return Path(name_or_path).expanduser()
    return default_cache_dir() / name_or_path


def folder_size_bytes(folder: Path) -> int:
    """Total size of the files under ``folder``, following the hub cache's symlinks."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _built_in(name: str, cache: Path) -> Path:
    """A built-in model's cache folder, made once under a file lock while other stages wait."""
    from filelock import FileLock

    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / name).is_dir():
        logger.info("preparing %s in %s (or waiting for the process that is)", name, cache)
    with FileLock(cache / f".lock-{name}"):
        if name == DEFAULT_MODEL:
            return ensure_smollm2(cache)
        folder = cache / name
        if folder.is_dir():
            return folder
        if name in VLM_SOURCES:
            from molt.models.vlm import build_vlm

            dense = VLM_SOURCES[name] == DEFAULT_MODEL
            text = ensure_smollm2(cache) if dense else _built_in(DEFAULT_MOE, cache)
            return build_vlm(text, folder)
        from molt.models.upcycle import upcycle

        return upcycle(ensure_smollm2(cache), folder)


def _check_local_folder(path: Path) -> Path:
    if not path.is_dir():
        raise ValueError(
            f"model: a local model must be a Hugging Face folder; got the file {str(path)!r}; "
            "hint: pass the folder that holds config.json and the weights"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model: the local folder has no config.json; got {str(path)!r}; "
            "hint: pass a Hugging Face model folder (config.json, *.safetensors, tokenizer files)"
        )
    return path.resolve()


def _download_from_hub(repo_id: str, hub_cache: Path | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError)

    try:
        folder = Path(snapshot_download(repo_id, cache_dir=hub_cache, allow_patterns=_HUB_PATTERNS))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
        raise ValueError(
            f"model: the Hugging Face hub cannot be reached and {repo_id!r} is not in the local "
            f"hub cache; got {type(error).__name__}; hint: pass a local model folder, or use the "
            f"built-in {DEFAULT_MODEL!r}, which needs only the Python package index"
        ) from error
    except RepositoryNotFoundError as error:
        raise ValueError(
            f"model: no such repository on the Hugging Face hub (or it is private); got "
            f"{repo_id!r}; hint: check the spelling (org/name), log in for a gated model, or pass "
            "a local folder"
        ) from error
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise ValueError(
            f"model: the hub repository lacks config.json or *.safetensors weights; "
            f"got {repo_id!r} at {folder}; "
            "hint: use a repository with safetensors weights, or convert it to a local folder first"
        )
    return folder
