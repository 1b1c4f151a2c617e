"""Benchmark the reward pool over loopback HTTP and print tables.

    python bench/reward_pool.py                     # everything (a few minutes on 2 cores)
    python bench/reward_pool.py --only scaling      # or: ocr, wire

* ``scaling``: images/s and per-request p50/p99 latency for 1, 2 and 4 replicas of the ``sleep`` scorer
  (holds each micro-batch ``--sleep-ms``, standing in for a GPU model), fed by concurrent client loops;
  scaling efficiency = throughput(N) / (N * throughput(1)).
* ``ocr``: the same for the real ``ocr`` scorer (RapidOCR on the CPU), 1 and 2 replicas, if installed.
* ``wire``: per 512x512 RGB image, end-to-end ms of ``HttpRewardClient.score`` for each wire format
  (sleep scorer at 0 ms, one replica), the CPU time the client and the server processes spent, the
  client's encode ms (compression included), the server's handler ms (body read, decompress, parse,
  decode, score) and the share of the total spent outside the scorer (encode, transport, parsing).
  On a loaded machine the wall-clock figures vary a lot; the CPU columns much less.

Numbers depend on the machine's load: the table header prints the load average.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.wire import compress_body  # noqa: E402
from trainer.rewards import HttpRewardClient, LocalRewardPool  # noqa: E402
from trainer.rewards.wire import WIRE_FORMATS  # noqa: E402


@dataclass
class LoadResult:
    images_per_s: float
    p50_ms: float
    p99_ms: float
    num_requests: int


def generated_looking(count: int, side: int, seed: int = 0) -> np.ndarray:
    """uint8 ``[B, side, side, 3]``: smooth low-frequency colour fields plus mild noise, like decoded latents."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:side, 0:side] / side
    images = np.empty((count, side, side, 3), np.uint8)
    for b in range(count):
        field = np.zeros((side, side, 3))
        for _ in range(4):
            fx, fy, phase = rng.uniform(0.5, 4, 2).tolist() + [rng.uniform(0, 6.28)]
            field += rng.uniform(20, 60, 3) * np.sin(2 * np.pi * (fx * xx + fy * yy) + phase)[..., None]
        field += 128 + rng.normal(0, 3, field.shape)
        images[b] = np.clip(field, 0, 255).astype(np.uint8)
    return images


def text_images(count: int) -> tuple[np.ndarray, list[str]]:
    """uint8 ``[B, 96, 384, 3]`` with a word in black on white, and prompts quoting the word."""
    from PIL import Image, ImageDraw, ImageFont

    words = ["REWARD", "FLOW", "STOP", "OPEN", "HELLO", "WORLD", "TRAIN", "SCORE"]
    font = ImageFont.load_default(size=48)
    images, prompts = [], []
    for i in range(count):
        word = words[i % len(words)]
        image = Image.new("RGB", (384, 96), "white")
        ImageDraw.Draw(image).text((20, 20), word, fill="black", font=font)
        images.append(np.asarray(image))
        prompts.append(f'a sign that says "{word}"')
    return np.stack(images), prompts


