"""Count-and-colour pictures, generated: seeded, reproducible, split-safe.

A 64 px PNG on white holds 1 to 4 shapes (circle, square, triangle; 14-20 px, apart) of one
colour, without anti-aliasing; the answer is ``"{count} {colour}"``, e.g. ``"3 red"``. Seeding
is arithmetic.py's; a scene's split is ``split_of(canonical(colour, shapes))`` (records.py).
"""

from __future__ import annotations

import io
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from molt.models.images import image_part
from molt.tasks.records import Record, split_of

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
    """The scene's identity for splitting, in any order of shapes: ``"red|circle@2,9,14|..."``."""
    return "|".join([colour, *sorted(f"{k}@{x},{y},{s}" for k, x, y, s in shapes)])


def _apart(a: Shape, b: Shape) -> bool:
    _, ax, ay, asz = a
    _, bx, by, bsz = b
    return (ax + asz + _GAP_PX <= bx or bx + bsz + _GAP_PX <= ax
            or ay + asz + _GAP_PX <= by or by + bsz + _GAP_PX <= ay)


def place_shapes(rng: random.Random, count: int, image_size: int) -> list[Shape] | None:
    """``count`` shapes inside the image (1 px margin), pairwise apart; None if they do not fit."""
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
    """PNG bytes of the scene; the same scene always gives the same bytes."""
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
    """Scene ``i`` of one split, for ``0 <= i < num_records`` (None = unbounded): a record
    whose message holds the image and `QUESTION`, with fields ``count``, ``colour`` and
    ``shapes`` besides."""

    seed: int = 0
    num_records: int | None = 1000
    split: str = "train"
    min_shapes: int = 1
    max_shapes: int = 4
    image_size: int = 64
    skipped: tuple[str, ...] = ()

    def record(self, index: int) -> Record:
        """The record of scene ``index``.

        Raises:
            ValueError: no scene of this split in ``_MAX_DRAWS`` draws, or the shapes do not fit.
        """
        for j in range(_MAX_DRAWS):
            rng = random.Random(f"{self.seed}:{index}:{j}")
            count = rng.randint(self.min_shapes, self.max_shapes)
            colour = rng.choice(tuple(COLOURS))
            shapes = place_shapes(rng, count, self.image_size)
            if shapes is None:
                raise ValueError(f"shapes task: {count} shapes of up to {_MAX_SIZE_PX} px do not "
                                 f"fit in image_size {self.image_size}; hint: lower max_shapes or "
                                 "raise image_size")
            if split_of(canonical(colour, shapes)) == self.split:
                return self._record(index, count, colour, shapes)
        raise ValueError(f"shapes task: no {self.split!r} scene in {_MAX_DRAWS} draws; hint: use "
                         "a split of 'train' or 'eval'")

    def num_distinct(self) -> int | None:
        """None: too many scenes to count."""
        return None

    def _record(self, index: int, count: int, colour: str, shapes: list[Shape]) -> Record:
        png = draw_png(colour, shapes, self.image_size)
        content = [image_part(png), {"type": "text", "text": QUESTION}]
        return {"prompt_id": f"shapes-{self.split}-s{self.seed}-{index}",
                "messages": [{"role": "user", "content": content}], "answer": f"{count} {colour}",
                "task": "shapes", "split": self.split, "count": count, "colour": colour,
                "shapes": [list(s) for s in shapes]}
