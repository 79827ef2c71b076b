"""Generated test images (no downloads): Pillow-drawn shapes, gradients and text, encoded as bytes."""

from __future__ import annotations

import io
import random

from PIL import Image, ImageDraw

FORMATS = ("JPEG", "PNG", "WEBP")


def drawn_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A gradient background with a few shapes and a line of text, different per ``seed``."""
    rng = random.Random(seed)
    gradient = Image.linear_gradient("L").resize((width, height))
    image = Image.merge("RGB", (gradient, gradient.transpose(Image.Transpose.FLIP_LEFT_RIGHT),
                                Image.new("L", (width, height), rng.randrange(256))))
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = min(width - 1, x0 + rng.randrange(1, width + 1)), min(height - 1, y0 + rng.randrange(1, height + 1))
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, max(x0, x1), max(y0, y1)), fill=colour)
    if width >= 20 and height >= 12:
        draw.text((2, 2), f"img {seed}", fill=(255, 255, 255))
    if mode != "RGB":
        image = image.convert(mode)
    return image


def encode(image: Image.Image, image_format: str, **save_options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, image_format, **save_options)
    return buffer.getvalue()


def image_bytes(width: int, height: int, image_format: str = "PNG", seed: int = 0, mode: str = "RGB") -> bytes:
    """Encoded bytes of :func:`drawn_image` (lossless WebP, so tests can compare pixels)."""
    options = {"lossless": True} if image_format == "WEBP" else {}
    return encode(drawn_image(width, height, seed, mode), image_format, **options)
