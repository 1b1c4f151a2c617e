"""The embedded text task: render a short word named in the prompt, judged by the served ``ocr`` scorer (PP-OCR).

Supervised examples are the vocabulary's words drawn with Debian's DejaVu fonts, dark on white; the warm-up
is short, so that PP-OCR reads its renderings only sometimes and RL has room to sharpen them. One prompt per word,
as digits has one per class: the evaluation asks for every word, and its held-out part is the fixed noise (a
phrasing the warm-up never saw does not transfer through the tiny random text encoders: bench/RESULTS.md).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import torch

from trainer.models.base import ImageInputs

FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")
FONTS = ("DejaVuSansMono-Bold.ttf",)
"""Faces of the supervised renders, each at the largest size at which every word fits the image. One face, one
position: at 16 pixels the tiny model learns one rendering per word in a few hundred steps, a blend of faces and
shifts in many more (bench/RESULTS.md); Sans and Serif Bold must also shrink to 5-6 points, which PP-OCR misreads."""
VOCABULARY = (
    "cat",
    "dog",
    "sun",
    "red",
    "box",
    "car",
    "hat",
    "pen",
    "cup",
    "map",
    "bus",
    "fox",
    "key",
    "egg",
    "ice",
    "owl",
)
"""Three-letter words whose letters the tiny model's tokenizer knows (no j or q)."""
TEMPLATE = "the text {word}"
SHIFTS = ((0, 0),)
"""Pixel offsets (x, y) of the supervised renders from the centre."""
MARGIN_PX = 1
EXACT = 1.0 - 1e-6
"""An ``ocr`` score at least this is an exact match (the scorer's 1 - distance / length is 1 only then)."""


@cache
def _font(name: str, size: int):
    from PIL import ImageFont

    path = FONT_DIR / name
    if not path.is_file():
        raise ValueError(f"the words task renders with {path}, which is missing: install Debian's fonts-dejavu-core")
    return ImageFont.truetype(str(path), size)


@cache
def fitting_size(face: str, side: int, words: tuple[str, ...]) -> int:
    """The largest font size at which every word of ``words`` fits ``side`` pixels less a margin each way."""
    from PIL import Image, ImageDraw

    draw = ImageDraw.Draw(Image.new("L", (side, side)))
    for size in range(side, 3, -1):
        boxes = [draw.textbbox((0, 0), w, font=_font(face, size)) for w in words]
        if all(r - left <= side - 2 * MARGIN_PX and b - t <= side - 2 * MARGIN_PX for left, t, r, b in boxes):
            return size
    raise ValueError(f"data.image_size={side} is too small to render the words task's vocabulary; use 16 or more")


def render_word(word: str, side: int, face: str = FONTS[0], shift: tuple[int, int] = (0, 0)) -> np.ndarray:
    """``word`` centred (then moved by ``shift`` pixels, x and y) dark on white: float32 [side, side] in [0, 1]."""
    from PIL import Image, ImageDraw

    font = _font(face, fitting_size(face, side, VOCABULARY))
    image = Image.new("L", (side, side), 255)
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    origin = ((side - (right - left)) // 2 - left + shift[0], (side - (bottom - top)) // 2 - top + shift[1])
    draw.text(origin, word, font=font, fill=0)
    return np.asarray(image, dtype=np.float32) / 255.0


class WordsTask:
    """Render the word named in the prompt; metrics are read off the ``ocr`` scores of the images."""

    metric_names = ("ocr_accuracy", "ocr_score")
    metric_scorers = ("ocr",)
    holds_out = False
    supervises = True

    def __init__(self, image_size: int):
        self.words = list(VOCABULARY)
        self.prompts = [TEMPLATE.format(word=w) for w in self.words]
        self.eval_indices = list(range(len(self.prompts)))
        self.eval_prompts = list(self.prompts)
        self._word = {p: p.rsplit(" ", 1)[1] for p in self.prompts}
        # every word in every face and shift: [words, faces * shifts, 1, H, W]
        self._images = torch.from_numpy(
            np.stack(
                [np.stack([render_word(w, image_size, face, s) for face in FONTS for s in SHIFTS]) for w in self.words]
            )
        ).unsqueeze(2)

    def item_key(self, index: int) -> str:
        return self.prompts[index]

    def item_metadata(self, indices: list[int]) -> list[dict]:
        """The word as the ``ocr`` scorer's target text."""
        return [{"text": self._word[self.prompts[i]]} for i in indices]

    def inputs(self, indices: list[int]) -> ImageInputs | None:
        return None

    def supervised_batch(self, batch_size: int, generator: torch.Generator, step: int = 0):
        """Renders of random words in random faces and shifts, with their prompts."""
        from trainer.data.task import SupervisedBatch

        word = torch.randint(len(self.words), (batch_size,), generator=generator)
        style = torch.randint(self._images.shape[1], (batch_size,), generator=generator)
        return SupervisedBatch(self._images[word, style], [self.prompts[w] for w in word.tolist()])

    def metrics(self, images: torch.Tensor, prompts: list[str], scores: dict[str, np.ndarray]) -> dict[str, float]:
        """Exact-match share (an ``ocr`` score of 1: PP-OCR read the word; a failed score is a miss) and mean
        of the ``ocr`` scores; NaN when nothing scored with ``ocr`` (put it in reward.weights or eval.alarm_scorers)."""
        ocr = np.asarray(scores.get("ocr", []), dtype=np.float64)
        if not len(ocr):
            return {name: float("nan") for name in self.metric_names}
        return {"ocr_accuracy": float(np.mean(ocr >= EXACT)), "ocr_score": float(np.nanmean(ocr))}
