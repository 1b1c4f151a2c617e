"""Time to target: every registered algorithm on an embedded task, over several seeds, from one shared warm-up.

One warm-up run (SFT, ``--warmup-steps``, by default the config's; the task config ``--config``; the first seed;
``--warmup-per-seed``: one per seed) writes a checkpoint; then for each seed (``train.seed``: the RL prompts, noise
and windows) each algorithm of ``trainer.algorithms.ALGORITHMS`` runs ``--epochs`` RL epochs from it
(``train.init_from``) with its preset ``<--algorithm-configs>/<name>.yaml`` layered over the task config, evaluating
every ``--eval-every`` epochs. Per algorithm the table gives, as median [min-max] over seeds, the RL wall seconds,
trainer-process CPU seconds, images and rollout forwards (denoiser rows) until the evaluation metric ``--metric``
first reaches ``--target`` ("n.r.": not reached; a median over seeds counts those as infinite), and the final and
best metric. Images (and forwards) to target do not depend on the machine's load; wall seconds do (the load average
is printed); evaluations are not counted in either time.
One plot (``<out>/time_to_target.png``): the metric against images and against RL wall seconds, median of seeds.

    python bench/algorithms.py [--seeds 0,1,2] [--epochs 16] [--eval-every 1] [--only grpo,dpo]
    python bench/algorithms.py --config configs/embedded_text.yaml --metric ocr_accuracy --target 0.6
    python bench/algorithms.py --config configs/embedded_video.yaml --metric direction_accuracy --target 0.9 --epochs 40
    python bench/algorithms.py --table-only        # the table of the runs already in --out
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainer.algorithms import ALGORITHMS

REPO = Path(__file__).resolve().parents[1]
NOT_REACHED = "n.r."


def run_job(args: list[str], log: Path) -> dict:
    """Run ``trainer/main.py`` with ``args`` (options first); returns its wall time and the 1-minute load average
    at its start and end. Fails loudly with the log's tail."""
    load_start, start = os.getloadavg()[0], time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.call(
            [sys.executable, "trainer/main.py", *args, "logging.progress=false"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    if code:
        raise SystemExit(f"job failed (exit {code}): {' '.join(args)}\n{log.read_text()[-3000:]}")
    return {"wall_s": time.perf_counter() - start, "load_start": load_start, "load_end": os.getloadavg()[0]}


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def time_to_target(recs: list[dict], metric: str, target: float) -> dict:
    """One run's figures: RL wall s, CPU s and images until the first evaluation with ``metric`` >= ``target``
    (sums over the RL epochs up to it; 0 when the evaluation before RL reaches it; None when none does), and its
    final and best ``metric``. Also the evaluation curve as (epoch, images, wall s, metric) points."""
    epochs = {r["step"]: r for r in recs if r["phase"] == "rl"}
    evals = [r for r in recs if r["phase"] == "eval" and metric in r]
    if not evals:
        raise ValueError(f"no evaluation logged {metric!r}: pass the task's metric as --metric")
    curve = []
    for r in evals:
        done = [epochs[e] for e in epochs if e <= r["step"]]
        curve.append(
            (
                r["step"],
                sum(e["images"] for e in done),
                sum(e["time_epoch_s"] for e in done),
                sum(e["time_epoch_cpu_s"] for e in done),
                r[metric],
            )
        )
    hit = next((point for point in curve if point[4] >= target), None)
    final = next((r for r in recs if r["phase"] == "final"), evals[-1])
    logged = all("rollout_forwards_per_image" in e for e in epochs.values())  # runs before it was logged: none
    forwards = [
        e["images"] * e["rollout_forwards_per_image"] for n, e in epochs.items() if logged and hit and n <= hit[0]
    ]
    return {
        "forwards": sum(forwards) if hit and logged else None,
        "logged_forwards": logged,
        "epoch": hit[0] if hit else None,
        "images": hit[1] if hit else None,
        "wall_s": hit[2] if hit else None,
        "cpu_s": hit[3] if hit else None,
        "final": final[metric],
        "best": max(p[4] for p in curve),
        "curve": [p[:3] + p[4:] for p in curve],
    }


def spread(values: list[float | None], fmt: str) -> str:
    """median [min-max] of ``values``, None counting as +inf and printed as n.r.; equal values: the value."""
    finite = [math.inf if v is None else v for v in values]
    show = lambda v: NOT_REACHED if math.isinf(v) else format(v, fmt)  # noqa: E731
    if len({show(v) for v in finite}) == 1:
        return show(finite[0])
    return (
        f"{show(statistics.median_low(finite) if len(finite) % 2 == 0 else statistics.median(finite))} "
        f"[{show(min(finite))}-{show(max(finite))}]"
    )


def summary_rows(runs: dict[str, list[dict]], metric: str) -> list[dict]:
    """One table row per algorithm from its runs' ``time_to_target`` figures (one per seed)."""
    rows = []
    for name, figures in runs.items():
        rows.append(
            {
                "algorithm": name,
                "reached": f"{sum(f['epoch'] is not None for f in figures)}/{len(figures)}",
                "epochs to target": spread([f["epoch"] for f in figures], ".0f"),
                "images to target": spread([f["images"] for f in figures], ".0f"),
                "rollout forwards to target": spread([f["forwards"] for f in figures], ".0f")
                if all(f.get("logged_forwards") for f in figures)
                else "-",
                "RL wall s to target": spread([f["wall_s"] for f in figures], ".0f"),
                "CPU s to target": spread([f["cpu_s"] for f in figures], ".0f"),
                f"final {metric}": spread([f["final"] for f in figures], ".2f"),
                f"best {metric}": spread([f["best"] for f in figures], ".2f"),
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(str(row[k]) for k in keys) + " |" for row in rows])


def parse_markdown(text: str) -> list[dict]:
    """The rows of the first markdown table in ``text`` as dicts (the inverse of ``markdown``)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    return [dict(zip(cells[0], row, strict=True)) for row in cells[2:]]


def warmup_steps(args) -> str:
    """The warm-up's length for messages: ``--warmup-steps``, else the config's."""
    return str(args.warmup_steps) if args.warmup_steps else "the config's"


def warm_up(seed: int, args, out: Path, common: list[str], timings: dict) -> Path:
    """The warm-up checkpoint of ``seed``, run unless it is there."""
    name = f"warmup-seed{seed}"
    if not (out / name / "checkpoints").is_dir():
        print(f"seed {seed}: warm-up of {warmup_steps(args)} SFT steps", flush=True)
        timings[name] = run_job(
            [
                f"--config={args.config}",
                *common,
                f"train.seed={seed}",
                f"logging.run_name={name}",
                *([f"train.warmup_steps={args.warmup_steps}"] if args.warmup_steps else []),
                "train.epochs=0",
            ],
            out / f"{name}.log",
        )
    return sorted((out / name / "checkpoints").glob("step-*"))[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/embedded_digits.yaml", help="the task's job config")
    parser.add_argument("--metric", default="digit_accuracy", help="the evaluation metric the target is on")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument(
        "--algorithm-configs",
        default="configs/algorithms",
        help="folder of one <algorithm>.yaml per algorithm, layered over --config",
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=0, help="0: the config's train.warmup_steps")
    parser.add_argument("--eval-every", type=int, default=1)
    parser.add_argument("--warmup-per-seed", action="store_true", help="a warm-up per seed instead of one shared")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated subset of: "
        + ",".join(ALGORITHMS)
        + "; or other presets of --algorithm-configs (e.g. mixgrpo_flash)",
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every job")
    parser.add_argument("--out", default="outputs/bench-algorithms")
    parser.add_argument("--table-only", action="store_true", help="tabulate the finished runs in --out, run nothing")
    args = parser.parse_args()
    names = [a for a in args.only.split(",") if a] or list(ALGORITHMS)
    unknown = [n for n in names if not (REPO / args.algorithm_configs / f"{n}.yaml").is_file()]
    if unknown:
        raise SystemExit(
            f"--only names {unknown}, which have no preset in {args.algorithm_configs}: choose from "
            f"{', '.join(ALGORITHMS)} or another preset there"
        )
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = [f"logging.output_dir={out}", "logging.tensorboard=false", "train.checkpoint_every=0", *args.set]
    timing_file = out / "timings.json"
    timings = json.loads(timing_file.read_text()) if timing_file.is_file() else {}

    for seed in seeds if not args.table_only else []:
        checkpoint = warm_up(seed if args.warmup_per_seed else seeds[0], args, out, common, timings)
        for name in names:
            run = f"{name}-seed{seed}"
            if (out / run / "metrics.jsonl").is_file() and records(out / run)[-1]["phase"] == "final":
                continue  # done before: a rerun continues where an interrupted bench stopped
            print(f"seed {seed}: {name}, {args.epochs} RL epochs", flush=True)
            timings[run] = run_job(
                [
                    f"--config={args.config}",
                    f"--config={args.algorithm_configs}/{name}.yaml",
                    *common,
                    f"train.seed={seed}",
                    f"logging.run_name={run}",
                    "train.warmup_steps=0",
                    f"train.epochs={args.epochs}",
                    f"train.init_from={checkpoint}",
                    f"eval.every={args.eval_every}",
                ],
                out / f"{run}.log",
            )
            timing_file.write_text(json.dumps(timings, indent=1))

    runs = {
        name: [
            time_to_target(records(out / f"{name}-seed{s}"), args.metric, args.target)
            for s in seeds
            if (out / f"{name}-seed{s}" / "metrics.jsonl").is_file()
        ]
        for name in names
    }
    runs = {name: figures for name, figures in runs.items() if figures}
    table = markdown(summary_rows(runs, args.metric))
    loads = [t[k] for t in timings.values() for k in ("load_start", "load_end")]
    note = (
        f"{args.metric} >= {args.target}; seeds {args.seeds}; {args.epochs} RL epochs, evaluated every "
        f"{args.eval_every}; warm-up {warmup_steps(args)} steps, "
        f"{'one per seed' if args.warmup_per_seed else 'one shared by all seeds'}"
        + (f"; 1-min load average at job starts/ends {min(loads):.1f}-{max(loads):.1f}" if loads else "")
    )
    print(f"\n{table}\n\n{note}")
    (out / "time_to_target.md").write_text(f"{table}\n\n{note}\n")
    (out / "time_to_target.json").write_text(json.dumps(runs))
    plot(runs, args.metric, args.target, out / "time_to_target.png")
    print(f"plot: {out / 'time_to_target.png'}")


def plot(runs: dict[str, list[dict]], metric: str, target: float, path: Path) -> None:
    """The median over seeds of ``metric`` at each evaluation, against images and against RL wall seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, figures) in enumerate(runs.items()):
        length = min(len(f["curve"]) for f in figures)
        points = [[f["curve"][i] for f in figures] for i in range(length)]
        med = [[statistics.median(p[k] for p in column) for k in range(4)] for column in points]
        (line,) = left.plot(
            [m[1] for m in med],
            [m[3] for m in med],
            label=name,
            color=plt.cm.tab20(i % 20),
            linestyle="-" if i < 10 else "--",
        )
        left.fill_between(
            [m[1] for m in med],
            [min(p[3] for p in c) for c in points],
            [max(p[3] for p in c) for c in points],
            color=line.get_color(),
            alpha=0.1,
        )
        right.plot([m[2] for m in med], [m[3] for m in med], color=line.get_color(), linestyle=line.get_linestyle())
    left.set(xlabel="RL images sampled", ylabel=f"{metric} (median of seeds; band: min-max)", title="load-free")
    right.set(xlabel="RL wall seconds (median of seeds, evaluations excluded)", ylabel=metric, title="wall time")
    for ax in (left, right):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    left.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
