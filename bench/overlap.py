"""Rollout / reward overlap: with a reward that takes R seconds per epoch's batch, an RL epoch should take
about max(rollout, R), not rollout + R.

The reward is the ``sleep`` scorer (a stand-in for a GPU model: it holds each micro-batch of 8 images for a
fixed time, so R grows with the batch) served by a real reward-server process. The epoch's sampling and
scoring runs through ``Trainer.sample_and_score`` with ``train.rollout_chunks`` = 1 (no overlap) and more.
The first chunk's sampling and the last chunk's scoring overlap nothing, so the floor is
max(S, R) + min(S, R) / chunks (S: sampling time). Chunks end at whole requests of 8
(``trainer.rollout.chunk_bounds``), so chunking adds no partly filled micro-batches.

Sampling runs on one torch thread by default (``OMP_NUM_THREADS`` overrides): on a GPU machine the sampler
runs on the accelerator and leaves the CPU to the reward client, while on this 2-core machine two sampling
threads would compete with the client's encoding and the server process for the same cores.
The ratio's denominator uses the sampling time at the same chunking: smaller chunks sample faster or slower
per image than one big batch, and that is not overlap.

    python bench/overlap.py [--images 320] [--repeats 2]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainer.algorithms import build_algorithm  # noqa: E402
from trainer.algorithms.sft import SFT  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.data import build_task  # noqa: E402
from trainer.distributed import SingleProcess  # noqa: E402
from trainer.logging import RunLogger, to_uint8  # noqa: E402
from trainer.models import build_adapter  # noqa: E402
from trainer.rewards.client import HttpRewardClient  # noqa: E402
from trainer.rewards.launcher import LocalRewardPool  # noqa: E402
from trainer.rollout import rollout, rollout_bounds  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402

MICRO_BATCH = 8


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=320, help="images per epoch (multiple of 16)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--chunks",
        default="1,2,4,5,10,20,0",
        help="train.rollout_chunks values (0: the default, trainer.rollout.rollout_bounds)",
    )
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    config = load_config(overrides=[f"data.prompts_per_epoch={args.images // 16}", "logging.progress=false"])
    adapter = build_adapter(config.model, "cpu")
    task = build_task(config.data)
    algorithm = build_algorithm(config.algorithm)
    prompts = [task.prompts[i % len(task.prompts)] for i in range(args.images)]
    groups = torch.arange(args.images) // 16
    indices = torch.arange(args.images) % len(task.prompts)

    def sample_only(chunks: int = 1):
        g = torch.Generator().manual_seed(0)
        bounds = rollout_bounds(args.images, chunks, MICRO_BATCH)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            rollout(adapter, adapter.denoiser, prompts[lo:hi], groups[lo:hi], algorithm.sampler, g)

    t_rollout = best_of(args.repeats, sample_only)
    ms = 1000 * t_rollout / math.ceil(args.images / MICRO_BATCH)  # R = rollout time
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalRewardPool(
            ["sleep"],
            replicas=1,
            extra_args=["--sleep-ms", f"{ms:.1f}", "--max-batch-size", str(MICRO_BATCH)],
        ) as pool,
    ):
        client = HttpRewardClient(pool.urls, {"sleep": 1.0}, batch_size=MICRO_BATCH)
        images = to_uint8(torch.rand(args.images, 1, 16, 16))
        t_reward = best_of(args.repeats, lambda: client.score(images, prompts))
        for chunks in (int(c) for c in args.chunks.split(",")):
            config.train.rollout_chunks = chunks
            trainer = Trainer(
                config,
                adapter,
                algorithm,
                SFT(config.warmup),
                task,
                client,
                SingleProcess(torch.device("cpu")),
                RunLogger(Path(tmp), False, False),
            )
            g = torch.Generator().manual_seed(0)
            noise = torch.Generator().manual_seed(1)
            t = best_of(
                args.repeats, lambda t=trainer, g=g, n=noise: t.sample_and_score(prompts, indices, groups, g, n)
            )
            t_sampling = best_of(args.repeats, lambda c=chunks: sample_only(c))
            bound = max(t_sampling, t_reward)
            cut = len(rollout_bounds(args.images, chunks, MICRO_BATCH)) - 1
            label = f"{chunks}" if chunks else f"0 (default: {cut})"
            rows.append(
                (
                    label,
                    t,
                    t_sampling,
                    t / bound,
                    1 + min(t_sampling, t_reward) / cut / bound,
                    (t_sampling + t_reward) / bound,
                )
            )
        client.close()
    print(
        f"\nimages/epoch {args.images}; rollout alone {t_rollout:.2f} s; reward alone R {t_reward:.2f} s "
        f"(sleep scorer, {ms:.0f} ms per {MICRO_BATCH} images); best of {args.repeats}\n"
    )
    print("S = sampling alone at that chunking; target: epoch <= 1.10 x max(S, R)\n")
    print(
        "| rollout_chunks | epoch sample+score s | S s | epoch / max(S, R) | floor (max + min/chunks) / max "
        "| no overlap (S + R) / max |"
    )
    print("|---|---|---|---|---|---|")
    for chunks, t, t_sampling, ratio, floor, serial in rows:
        print(f"| {chunks} | {t:.2f} | {t_sampling:.2f} | {ratio:.2f}x | {floor:.2f}x | {serial:.2f}x |")


if __name__ == "__main__":
    main()
