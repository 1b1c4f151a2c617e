"""Soak test: 64 concurrent clients against 2 local replicas on loopback for N minutes.

    python bench/reward_soak.py                  # 5 minutes
    python bench/reward_soak.py --minutes 0.5    # a short run

Each client is its own ``HttpRewardClient`` (own connection pool and event loop, like one trainer rank)
scoring small batches back to back with the msgpack wire format. The replicas run the ``sleep`` scorer
with a small queue, so that overload shows up as 429 answers, which clients retry on the other replica.
Reports: calls, images, errors other than 429 (exceptions, NaN rewards, wrong rewards), 429 answers
seen by the servers, p50/p99 call latency, and each server's RSS at the start and the end.

The traffic stays on 127.0.0.1 and stops by itself after ``--minutes``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reward_server.sleep_scorer import subsampled_brightness  # noqa: E402
from trainer.rewards import HttpRewardClient, LocalRewardPool  # noqa: E402


def rss_mib(pid: int) -> float:
    """Resident set size of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def count_status(urls: list[str], status: int) -> int:
    """``POST /score`` answers with ``status`` over all servers, from their /metrics."""
    total = 0
    prefix = f'rewardflow_requests_total{{path="/score",status="{status}"}}'
    with httpx.Client(trust_env=False, timeout=10) as http:
        for url in urls:
            for line in http.get(f"{url}/metrics").text.splitlines():
                if line.startswith(prefix):
                    total += int(float(line.split()[-1]))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="images per call")
    parser.add_argument("--side", type=int, default=128, help="image side in pixels")
    parser.add_argument("--sleep-ms", type=float, default=5.0, help="sleep scorer hold per micro-batch")
    parser.add_argument("--max-queue-items", type=int, default=64, help="per scorer and replica")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (args.clients, args.batch, args.side, args.side, 3), dtype=np.uint8)
    expected = np.array([[subsampled_brightness(image) for image in batch] for batch in images])
    server_args = [
        "--sleep-ms", str(args.sleep_ms),
        "--max-batch-size", "32",
        "--max-items", str(args.batch),
        "--max-queue-items", str(args.max_queue_items),
    ]  # fmt: skip
    errors: Counter[str] = Counter()
    latencies: list[list[float]] = [[] for _ in range(args.clients)]
    with LocalRewardPool(["sleep"], replicas=2, extra_args=server_args) as pool:
        pids = [pool.pid(i) for i in range(2)]
        rss_start = [rss_mib(pid) for pid in pids]
        stop_at = time.monotonic() + args.minutes * 60
        lock = threading.Lock()

        def run(index: int) -> None:
            prompts = [f"client {index}"] * args.batch
            with HttpRewardClient(
                pool.urls,
                {"sleep": 1.0},
                batch_size=args.batch,
                max_concurrency=1,
                timeout_s=30,
                max_retries=6,
            ) as client:
                while time.monotonic() < stop_at:
                    started = time.monotonic()
                    try:
                        result = client.score(images[index], prompts)
                    except Exception as exc:  # counted, not raised: the soak must see every failure
                        with lock:
                            errors[type(exc).__name__] += 1
                        continue
                    latencies[index].append(time.monotonic() - started)
                    if np.isnan(result.combined).any():
                        with lock:
                            errors["nan reward"] += 1
                    elif not np.array_equal(result.combined, expected[index]):
                        with lock:
                            errors["wrong reward"] += 1

        print(
            f"soak: {args.clients} clients x {args.batch} images of {args.side}x{args.side}, 2 replicas, "
            f"{args.minutes:g} min, load average {os.getloadavg()[0]:.1f} at start",
            flush=True,
        )
        threads = [threading.Thread(target=run, args=(i,)) for i in range(args.clients)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        rss_end = [rss_mib(pid) for pid in pids]
        num_429 = count_status(pool.urls, 429)
        num_5xx = sum(count_status(pool.urls, status) for status in (500, 502, 503, 504))
    flat = np.array([value for per_client in latencies for value in per_client])
    print("| metric | value |")
    print("|---|---|")
    print(f"| duration | {elapsed:.0f} s |")
    print(f"| calls ok | {len(flat)} ({len(flat) * args.batch / elapsed:.0f} images/s) |")
    print(f"| errors other than 429 | {sum(errors.values())} {dict(errors) or ''} |")
    print(f"| 429 answers (retried by the clients) | {num_429} |")
    print(f"| 5xx answers | {num_5xx} |")
    print(
        f"| call latency p50 / p99 / max | {1000 * np.percentile(flat, 50):.0f} / "
        f"{1000 * np.percentile(flat, 99):.0f} / {1000 * flat.max():.0f} ms |"
    )
    for i, (start_mib, end_mib) in enumerate(zip(rss_start, rss_end, strict=True)):
        print(f"| replica {i} RSS start -> end | {start_mib:.0f} -> {end_mib:.0f} MiB |")
    print(f"| load average at the end | {os.getloadavg()[0]:.1f} |")


if __name__ == "__main__":
    main()
