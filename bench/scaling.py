"""Step time and images/s of the tiny GRPO job for 1 vs 2 processes under each parallel backend.

    python bench/scaling.py                  # every backend, 1 and 2 processes, on this machine's CPU
    python bench/scaling.py --epochs 4 --backends ddp,fsdp2
    python bench/scaling.py --backends fsdp2,zero3 --gather both   # parallel.gather_for_sampling on vs off

Each configuration runs the real job (torchrun, gloo on the CPU, one digit-reward server shared by all
runs) and reads its per-epoch metrics; the first RL epoch is left out (warm-up of caches and allocators).
Prints a markdown table: per RL epoch the update (train) time, the rollout throughput and the throughput of
the whole epoch (rollout + reward wait + update), each the median over epochs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(
    backend: str,
    nproc: int,
    out: Path,
    model_path: str,
    url: str,
    epochs: int,
    prompts: int,
    group: int,
    gather: bool = True,
) -> list[dict]:
    name = f"{backend}-{nproc}-{gather}"
    launcher = (
        [sys.executable, "trainer/main.py"]
        if backend == "single"
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "trainer/main.py",
        ]
    )
    subprocess.run(
        launcher
        + [
            f"model.path={model_path}",
            f"logging.output_dir={out}",
            f"logging.run_name={name}",
            "logging.progress=false",
            "logging.tensorboard=false",
            f"parallel.backend={backend}",
            "train.warmup_steps=2",
            f"train.epochs={epochs}",
            "train.checkpoint_every=0",
            f"data.prompts_per_epoch={prompts}",
            f"algorithm.group_size={group}",
            "eval.samples_per_prompt=1",
            "eval.every=0",
            f"reward.urls=[{url}]",
            f"parallel.gather_for_sampling={str(gather).lower()}",
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["phase"] == "rl"][1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="single,ddp,fsdp2,zero2,zero3")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="data.prompts_per_epoch")
    parser.add_argument("--group", type=int, default=8, help="algorithm.group_size")
    parser.add_argument(
        "--gather",
        choices=("on", "off", "both"),
        default="on",
        help="parallel.gather_for_sampling for fsdp2 and zero3 (both: a row for each)",
    )
    args = parser.parse_args()

    from trainer.models.tiny import DEFAULT_TINY_PATH, build_tiny_sd3
    from trainer.rewards.launcher import LocalRewardPool

    model_path = str(REPO / DEFAULT_TINY_PATH)
    if not (Path(model_path) / "transformer").is_dir():
        build_tiny_sd3(model_path)
    images = args.prompts * args.group
    rows = []
    with tempfile.TemporaryDirectory() as tmp, LocalRewardPool(["digit"], replicas=1, log_dir=Path(tmp)) as pool:
        for backend in args.backends.split(","):
            sharded = backend in ("fsdp2", "zero3")
            gathers = {"on": (True,), "off": (False,), "both": (True, False)}[args.gather] if sharded else (True,)
            for nproc in (1,) if backend == "single" else (1, 2):
                for gather in gathers:
                    epochs = run(
                        backend,
                        nproc,
                        Path(tmp),
                        model_path,
                        pool.urls[0],
                        args.epochs,
                        args.prompts,
                        args.group,
                        gather,
                    )
                    train = statistics.median(r["time_train_s"] for r in epochs)
                    rollout = statistics.median(
                        images / (r["time_rollout_s"] + r["time_reward_wait_s"]) for r in epochs
                    )
                    whole = statistics.median(
                        images / (r["time_rollout_s"] + r["time_reward_wait_s"] + r["time_train_s"]) for r in epochs
                    )
                    label = backend if not sharded else f"{backend}, gather for sampling {'on' if gather else 'off'}"
                    rows.append((label, nproc, train, rollout, whole))
                    print(f"{label} x{nproc}: done", file=sys.stderr, flush=True)
    print(
        f"{images} images per RL epoch ({args.prompts} prompts x {args.group}), tiny SD3 model, "
        f"{os.cpu_count()} CPU cores, gloo; medians over {args.epochs - 1} epochs\n"
    )
    print("| backend | processes | update time / epoch (s) | rollout images/s | epoch images/s |")
    print("|---|---|---|---|---|")
    for backend, nproc, train, rollout, whole in rows:
        print(f"| {backend} | {nproc} | {train:.2f} | {rollout:.1f} | {whole:.1f} |")


if __name__ == "__main__":
    main()
