"""Images in messages, records, engines and the trainer, through the model's own processor.

**Messages.** A message's ``content`` is a string, or a list of parts in the order they
appear: ``{"type": "text", "text": "..."}`` and ``{"type": "image", "image": PNG}``
where PNG is a ``data:image/png;base64,...`` URL (or ``data:image/jpeg``), so tasks
and metadata stay JSON. :func:`image_part` makes one from encoded bytes.

**Tokens.** The chat template sees each image as the processor's placeholder text
(``<image>``); :class:`VisionProcessor` expands each placeholder token into the
``tokens_per_image`` image tokens the model fills with its features (LLaVA: one per
patch), so ``token_ids`` [T] hold exactly the tokens the model's forward sees.

**Records.** Column ``images`` holds the encoded bytes of the row's images in order,
``image_token_positions`` [num_images * tokens_per_image] the positions of their
tokens in ``token_ids``. `VisionProcessor.check` refuses a row whose image tokens do
not match its images (naming the sample); a sequence cut inside an image is refused
the same way (a cut image has too few tokens).

**Pixels.** `VisionProcessor.pixel_values` runs the model's image processor
(transformers' PIL backend, no torchvision): images -> float32 [N, 3, H, W].
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

_DATA_URL = "data:image/"


def image_part(data: bytes, mime: str = "image/png") -> dict[str, str]:
    """A message part holding an encoded image as a data URL (``{"type": "image", "image": "data:..."}``)."""
    return {"type": "image", "image": f"data:{mime};base64,{base64.b64encode(data).decode()}"}


def decode_image_part(part: dict[str, Any], where: str) -> bytes:
    """The encoded bytes of an image part.

    Raises:
        ValueError: the part's ``image`` is not a base64 data URL of an image (naming ``where``).
    """
    url = part.get("image")
    if not isinstance(url, str) or not url.startswith(_DATA_URL) or ";base64," not in url:
        raise ValueError(f"{where}: an image part's 'image' must be a data:image/...;base64, URL; "
                         f"got {str(url)[:40]!r}")
    return base64.b64decode(url.split(";base64,", 1)[1])


def flatten_messages(messages: Sequence[dict[str, Any]], placeholder: str | None,
                     where: str) -> tuple[list[dict[str, str]], list[bytes]]:
    """Messages with string contents (each image part replaced by ``placeholder``) and the images in order.

    Raises:
        ValueError: an image part and no ``placeholder`` (the model is text-only), or an unknown part type.
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
                    raise ValueError(f"{where}: a message holds an image but the model has no image processor; "
                                     "hint: use a vision-language model (e.g. smollm2-135m-instruct-moe-vlm)")
                images.append(decode_image_part(part, where))
                text.append(placeholder)
            else:
                raise ValueError(f"{where}: message parts must have type 'text' or 'image'; got {kind!r}")
        flat.append({**message, "content": "".join(text)})
    return flat, images


