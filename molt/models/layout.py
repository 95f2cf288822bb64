"""A Hugging Face checkpoint's tensor layout: the shapes its files store, and a tensor put back into them."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


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
