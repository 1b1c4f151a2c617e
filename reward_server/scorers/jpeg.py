"""``jpeg_compressibility``: minus the JPEG size of the image in kB, as in DDPO (Black et al., 2023).

The image is saved with PIL at quality 95 (grayscale images as 8-bit grayscale JPEG, RGB as RGB) and
the score is ``-len(bytes) / 1000``: higher means more compressible (flatter) images. The range is
``(-inf, 0]`` and depends on the image size, as in DDPO. Departures: none (Flow-GRPO's variant further
divides by 500: scale the reward weight by 1/500 for its numbers).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

JPEG_QUALITY = 95


def jpeg_size_kb(image: np.ndarray, quality: int = JPEG_QUALITY) -> float:
    """Size in kB (1000 bytes) of ``image`` (uint8 ``[H, W, C]``, C = 1 or 3) saved as JPEG."""
    buffer = io.BytesIO()
    Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


class JpegCompressibilityScorer:
    """Negative JPEG size in kB at quality 95 (DDPO's compressibility reward)."""

    name = "jpeg_compressibility"
    description = "-(JPEG size in kB at quality 95), as in DDPO"
    score_range = (None, 0.0)
    version = f"jpeg-q{JPEG_QUALITY}-pil-v1"

    def load(self) -> None:
        """Nothing to load."""

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return [-jpeg_size_kb(image) for image in images]
