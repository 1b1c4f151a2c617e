"""The embedded jobs' promise, measured: `python trainer/main.py [--config CFG] train.seed=N` (default: the digits
job) for each seed, one at a time; prints a markdown table of the task metric that picks best/ (before RL, best/
the job's result, last) with wall and CPU times and the load average, and plots every seed's curve to --plot.

    python bench/demo_seeds.py --out /tmp/demo_seeds                    # seeds 0..4
    python bench/demo_seeds.py --out /tmp/demo_seeds --table-only       # the table of runs already there
    python bench/demo_seeds.py --config configs/embedded_text.yaml --out /tmp/text --seeds 0 --plot text.png
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_seed(seed: int, out: Path, extra: list[str], config: list[str]) -> dict:
    """Run the job for ``seed`` under ``out``; returns the wall time, the CPU time of the job and its reward
    replicas (user + system), and the load averages around it."""
    load_start, start = os.getloadavg()[0], time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out / f"seed{seed}.log", "w") as log:
        subprocess.run(
            [
                sys.executable,
                "trainer/main.py",
                *config,
                f"train.seed={seed}",
                f"logging.output_dir={out}",
                f"logging.run_name=seed{seed}",
                *extra,
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_s": time.monotonic() - start, "cpu_s": cpu, "load_start": load_start, "load_end": os.getloadavg()[0]}


def row(seed: int, out: Path) -> tuple[str, list[tuple[int, float]], int, str]:
    records = [json.loads(line) for line in (out / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["phase"] == "eval"]
    best = json.loads((out / f"seed{seed}" / "best" / "meta.json").read_text())
    metric = best["select_by"]
    final = next(r for r in records if r["phase"] == "final")
    timing = (
        json.loads((out / f"seed{seed}.time.json").read_text()) if (out / f"seed{seed}.time.json").is_file() else {}
    )
    alarms = sum(r["phase"] == "alarm" for r in records)
    curve = " ".join(f"{r[metric]:.2f}" for r in evals)
    wall = f"{timing['wall_s']:.0f} s" if timing else "?"
    cpu = f"{timing['cpu_s']:.0f} s" if "cpu_s" in timing else "?"
    load = f"{timing['load_start']:.1f} / {timing['load_end']:.1f}" if timing else "?"
    text = (
        f"| {seed} | {evals[0][metric]:.2f} | **{best['value']:.2f}** (epoch {best['epoch']}) | "
        f"{evals[-1][metric]:.2f} | {curve} | {alarms} | {final['time'] - records[0]['time']:.0f} s | "
        f"{wall} | {cpu} | {load} |"
    )
    return text, [(r["step"], r[metric]) for r in evals], best["epoch"], metric


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="runs are written to OUT/seed<N>/")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--config", action="append", default=[], help="config file(s) of the job (default: digits)")
    parser.add_argument("--table-only", action="store_true", help="tabulate the runs already in --out")
    parser.add_argument("--plot", type=Path, help="write every seed's evaluation accuracy curve here (png)")
    parser.add_argument("overrides", nargs="*", help="section.key=value passed to every run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        for seed in args.seeds:
            timing = run_seed(seed, args.out, args.overrides, [f"--config={c}" for c in args.config])
            (args.out / f"seed{seed}.time.json").write_text(json.dumps(timing))
    rows = {seed: row(seed, args.out) for seed in args.seeds}
    metric = next(iter(rows.values()))[3]
    print(
        f"| `train.seed` | before RL | best/ (the result) | last (final/) | {metric} at each evaluation "
        "| alarms | first warm-up step to final evaluation | process wall time | CPU time (job + replicas) "
        "| load average at start / end |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    curves = {}
    for seed, (text, points, best, _) in rows.items():
        curves[seed] = (points, best)
        print(text)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for seed, (points, best) in curves.items():
            (line,) = ax.plot(*zip(*points, strict=True), "o-", markersize=3, label=f"train.seed={seed}")
            ax.plot([best], [dict(points)[best]], "*", color=line.get_color(), markersize=12)
        ax.set_xlabel("RL epoch")
        ax.set_ylabel(f"{metric} (evaluation, EMA weights)")
        ax.set_title(f"{' '.join(args.config) or 'make demo'}: {metric} per seed (star: best/)", fontsize="medium")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=80)
    return 0


if __name__ == "__main__":
    sys.exit(main())
