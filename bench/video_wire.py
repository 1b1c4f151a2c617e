"""Bytes and encode+decode time of one video clip on the reward wire, per lossless encoding; prints a table.

    python bench/video_wire.py                  # 33 frames of 480x832 RGB (Wan's default clip), 3 repeats

The clip (:func:`synthetic_clip`, seeded) stands in for a generated video: a smooth two-colour gradient sky that
drifts, a camera pan over a textured ground (sums of sines: sharp detail, no noise) and a shaded ball moving across
it. Noise-free on purpose: a diffusion model's frames are smooth and coherent from one frame to the next, and
random noise would make every codec look alike (incompressible).

Encodings (each checked lossless, pixel for pixel):

* ``png``: every frame a PNG at zlib level 1 (what :func:`shared.imagecodec.encode_image` writes), as the JSON path
  and the debug page send frames.
* ``raw``: the uint8 pixels (the msgpack body's ``raw`` frames), uncompressed.
* ``raw+zstd-1`` / ``raw+zstd-3``: the clip's pixels compressed as one zstd frame, as ``Content-Encoding: zstd``
  compresses a msgpack body (``reward.wire_format=msgpack+zstd``).
* ``ffv1``: the clip encoded with FFmpeg's lossless FFV1 codec in an AVI container, through the FFmpeg that the
  opencv-python wheel bundles (no system package), written to and read from a temporary file.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zstandard
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def synthetic_clip(frames: int = 33, height: int = 480, width: int = 832, seed: int = 0) -> np.ndarray:
    """A seeded, noise-free moving scene as uint8 [F, H, W, 3] (see the module docstring)."""
    rng = np.random.default_rng(seed)
    sky_top, sky_bottom = rng.uniform(0.3, 1.0, 3), rng.uniform(0.0, 0.6, 3)
    freqs = rng.uniform(0.02, 0.15, (4, 2))
    phases = rng.uniform(0, 2 * np.pi, 4)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    horizon = int(height * 0.45)
    clip = np.empty((frames, height, width, 3), dtype=np.uint8)
    for f in range(frames):
        t = f / max(frames - 1, 1)
        shade = (yy / height + 0.1 * np.sin(2 * np.pi * (xx / width + t)))[..., None]
        frame = sky_top * (1 - shade) + sky_bottom * shade
        pan = 60.0 * t * width / 832
        texture = sum(np.sin(fx * (xx + pan) + fy * yy * 1.5 + p) for (fx, fy), p in zip(freqs, phases, strict=True))
        ground = (0.45 + 0.08 * texture)[..., None] * np.array([0.6, 0.5, 0.3], np.float32)
        frame = np.where((yy >= horizon)[..., None], ground, frame)
        cx, cy, radius = width * (0.2 + 0.6 * t), height * (0.6 - 0.2 * np.sin(np.pi * t)), height * 0.12
        dist = np.sqrt((xx - cx) ** 2 + (yy - cy) ** 2) / radius
        ball = np.clip(1.0 - dist, 0, 1)[..., None] ** 0.5 * np.array([0.9, 0.2, 0.2], np.float32)
        frame = np.where((dist < 1.0)[..., None], ball + 0.1, frame)
        clip[f] = np.clip(frame * 255.0 + 0.5, 0, 255).astype(np.uint8)
    return clip


def _png(clip: np.ndarray) -> tuple[Callable[[], list[bytes]], Callable[[list[bytes]], np.ndarray]]:
    def encode() -> list[bytes]:
        out = []
        for frame in clip:
            buffer = io.BytesIO()
            Image.fromarray(frame).save(buffer, format="PNG", compress_level=1)
            out.append(buffer.getvalue())
        return out

    def decode(files: list[bytes]) -> np.ndarray:
        return np.stack([np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) for data in files])

    return encode, decode


def _zstd(clip: np.ndarray, level: int) -> tuple[Callable[[], bytes], Callable[[bytes], np.ndarray]]:
    def encode() -> bytes:
        return zstandard.ZstdCompressor(level=level).compress(clip.tobytes())

    def decode(data: bytes) -> np.ndarray:
        return np.frombuffer(zstandard.ZstdDecompressor().decompress(data), np.uint8).reshape(clip.shape)

    return encode, decode


def _ffv1(clip: np.ndarray) -> tuple[Callable[[], bytes], Callable[[bytes], np.ndarray]] | None:
    try:
        import cv2
    except ImportError:
        return None
    frames, height, width, _ = clip.shape

    def encode() -> bytes:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "clip.avi")
            writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"FFV1"), 16, (width, height))
            if not writer.isOpened():
                raise RuntimeError("this OpenCV has no FFV1 encoder")
            for frame in clip:
                writer.write(np.ascontiguousarray(frame[:, :, ::-1]))  # OpenCV writes BGR
            writer.release()
            return Path(path).read_bytes()

    def decode(data: bytes) -> np.ndarray:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "clip.avi")
            Path(path).write_bytes(data)
            capture = cv2.VideoCapture(path)
            out = []
            while True:
                ok, frame = capture.read()
                if not ok:
                    break
                out.append(frame[:, :, ::-1])
            capture.release()
        return np.stack(out)

    return encode, decode


def measure(clip: np.ndarray, repeats: int) -> list[tuple[str, int, float, float]]:
    """(encoding, bytes, encode ms, decode ms) per encoding, the best of ``repeats``; each round trip checked."""
    codecs: dict[str, tuple[Callable, Callable] | None] = {
        "png (per frame, zlib 1)": _png(clip),
        "raw uint8": (lambda: clip.tobytes(), lambda d: np.frombuffer(d, np.uint8).reshape(clip.shape)),
        "raw + zstd 1": _zstd(clip, 1),
        "raw + zstd 3": _zstd(clip, 3),
        "ffv1 in avi (cv2)": _ffv1(clip),
    }
    rows = []
    for name, codec in codecs.items():
        if codec is None:
            print(f"{name}: unavailable (no cv2)")
            continue
        encode, decode = codec
        best_encode = best_decode = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            data = encode()
            encoded = time.perf_counter()
            back = decode(data)
            best_encode = min(best_encode, encoded - started)
            best_decode = min(best_decode, time.perf_counter() - encoded)
        if not np.array_equal(back, clip):
            raise AssertionError(f"{name} is not lossless on this clip")
        size = sum(map(len, data)) if isinstance(data, list) else len(data)
        rows.append((name, size, best_encode * 1000, best_decode * 1000))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    clip = synthetic_clip(args.frames, args.height, args.width)
    raw = clip.nbytes
    print(
        f"clip: {args.frames} x {args.height}x{args.width} RGB, {raw / 1e6:.1f} MB raw; load {os.getloadavg()[0]:.1f}"
    )
    print("| encoding | bytes | ratio to raw | encode ms | decode ms | lossless |")
    print("|---|---|---|---|---|---|")
    for name, size, encode_ms, decode_ms in measure(clip, args.repeats):
        print(f"| {name} | {size / 1e6:.2f} MB | {size / raw:.3f} | {encode_ms:.0f} | {decode_ms:.0f} | yes |")


if __name__ == "__main__":
    main()
