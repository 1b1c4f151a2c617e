"""What a run's image outputs cost rank 0: an evaluation grid and the rollout samples at real sizes, written as the
trainer writes them (RunLogger, TensorBoard on), against PIL's default PNG encoding that grids used before.

    python bench/outputs.py [--side 512] [--prompts 16] [--samples 8] [--repeats 3]

Images are smoothed noise: harder to compress than photographs, so the times are upper bounds. Prints a markdown
table: seconds (median of repeats) and file MB per output.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from trainer.logging import RunLogger, grid_pixels, to_uint8  # noqa: E402


def _images(n: int, side: int) -> torch.Tensor:
    noise = torch.rand(n, 3, side, side, generator=torch.Generator().manual_seed(0))
    return torch.nn.functional.avg_pool2d(noise, 9, 1, 4).clamp(0, 1)


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=16, help="evaluation grid rows (one sample each)")
    parser.add_argument("--samples", type=int, default=8, help="rollout samples logged (logging.rollout_samples)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    grid, samples = _images(args.prompts, args.side), _images(args.samples, args.side)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        logger = RunLogger(Path(tmp), True, True)

        def before() -> int:  # PIL's default level, then TensorBoard encoding the pixels again, as before
            pixels = grid_pixels(to_uint8(grid), args.prompts)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="PNG")
            logger.trackers[0].writers["rl"].add_image("before", pixels, 0, dataformats="HWC")
            return buffer.tell()

        rows.append(
            (
                "evaluation grid, PNG level 6 + TensorBoard re-encoding (before)",
                _timed(before, args.repeats),
                before() / 1e6,
            )
        )
        rows.append(
            (
                "evaluation grid, PNG level 1, its bytes to TensorBoard (now)",
                _timed(lambda: logger.image_grid("grid", grid, args.prompts, 0), args.repeats),
                os.path.getsize(Path(tmp) / "grid.png") / 1e6,
            )
        )
        scores = {"a": [0.5] * args.samples, "b": [0.5] * args.samples}
        rows.append(
            (
                f"rollout samples ({args.samples}), JPEG q90, TensorBoard",
                _timed(
                    lambda: logger.rollout_samples(1, samples, ["p"] * args.samples, [0.5] * args.samples, scores),
                    args.repeats,
                ),
                os.path.getsize(Path(tmp) / "rollouts" / "epoch0001.jpg") / 1e6,
            )
        )
        logger.trackers[0].close()
    print(f"{args.prompts} evaluation prompts and {args.samples} rollout samples at {args.side} px, one thread:\n")
    print("| output | s | MB |\n|---|---|---|")
    for name, seconds, mb in rows:
        print(f"| {name} | {seconds:.2f} | {mb:.3f} |")


if __name__ == "__main__":
    main()
