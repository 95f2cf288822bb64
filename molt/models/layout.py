"""Hugging Face model folders: the tensor shapes a checkpoint stores, and writing a new folder."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

PROVENANCE = "molt-model.json"


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a model folder's safetensors files (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            shapes.update({n: tuple(handle.get_slice(n).get_shape()) for n in handle.keys()})
    return shapes


def checkpoint_layout(tensor: torch.Tensor, shape: tuple[int, ...] | None) -> torch.Tensor:
    """``tensor`` with its last two dims swapped when that, and only that, gives ``shape``:
    transformers loads a fused expert tensor stored as [E, H, 2I] (Qwen3-VL-MoE) as [E, 2I, H]
    but never transposes it back on export."""
    if shape is None or tuple(tensor.shape) == shape or tensor.dim() < 2:
        return tensor
    if (*tensor.shape[:-2], tensor.shape[-1], tensor.shape[-2]) == shape:
        return tensor.transpose(-1, -2)
    return tensor


def source_config(source: Path, out: Path, who: str) -> dict[str, Any]:
    """``source``'s config.json, for a conversion into the new folder ``out``.

    Raises:
        ValueError: ``out`` exists, or ``source`` has no config.json (prefixed ``who``).
    """
    if out.exists():
        raise ValueError(f"{who}: the output folder exists; got {str(out)!r}; "
                         "hint: choose a new folder")
    if not (source / "config.json").is_file():
        raise ValueError(f"{who}: no config.json in the source folder; got {str(source)!r}")
    return json.loads((source / "config.json").read_text())


@contextmanager
def new_folder(out: Path, provenance: dict[str, Any]) -> Iterator[Path]:
    """A temporary sibling folder to write into: renamed to ``out`` with `PROVENANCE` when the
    block ends, removed if it raises."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=1))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