def drive(
    client: HttpRewardClient,
    images: np.ndarray,
    prompts: list[str],
    *,
    loops: int,
    seconds: float,
    warmup_s: float = 1.0,
) -> LoadResult:
    """``loops`` threads call ``client.score`` back to back for ``seconds`` (after a warm-up)."""
    latencies: list[float] = []
    lock = threading.Lock()
    start_at = time.monotonic() + warmup_s
    stop_at = start_at + seconds

    def loop() -> None:
        while (now := time.monotonic()) < stop_at:
            result = client.score(images, prompts)
            assert result.num_failed == 0, result.errors
            if now >= start_at:
                with lock:
                    latencies.append(time.monotonic() - now)

    threads = [threading.Thread(target=loop) for _ in range(loops)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = max(time.monotonic(), stop_at) - start_at
    return LoadResult(
        images_per_s=len(latencies) * len(images) / elapsed,
        p50_ms=1000 * float(np.percentile(latencies, 50)),
        p99_ms=1000 * float(np.percentile(latencies, 99)),
        num_requests=len(latencies),
    )


def bench_scaling(args: argparse.Namespace) -> None:
    images = generated_looking(args.batch, 64)
    prompts = [""] * args.batch
    print(
        f"\n## scaling: sleep scorer {args.sleep_ms:g} ms per micro-batch (max {args.batch} items), "
        f"requests of {args.batch} 64x64 images, {args.loops_per_replica} client loops per replica, "
        f"{args.seconds:g} s per row"
    )
    print("| replicas | images/s | p50 ms | p99 ms | requests | scaling efficiency |")
    print("|---|---|---|---|---|---|")
    base = None
    for replicas in (1, 2, 4):
        extra = [
            "--sleep-ms",
            str(args.sleep_ms),
            "--max-batch-size",
            str(args.batch),
            "--batch-wait-ms",
            "2",
        ]
        with LocalRewardPool(["sleep"], replicas=replicas, extra_args=extra) as pool:
            with HttpRewardClient(pool.urls, {"sleep": 1.0}, batch_size=args.batch, max_concurrency=64) as client:
                result = drive(client, images, prompts, loops=args.loops_per_replica * replicas, seconds=args.seconds)
        base = base or result.images_per_s
        efficiency = result.images_per_s / (replicas * base)
        print(
            f"| {replicas} | {result.images_per_s:.0f} | {result.p50_ms:.1f} | {result.p99_ms:.1f} | "
            f"{result.num_requests} | {efficiency:.0%} |",
            flush=True,
        )


def bench_ocr(args: argparse.Namespace) -> None:
    from reward_server.scorers import SCORERS

    if "ocr" not in SCORERS:
        print("\n## ocr: no 'ocr' scorer registered; skipped")
        return
    try:
        import rapidocr  # noqa: F401
    except ImportError:
        print("\n## ocr: rapidocr is not installed; skipped")
        return
    batch = 4
    images, prompts = text_images(batch)
    print(f"\n## ocr (RapidOCR, CPU): requests of {batch} 384x96 text images, 2 client loops per replica")
    print("| replicas | images/s | p50 ms | p99 ms | requests | scaling efficiency | mean score |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for replicas in (1, 2):
        with LocalRewardPool(["ocr"], replicas=replicas, ready_timeout_s=300) as pool:
            with HttpRewardClient(pool.urls, {"ocr": 1.0}, batch_size=batch, timeout_s=120) as client:
                mean_score = float(np.mean(client.score(images, prompts).combined))
                result = drive(client, images, prompts, loops=2 * replicas, seconds=args.seconds)
        base = base or result.images_per_s
        print(
            f"| {replicas} | {result.images_per_s:.1f} | {result.p50_ms:.0f} | {result.p99_ms:.0f} | "
            f"{result.num_requests} | {result.images_per_s / (replicas * base):.0%} | {mean_score:.3f} |",
            flush=True,
        )


def bench_wire(args: argparse.Namespace) -> None:
    count, batch = 64, 32
    images = generated_looking(count, 512)
    prompts = [""] * count
    print(
        f"\n## wire formats: {count} generated-looking 512x512 RGB images per call, requests of {batch}, "
        f"one replica, sleep scorer at 0 ms; median (min) of {args.repeats} calls, per image"
    )
    print(
        "| wire format | end to end ms | client CPU ms | server CPU ms | encode ms | server handler ms | "
        "outside the scorer | body KB per image | lossless |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    extra = ["--max-batch-size", str(batch), "--max-body-bytes", str(1 << 30), "--sleep-ms", "0"]
    with LocalRewardPool(["sleep"], replicas=1, extra_args=extra) as pool:
        for wire_format in WIRE_FORMATS:
            with HttpRewardClient(
                pool.urls, {"sleep": 1.0}, batch_size=batch, max_concurrency=1, wire_format=wire_format
            ) as client:
                reference = client.score(images[:batch], prompts[:batch])  # warm-up, connection
                times = []
                client_cpu, server_cpu = _cpu_s(), _cpu_s(pool.pid(0))
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    result = client.score(images, prompts)
                    times.append((time.perf_counter() - started) / count * 1000)
                client_cpu_ms = (_cpu_s() - client_cpu) / (args.repeats * count) * 1000
                server_cpu_ms = (_cpu_s(pool.pid(0)) - server_cpu) / (args.repeats * count) * 1000
                lossless = bool(np.array_equal(result.combined[:batch], reference.combined))
                started = time.perf_counter()
                body = client.encode_body(images[:batch], prompts[:batch], [{}] * batch)
                if client.encoding is not None:
                    body = compress_body(body, client.encoding)
                encode_ms = (time.perf_counter() - started) / batch * 1000
                handler_ms, inference_ms, sent_bytes = _server_side(pool.urls[0], client, body)
            e2e = statistics.median(times)
            outside = (e2e - inference_ms) / e2e
            print(
                f"| {wire_format} | {e2e:.2f} ({min(times):.2f}) | {client_cpu_ms:.2f} | {server_cpu_ms:.2f} | "
                f"{encode_ms:.2f} | {handler_ms:.2f} | "
                f"{outside:.0%} | {sent_bytes / batch / 1000:.0f} | {'yes' if lossless else 'NO'} |",
                flush=True,
            )


def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (default: this one, all threads)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_side(url: str, client: HttpRewardClient, body: bytes) -> tuple[float, float, int]:
    """Per-image server handler and scorer ms for one request with ``body`` (as sent), and its size."""
    headers = {
        "Content-Type": "application/msgpack" if client.wire_format.startswith("msgpack") else "application/json"
    }
    if client.encoding is not None:
        headers["Content-Encoding"] = client.encoding
    with httpx.Client(trust_env=False, timeout=120) as http:
        timing = http.post(f"{url}/score", content=body, headers=headers).json()["timing"]
    items = client.batch_size
    return timing["total_ms"] / items, timing["scorers"]["sleep"]["inference_ms"] / items, len(body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["scaling", "ocr", "wire"], action="append")
    parser.add_argument("--sleep-ms", type=float, default=50.0, help="sleep scorer hold per micro-batch")
    parser.add_argument("--batch", type=int, default=16, help="items per request in the scaling runs")
    parser.add_argument("--loops-per-replica", type=int, default=2, help="client loops per replica")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured time per scaling row")
    parser.add_argument("--repeats", type=int, default=7, help="calls per wire format")
    args = parser.parse_args()
    print(f"# reward pool benchmark ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start)")
    sections = args.only or ["wire", "scaling", "ocr"]
    for name, bench in (("wire", bench_wire), ("scaling", bench_scaling), ("ocr", bench_ocr)):
        if name in sections:
            bench(args)


if __name__ == "__main__":
    main()
