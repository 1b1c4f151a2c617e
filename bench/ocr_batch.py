"""Images per second of the ``ocr`` scorer on one request of 10 rendered text images (CPU, RapidOCR).

    python bench/ocr_batch.py [--repeats 5] [--size 512]

Rows: ``per image``: RapidOCR called on each image in turn (the scorer before cross-image recognition);
``batched``: the backend's ``read`` (per-image detection, one recognition call for all text lines); and
``scorer``: ``OcrScorer.score`` (batched read plus the border around each image); ``det alone`` and
``det batch``: the detection network alone, one image per call or all in one call. Best and median of
the repeats, the rows interleaved.

Measured on the shared 2-core CPU (load average 14-17 from other jobs, so only ratios within one run
mean much), 9 repeats, median images/s: per image 2.63, batched 3.37 (1.28x), scorer 2.94 (1.12x over
the old per-image path: the 16 px border makes the detector read 544x544 instead of 512x512); the
detector alone 5.02 one image per call and 3.42 in one batch of 10, so detection stays per image. An
earlier run: 2.16 / 2.48 / 2.28. Recognition with RapidOCR's batch of 6 lines vs 1 line per call was
within the noise, so its default is kept.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from text_images import render  # noqa: E402

from reward_server.scorers.ocr import OcrScorer  # noqa: E402

WORDS = [
    "Spring Collection 2024",
    "OPEN",
    "Step Goal Achieved",
    "Sale 50% off",
    "HELLO WORLD",
    "Azir",
    "Caffe Latte",
    "Emergency Exit",
    "Welcome Home",
    "No Parking Here",
]


def timings(rows: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each row, the rows interleaved so that a change of machine load hits all."""
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, run in rows.items():
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", type=int, default=512, help="square image side in pixels")
    args = parser.parse_args()
    images = [render(word, size=(args.size, args.size), font_size=40) for word in WORDS]
    scorer = OcrScorer()
    scorer.load()
    backend = scorer._backend
    engine = backend._engine  # type: ignore[union-attr]
    prompts = [f'"{word}"' for word in WORDS]
    rows = {
        "per image": lambda: [engine(np.ascontiguousarray(image[:, :, ::-1])) for image in images],
        "batched": lambda: backend.read(images),  # type: ignore[union-attr]
        "scorer": lambda: scorer.score(images, prompts, [{}] * len(images)),
    }
    # The detector alone, one image per call vs all in one batch (why detection stays per image).
    detector = engine.text_det
    inputs = [detector.get_preprocess()(np.ascontiguousarray(image[:, :, ::-1])) for image in images]
    rows["det alone"] = lambda: [detector.session(x) for x in inputs]
    rows["det batch"] = lambda: detector.session(np.concatenate(inputs))
    scores = [outcome.score for outcome in scorer.score(images, prompts, [{}] * len(images))]
    print(f"{len(images)} images of {args.size}x{args.size}, {args.repeats} repeats, load {os.getloadavg()[0]:.1f}")
    print(f"scores: {scores}")
    for name, seconds in timings(rows, args.repeats).items():
        best, median = min(seconds), float(np.median(seconds))
        print(f"{name:10s} best {len(images) / best:5.2f} images/s, median {len(images) / median:5.2f} images/s")


if __name__ == "__main__":
    main()
