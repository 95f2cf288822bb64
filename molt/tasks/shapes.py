"""Count-and-colour pictures drawn by the project: seeded, reproducible, split-safe.

Each record shows a ``image_size`` x ``image_size`` (64) RGB PNG on white with 1 to 4
shapes (circle, square, triangle; each 14-20 px across, never touching: at least
``_GAP_PX`` white pixels between bounding boxes), all of one saturated colour
(red, green, blue, yellow), and asks::

    How many shapes are in the image, and what colour are they? Answer like: 3 red

The answer is ``"{count} {colour}"``, e.g. ``"3 red"``; count and colour are drawn
uniformly. Shapes are drawn without anti-aliasing, so every non-white pixel has
exactly the colour of the answer.

**Seeding** is arithmetic's (:mod:`molt.tasks.arithmetic`): scene ``i`` of a split is
drawn by ``random.Random(f"{seed}:{i}:{j}")`` for the first ``j`` = 0, 1, ... whose
scene falls in that split, so a record depends only on (seed, split, i), and its PNG
bytes are the same on every call.

**Splits never overlap.** The split of a scene is decided by a hash of its canonical
form (colour, then the shapes sorted, each ``kind@x,y,size``): ``eval`` iff
``sha256(canonical) / 2**64 < eval_fraction`` (first 8 bytes), so no eval image is
ever a train image, whatever the seeds. Answers (16 of them) are shared by both splits.

**Chance level.** Guessing uniformly among 4 counts x 4 colours: 1/16 = 6.25%; since
counts and colours are uniform, any constant answer scores the same in expectation
(measured over 4000 train records, seed 0: uniform guessing 6.7%, constant answers
5.2%-7.1%).
"""

from __future__ import annotations

import hashlib
import io
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from molt.models.images import image_part
from molt.tasks.records import Record

#: Saturated RGB (one channel 0) of each colour, as drawn.
COLOURS = {"red": (230, 0, 0), "green": (0, 170, 0), "blue": (0, 0, 230), "yellow": (240, 200, 0)}
KINDS = ("circle", "square", "triangle")
QUESTION = "How many shapes are in the image, and what colour are they? Answer like: 3 red"
_MIN_SIZE_PX, _MAX_SIZE_PX = 14, 20
_GAP_PX = 2  # white pixels kept between shapes' boxes, so each shape is its own blob
_MAX_DRAWS = 10_000
_MAX_PLACEMENTS = 1_000

#: One shape: (kind, x, y, size), the top-left corner and side of its bounding box in px.
Shape = tuple[str, int, int, int]


def canonical(colour: str, shapes: Sequence[Sequence[Any]]) -> str:
    """The scene's identity for splitting: ``canonical("red", [("square", 30, 4, 16), ("circle", 2, 9, 14)])``
    -> ``"red|circle@2,9,14|square@30,4,16"`` (shape order plays no part)."""
    return "|".join([colour, *sorted(f"{k}@{x},{y},{s}" for k, x, y, s in shapes)])


