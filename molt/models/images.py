"""Images in messages, records, engines and the trainer, through the model's own processor.

A message's ``content`` is a string or a list of parts, ``{"type": "text", "text": ...}`` and
``{"type": "image", "image": "data:image/png;base64,..."}``. ``token_ids`` hold each image's
tokens, exactly what the model's forward sees.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

import torch

_DATA_URL = "data:image/"


def image_part(data: bytes, mime: str = "image/png") -> dict[str, str]:
    """A message part of an encoded image."""
    return {"type": "image", "image": f"data:{mime};base64,{base64.b64encode(data).decode()}"}


def decode_image_part(part: dict[str, Any], where: str) -> bytes:
    """The encoded bytes of an image part.

    Raises:
        ValueError: ``image`` is not a base64 data URL.
    """
    url = part.get("image")
    if not isinstance(url, str) or not url.startswith(_DATA_URL) or ";base64," not in url:
        raise ValueError(f"{where}: an image part's 'image' must be a data:image/...;base64, URL; "
                         f"got {str(url)[:40]!r}")
    return base64.b64decode(url.split(";base64,", 1)[1])


def flatten_messages(messages: Sequence[dict[str, Any]], placeholder: str | None,
                     where: str) -> tuple[list[dict[str, str]], list[bytes]]:
    """Messages with image parts replaced by ``placeholder``, and the images in order.

    Raises:
        ValueError: an image part and no ``placeholder`` (a text-only model), or an unknown part.
    """
    flat, images = [], []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            flat.append(dict(message))
            continue
        text = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text.append(str(part.get("text", "")))
            elif kind == "image":
                if placeholder is None:
                    raise ValueError(f"{where}: a message holds an image but the model has no "
                                     "image processor; hint: use a vision-language model (e.g. "
                                     "smollm2-135m-instruct-moe-vlm)")
                images.append(decode_image_part(part, where))
                text.append(placeholder)
            else:
                raise ValueError(f"{where}: message parts must have type 'text' or 'image'; "
                                 f"got {kind!r}")
        flat.append({**message, "content": "".join(text)})
    return flat, images


class VisionProcessor:
    """A vision-language model folder's image tokens and image processor.

    Tokens per image: LLaVA ``image_seq_length``; Qwen-VL ``t * h * w / merge_size**2`` of the
    (t, h, w) patch grid (Qwen2-VL, arXiv 2409.12191, sec. 2.1).

    Raises:
        ValueError: config.json has no image token id, or tokens per image are found neither way.
    """

    def __init__(self, model_dir: str | Path, tokenizer: Any = None) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        config = json.loads((Path(model_dir) / "config.json").read_text())
        token_id = config.get("image_token_id", config.get("image_token_index"))
        if token_id is None:
            raise ValueError(f"{model_dir}/config.json: a vision-language model needs "
                             "image_token_id (or image_token_index); hint: a LLaVA- or "
                             "Qwen-VL-style folder")
        self.image_processor = AutoImageProcessor.from_pretrained(str(model_dir))
        self.image_token_id = int(token_id)
        fixed = config.get("image_seq_length")
        self.merge_size: int | None = getattr(self.image_processor, "merge_size", None)
        if fixed is None and self.merge_size is None:
            raise ValueError(f"{model_dir}: neither image_seq_length in config.json nor an image "
                             f"processor with merge_size ({type(self.image_processor).__name__}); "
                             "hint: Molt supports LLaVA- and Qwen-VL-style processors")
        by_patch = self.merge_size is None and fixed is not None
        self.tokens_per_image = int(fixed) if by_patch else None
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model_dir))
        wrap = [config.get("vision_start_token_id"), token_id, config.get("vision_end_token_id")]
        wrap_ids = [int(t) for t in wrap if t is not None]
        self.placeholder = "".join(tokenizer.convert_ids_to_tokens(wrap_ids))

    @staticmethod
    def of(model_dir: str | Path, tokenizer: Any = None) -> VisionProcessor | None:
        """The processor of a VLM folder, else None."""
        path = Path(model_dir) / "config.json"
        is_vlm = path.is_file() and "vision_config" in json.loads(path.read_text())
        return VisionProcessor(model_dir, tokenizer) if is_vlm else None

    def token_counts(self, images: Sequence[bytes]) -> list[int]:
        """[N] image tokens of each encoded image."""
        if self.merge_size is None:
            return [int(self.tokens_per_image or 0)] * len(images)
        sizes = [image.size for image in decode_images(images)]  # (width, height)
        return [self.image_processor.get_number_of_image_patches(h, w, {}) // self.merge_size ** 2
                for w, h in sizes]

    def expand(self, token_ids: Sequence[int], images: Sequence[bytes]) -> list[int]:
        """[T'] ids with the k-th image token repeated once per token of image k.

        Raises:
            ValueError: the ids hold another number of image tokens than ``images``.
        """
        counts = self.token_counts(images)
        if (found := sum(t == self.image_token_id for t in token_ids)) != len(counts):
            raise ValueError(f"{found} image placeholders for {len(counts)} image(s); hint: every "
                             "image part renders one placeholder")
        out: list[int] = []
        image = iter(counts)
        for token in token_ids:
            out += [token] * (next(image) if token == self.image_token_id else 1)
        return out

    def collapse(self, token_ids: Sequence[int], images: Sequence[bytes]) -> list[int]:
        """The inverse of `expand` (for vLLM); assumes `check` passed."""
        out, left = [], 0
        counts = iter(self.token_counts(images))
        for token in token_ids:
            if token != self.image_token_id:
                out.append(token)
                continue
            if left == 0:
                out.append(token)
                left = next(counts)
            left -= 1
        return out

    def positions(self, token_ids: Sequence[int]) -> list[int]:
        """[total image tokens] positions of image tokens."""
        return [i for i, t in enumerate(token_ids) if t == self.image_token_id]

    def check(self, token_ids: Sequence[int], images: Sequence[bytes], sample: str) -> list[int]:
        """`token_counts` of ``images``, if the ids' image tokens split into them in order.

        Raises:
            ValueError: naming ``sample``, e.g. a sequence cut inside an image.
        """
        counts = self.token_counts(images)
        runs = [len(list(run)) for token, run in groupby(token_ids) if token == self.image_token_id]
        queue, rest = list(reversed(counts)), 0
        for rest in runs:  # a run holds one or more whole images (LLaVA's placeholders may touch)
            while rest > 0 and queue and queue[-1] <= rest:
                rest -= queue.pop()
            if rest:
                break
        if sum(runs) != sum(counts) or queue or rest:
            each = f"of {counts[0]} tokens each" if len(set(counts)) == 1 else f"of {counts} tokens"
            raise ValueError(f"sample {sample!r}: {sum(runs)} image tokens (id "
                             f"{self.image_token_id}) for {len(counts)} image(s) {each} "
                             f"(expected {sum(counts)}); hint: a sequence must not be cut inside "
                             "an image, and every image needs its placeholder")
        return counts

    def model_inputs(self, images: Sequence[bytes]) -> dict[str, torch.Tensor]:
        """``pixel_values`` float32 (LLaVA [N, 3, H, W]; Qwen-VL [patches, 3 * t * p * p]) and,
        for Qwen-VL, ``image_grid_thw`` int64 [N, 3]."""
        out = self.image_processor(images=decode_images(images), return_tensors="pt")
        inputs = {"pixel_values": out["pixel_values"].float()}
        if "image_grid_thw" in out:
            inputs["image_grid_thw"] = out["image_grid_thw"].long()
        return inputs


def mrope_positions(rope_index: Any, token_ids: torch.Tensor, image_token_id: int,
                    image_grid_thw: torch.Tensor) -> torch.Tensor:
    """[3, T] (temporal, height, width) positions of one Qwen-VL sequence, by the model's
    ``get_rope_index``: multimodal RoPE (Qwen2-VL, arXiv 2409.12191, sec. 2.1)."""
    ids = token_ids[None]  # [1, T]
    types = (ids == image_token_id).int()  # 1 = image token (mm_token_type_ids)
    positions, _ = rope_index(ids, mm_token_type_ids=types, image_grid_thw=image_grid_thw)
    return positions[:, 0]


def decode_images(images: Sequence[bytes]) -> list[Any]:
    """PIL RGB images of encoded bytes."""
    from PIL import Image

    return [Image.open(io.BytesIO(data)).convert("RGB") for data in images]


def row_images(batch: Any) -> list[tuple[bytes, ...]]:
    """[N] each row's images (column ``images``; () when null or absent)."""
    if "images" not in batch.schema.names:
        return [()] * batch.num_rows
    return [tuple(images or ()) for images in batch.column("images").to_pylist()]


@dataclass(frozen=True)
class VisionInputs:
    """`VisionProcessor.model_inputs` of a micro-batch's distinct images; ``row_images`` [R]: the
    indices of each row's images among them."""

    tensors: dict[str, torch.Tensor]
    row_images: list[list[int]]


def packed_vision_inputs(vision: VisionProcessor | None, rows: Sequence[Sequence[int]],
                         images: Sequence[Sequence[bytes] | None], sample_ids: Sequence[str],
                         token_index: torch.Tensor) -> VisionInputs | None:
    """The `VisionInputs` of a packed micro-batch, or None; ``token_index`` [sum of row lengths]:
    the packed position of each row token. An image of a shared prompt is given once.

    Raises:
        ValueError: naming the sample: images that do not match its image tokens, or any image
            for a text-only model.
    """
    found: dict[int, bytes] = {}  # packed position of an image's first token -> the image
    firsts: list[list[int]] = []
    offset = 0
    for row, row_images, sample in zip(rows, images, sample_ids):
        row_images = row_images or []
        if vision is None and row_images:
            raise ValueError(f"sample {sample!r}: {len(row_images)} image(s) (column images) "
                             "for a text-only model; hint: train a vision-language model")
        if vision is not None:
            counts = vision.check(row, row_images, sample)
            positions = vision.positions(row)
            starts = [sum(counts[:k]) for k in range(len(counts))]
            firsts.append([int(token_index[offset + positions[start]]) for start in starts])
            for first, data in zip(firsts[-1], row_images):
                found.setdefault(first, data)
        offset += len(row)
    if vision is None or not found:
        return None
    order = {position: k for k, position in enumerate(sorted(found))}
    return VisionInputs(vision.model_inputs([found[p] for p in sorted(found)]),
                        [[order[p] for p in row] for row in firsts])
