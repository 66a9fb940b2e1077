"""``builtin:shapes``: a counting task on images drawn with PIL, generated offline.

Each row is one RGB image (63x63, white background) with 1 to 5 non-overlapping shapes
(circle, square or triangle), each red, green, blue or yellow; the question asks how many
shapes are red, and the answer is that count (an ``int``, possibly 0).  Everything derives
from ``seed`` through one ``random.Random``: the same ``(n, seed)`` gives the same rows and
the same pixels.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["SHAPES_QUESTION", "builtin_shapes", "draw_shapes"]

SHAPES_QUESTION = "How many red shapes are in the image? Answer with the final number after '####'."

_SIZE = 63
_CELL = 21  # a 3x3 grid of 21-pixel cells, at most one shape per cell: shapes never overlap
_CELLS = tuple((x, y) for y in range(0, _SIZE, _CELL) for x in range(0, _SIZE, _CELL))
_COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
_KINDS = ("circle", "square", "triangle")


def draw_shapes(shapes: list[tuple[str, str, int, int, int]]) -> Any:
    """Draw ``(kind, colour, x, y, size)`` shapes (top-left corner, size in pixels) on
    a white 63x63 RGB ``PIL.Image``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (_SIZE, _SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for kind, colour, x, y, size in shapes:
        fill = _COLOURS[colour]
        if kind == "circle":
            draw.ellipse((x, y, x + size, y + size), fill=fill)
        elif kind == "square":
            draw.rectangle((x, y, x + size, y + size), fill=fill)
        else:
            draw.polygon(((x + size / 2, y), (x, y + size), (x + size, y + size)), fill=fill)
    return image


def builtin_shapes(n: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` workflow items of the shapes task.

    Each item: ``images`` (a one-element list holding a 63x63 RGB ``PIL.Image``),
    ``messages`` (one user turn: ``[{"type": "image"}, {"type": "text", "text": question}]``),
    ``question`` (str), ``answer`` (int, the number of red shapes), ``shapes`` (the
    drawn ``(kind, colour)`` pairs, for inspection).
    """
    rng = random.Random(f"shapes:{seed}")
    items = []
    for _ in range(n):
        k = rng.randint(1, 5)
        specs = []
        for x0, y0 in rng.sample(_CELLS, k):
            size = rng.randint(10, 17)
            x, y = x0 + rng.randint(1, _CELL - size - 1), y0 + rng.randint(1, _CELL - size - 1)
            specs.append((rng.choice(_KINDS), rng.choice(tuple(_COLOURS)), x, y, size))
        answer = sum(colour == "red" for _, colour, *_ in specs)
        items.append({
            "images": [draw_shapes(specs)],
            "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": SHAPES_QUESTION}]}],
            "question": SHAPES_QUESTION,
            "answer": answer,
            "shapes": [(kind, colour) for kind, colour, *_ in specs],
        })
    return items