def split_of(colour: str, shapes: list[Shape], eval_fraction: float) -> str:
    """``"eval"`` for a fixed ``eval_fraction`` share of all scenes, else ``"train"``."""
    digest = hashlib.sha256(canonical(colour, shapes).encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction else "train"


def _apart(a: Shape, b: Shape) -> bool:
    """Whether two bounding boxes are at least ``_GAP_PX`` apart on some axis."""
    _, ax, ay, asz = a
    _, bx, by, bsz = b
    return (ax + asz + _GAP_PX <= bx or bx + bsz + _GAP_PX <= ax
            or ay + asz + _GAP_PX <= by or by + bsz + _GAP_PX <= ay)


def place_shapes(rng: random.Random, count: int, image_size: int) -> list[Shape] | None:
    """``count`` shapes inside the image (1 px margin), pairwise apart; None if
    ``_MAX_PLACEMENTS`` tries were not enough (the image is too small)."""
    shapes: list[Shape] = []
    for _ in range(_MAX_PLACEMENTS):
        if len(shapes) == count:
            break
        size = rng.randint(_MIN_SIZE_PX, _MAX_SIZE_PX)
        if image_size - size - 1 < 1:
            return None
        x, y = rng.randint(1, image_size - size - 1), rng.randint(1, image_size - size - 1)
        shape = (rng.choice(KINDS), x, y, size)
        if all(_apart(shape, other) for other in shapes):
            shapes.append(shape)
    return shapes if len(shapes) == count else None


def draw_png(colour: str, shapes: list[Shape], image_size: int) -> bytes:
    """PNG bytes of the scene: white RGB, each shape filled in ``COLOURS[colour]``, no
    anti-aliasing; the same scene always gives the same bytes (fixed encoder options)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (image_size, image_size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    for kind, x, y, size in shapes:
        x1, y1 = x + size - 1, y + size - 1
        if kind == "circle":
            pen.ellipse((x, y, x1, y1), fill=fill)
        elif kind == "square":
            pen.rectangle((x, y, x1, y1), fill=fill)
        else:
            pen.polygon([(x, y1), (x1, y1), ((x + x1) / 2, y)], fill=fill)
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False, compress_level=9)
    return buf.getvalue()


@dataclass(frozen=True)
class ShapeProblems:
    """Scene ``i`` of one split, for ``0 <= i < num_records`` (None = unbounded).

    Example: ``ShapeProblems(seed=0).record(0)`` -> ``{"prompt_id": "shapes-train-s0-0",
    "messages": [{"role": "user", "content": [{"type": "image", "image": "data:image/png;
    base64,..."}, {"type": "text", "text": QUESTION}]}], "answer": "3 yellow", "task":
    "shapes", "split": "train", "count": 3, "colour": "yellow", "shapes": [["triangle", 22,
    39, 20], ["circle", 22, 15, 18], ["circle", 4, 7, 16]]}``; the same call always returns
    the same record (and the same PNG bytes).
    """

    seed: int = 0
    num_records: int | None = 1000
    split: str = "train"
    min_shapes: int = 1
    max_shapes: int = 4
    image_size: int = 64
    eval_fraction: float = 0.1
    skipped: tuple[str, ...] = ()

    def record(self, index: int) -> Record:
        """The record of scene ``index``.

        Raises:
            ValueError: no scene of this split in ``_MAX_DRAWS`` draws, or the shapes do
                not fit in the image.
        """
        for j in range(_MAX_DRAWS):
            rng = random.Random(f"{self.seed}:{index}:{j}")
            count = rng.randint(self.min_shapes, self.max_shapes)
            colour = rng.choice(tuple(COLOURS))
            shapes = place_shapes(rng, count, self.image_size)
            if shapes is None:
                raise ValueError(f"shapes task: {count} shapes of up to {_MAX_SIZE_PX} px do not fit in "
                                 f"image_size {self.image_size}; hint: lower max_shapes or raise image_size")
            if split_of(colour, shapes, self.eval_fraction) == self.split:
                return self._record(index, count, colour, shapes)
        raise ValueError(f"shapes task: no {self.split!r} scene in {_MAX_DRAWS} draws; got eval_fraction "
                         f"{self.eval_fraction}; hint: use a split of 'train' or 'eval' and 0 < eval_fraction < 1")

    def _record(self, index: int, count: int, colour: str, shapes: list[Shape]) -> Record:
        png = draw_png(colour, shapes, self.image_size)
        content = [image_part(png), {"type": "text", "text": QUESTION}]
        return {"prompt_id": f"shapes-{self.split}-s{self.seed}-{index}",
                "messages": [{"role": "user", "content": content}], "answer": f"{count} {colour}",
                "task": "shapes", "split": self.split, "count": count, "colour": colour,
                "shapes": [list(s) for s in shapes]}