class VisionProcessor:
    """A vision-language model's processor: its image token, image tokens per image, pixels.

    Loaded from the model folder's ``processor_config.json`` (``AutoProcessor``); the
    model's ``config.json`` gives ``image_token_id`` (or ``image_token_index``).

    Raises:
        ValueError: a processor without a fixed number of image tokens per image (naming the folder).
    """

    def __init__(self, model_dir: str | Path) -> None:
        import json

        from transformers import AutoProcessor

        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.image_token_id = int(config.get("image_token_id", config.get("image_token_index")))
        count = getattr(self.processor, "num_image_tokens", None) or config.get("image_seq_length")
        if count is None or getattr(self.processor, "image_token", None) is None:
            raise ValueError(f"{model_dir}: the processor ({type(self.processor).__name__}) has no fixed number of "
                             "image tokens per image (image_seq_length); Molt supports LLaVA-style processors, not "
                             "dynamic resolution (e.g. Qwen-VL) yet")
        self.tokens_per_image, self.placeholder = int(count), str(self.processor.image_token)

    @staticmethod
    def of(model_dir: str | Path) -> VisionProcessor | None:
        """The processor of a vision-language folder, None for a text-only one (no ``processor_config.json``)."""
        return VisionProcessor(model_dir) if (Path(model_dir) / "processor_config.json").is_file() else None

    def expand(self, token_ids: Sequence[int]) -> list[int]:
        """[T'] ids with each image token repeated ``tokens_per_image`` times."""
        out: list[int] = []
        for token in token_ids:
            out += [token] * (self.tokens_per_image if token == self.image_token_id else 1)
        return out

    def collapse(self, token_ids: Sequence[int]) -> list[int]:
        """[T'] ids with each image's ``tokens_per_image`` tokens back to one placeholder (what vLLM
        expands itself). Assumes `check` passed."""
        out, run = [], 0
        for token in token_ids:
            run = run + 1 if token == self.image_token_id else 0
            if token != self.image_token_id or run % self.tokens_per_image == 1 % self.tokens_per_image:
                out.append(token)
        return out

    def positions(self, token_ids: Sequence[int]) -> list[int]:
        """[num_images * tokens_per_image] positions of image tokens in ``token_ids``."""
        return [i for i, t in enumerate(token_ids) if t == self.image_token_id]

    def check(self, token_ids: Sequence[int], num_images: int, sample: str) -> None:
        """Refuse ids whose image tokens do not form ``num_images`` whole images of ``tokens_per_image``.

        Raises:
            ValueError: naming ``sample``, the count of image tokens and the number expected
                (e.g. a sequence truncated inside an image, or an image without its tokens).
        """
        runs, run = [], 0
        for token in [*token_ids, None]:
            if token == self.image_token_id:
                run += 1
            elif run:
                runs.append(run)
                run = 0
        expected = num_images * self.tokens_per_image
        if sum(runs) != expected or any(r % self.tokens_per_image for r in runs):
            raise ValueError(f"sample {sample!r}: {sum(runs)} image tokens (id {self.image_token_id}) for "
                             f"{num_images} image(s) of {self.tokens_per_image} tokens each (expected {expected}); "
                             "hint: a sequence must not be cut inside an image, and every image needs its "
                             "placeholder")

    def pixel_values(self, images: Sequence[bytes]) -> torch.Tensor:
        """float32 [N, 3, H, W] pixels of encoded images, by the model's image processor."""
        pixels = self.processor.image_processor(images=decode_images(images), return_tensors="pt")
        return pixels["pixel_values"].float()


def decode_images(images: Sequence[bytes]) -> list[Any]:
    """PIL RGB images of encoded bytes (what engines are given)."""
    from PIL import Image

    return [Image.open(io.BytesIO(data)).convert("RGB") for data in images]


def row_images(batch: Any) -> list[tuple[bytes, ...]]:
    """[N] each row's images (column ``images``; () when null or absent): rows share a prompt forward
    only when their images are equal too (molt.train.packing ``prompt_keys``)."""
    if "images" not in batch.schema.names:
        return [()] * batch.num_rows
    return [tuple(images or ()) for images in batch.column("images").to_pylist()]


def packed_pixel_values(vision: VisionProcessor | None, rows: Sequence[Sequence[int]],
                        images: Sequence[Sequence[bytes] | None], sample_ids: Sequence[str],
                        token_index: torch.Tensor) -> torch.Tensor | None:
    """float32 [N, 3, H, W] pixels of the images of a packed micro-batch, in packed order; None without images.

    ``rows`` [R] token ids, ``images`` [R] each row's encoded images (None = none), and
    ``token_index`` [sum of row lengths] the packed position of every row token
    (molt.train.packing.PackedSequence): an image shared by rows whose prompt is forwarded
    once sits at one packed position and is given once.

    Raises:
        ValueError: naming the sample, when a row's image tokens do not match its images
            (`VisionProcessor.check`) or a text-only model gets images.
    """
    found: dict[int, bytes] = {}
    offset = 0
    for row, row_images, sample in zip(rows, images, sample_ids):
        row_images = row_images or []
        if vision is None:
            if row_images:
                raise ValueError(f"sample {sample!r}: {len(row_images)} image(s) (column images) for a text-only "
                                 "model; hint: train a vision-language model")
            offset += len(row)
            continue
        vision.check(row, len(row_images), sample)
        positions = vision.positions(row)
        for k, data in enumerate(row_images):
            found.setdefault(int(token_index[offset + positions[k * vision.tokens_per_image]]), data)
        offset += len(row)
    if vision is None or not found:
        return None
    return vision.pixel_values([found[p] for p in sorted(found)])
