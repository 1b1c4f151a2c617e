"""Every algorithm on the embedded digit task with the same budget and seed, from one shared warm-up.

One warm-up run (SFT, ``--warmup-steps``) writes a checkpoint; then each algorithm's preset
(``configs/algorithms/<name>.yaml``) runs ``--epochs`` RL epochs from those weights (``train.init_from``)
against the same local digit-reward replicas, with the same images per epoch (10 prompts x 16). The table
reports the digit accuracy (an independent classifier) and evaluation reward on fixed prompts and noise
before and after, the rollout reward curve (first epochs, last epochs, best), wall time and images/s. One
plot (``<out>/algorithms.png``) holds every algorithm's evaluation accuracy and rollout reward curves.

    python bench/algorithms.py [--epochs 15] [--warmup-steps 600] [--eval-every 5] [--only grpo,dpo]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from trainer.algorithms import ALGORITHMS

REPO = Path(__file__).resolve().parents[1]


def run_job(args: list[str], log: Path) -> float:
    """Run ``trainer/main.py`` with ``args`` (options first); returns the wall time. Fails loudly with the
    log's tail."""
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call([sys.executable, "trainer/main.py", *args, "logging.progress=false"], cwd=REPO,
                               stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if code:
        raise SystemExit(f"job failed (exit {code}): {' '.join(args)}\n{log.read_text()[-3000:]}")
    return time.perf_counter() - start


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--warmup-steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(ALGORITHMS))
    parser.add_argument("--out", default="outputs/bench-algorithms")
    args = parser.parse_args()
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = [f"logging.output_dir={out}", f"train.seed={args.seed}", "logging.tensorboard=false"]

    warm = out / "warmup"
    if not (warm / "checkpoints").is_dir():
        print(f"warm-up: {args.warmup_steps} SFT steps", flush=True)
        run_job([*common, "logging.run_name=warmup", f"train.warmup_steps={args.warmup_steps}", "train.epochs=0"],
                out / "warmup.log")
    (checkpoint,) = sorted((warm / "checkpoints").glob("step-*"))[-1:]

    rows, curves = [], {}
    for name in [a for a in (args.only.split(",") if args.only else ALGORITHMS) if a]:
        print(f"{name}: {args.epochs} RL epochs", flush=True)
        wall = run_job([f"--config=configs/algorithms/{name}.yaml", *common, f"logging.run_name={name}",
                        "train.warmup_steps=0", f"train.epochs={args.epochs}", f"train.init_from={checkpoint}",
                        f"eval.every={args.eval_every}", "train.checkpoint_every=0"], out / f"{name}.log")
        recs = records(out / name)
        evals = [r for r in recs if r["phase"] == "eval"]
        rl = [r["reward_mean"] for r in recs if r["phase"] == "rl"]
        curves[name] = ([(r["step"], r["digit_accuracy"]) for r in evals], rl)
        k = max(1, len(rl) // 5)
        rows.append({
            "algorithm": name,
            "accuracy": f"{evals[0]['digit_accuracy']:.2f} -> {evals[-1]['digit_accuracy']:.2f}",
            "eval reward": f"{evals[0]['reward_mean']:.3f} -> {evals[-1]['reward_mean']:.3f}",
            "rollout reward (first/last/best)": f"{sum(rl[:k]) / k:.3f} / {sum(rl[-k:]) / k:.3f} / {max(rl):.3f}",
            "wall s": f"{wall:.0f}",
            "images/s": f"{sum(r['images_per_s'] for r in recs if r['phase'] == 'rl') / len(rl):.1f}",
        })

    keys = list(rows[0])
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(row[k] for k in keys) + " |")
    plot(curves, out / "algorithms.png")
    print(f"\nplot: {out / 'algorithms.png'}  (warm-up checkpoint {checkpoint.name}, seed {args.seed}, "
          f"{args.epochs} epochs x 160 images each)")


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, (accuracy, rl) in curves.items():
        left.plot(*zip(*accuracy, strict=True), "o-", label=name)
        right.plot(range(1, len(rl) + 1), rl, label=name)
    left.set(xlabel="RL epoch", ylabel="digit accuracy (fixed eval noise)", title="evaluation")
    right.set(xlabel="RL epoch", ylabel="mean reward of the epoch's rollouts", title="rollouts")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
