"""Text rendered with a real TrueType font (DejaVu, Debian package fonts-dejavu-core) for the OCR tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")


def font(size: int, *, bold: bool = False) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(str(FONT_DIR / ("DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf")), size)


def render(
    text: str,
    *,
    size: tuple[int, int] = (512, 512),
    font_size: int = 40,
    background: Image.Image | None = None,
    angle: float = 0.0,
    bold: bool = False,
) -> np.ndarray:
    """Dark text centred on a white (or given) background, optionally rotated, as uint8 RGB."""
    typeface = font(font_size, bold=bold)
    image = background.copy() if background is not None else Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=typeface)
    origin = ((image.width - (right - left)) // 2 - left, (image.height - (bottom - top)) // 2 - top)
    draw.text(origin, text, font=typeface, fill=(20, 20, 60))
    if angle:
        image = image.rotate(angle, resample=Image.Resampling.BICUBIC, fillcolor="white")
    return np.asarray(image)


def ink_box(image: np.ndarray) -> tuple[int, int, int, int]:
    """``(top, bottom, left, right)`` of the dark pixels (the text) of a light image; bottom/right exclusive."""
    rows, cols = np.nonzero(image.min(axis=2) < 128)
    return int(rows.min()), int(rows.max()) + 1, int(cols.min()), int(cols.max()) + 1
