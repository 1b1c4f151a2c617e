"""Several trainer jobs one after another in one interpreter: under torchrun the start-up, the imports and the
process group are paid once per series instead of once per job (tests that compare many small jobs).

    torchrun --standalone --nproc_per_node=2 tests/job_series.py JOBS.json

JOBS.json lists argument lists of trainer/main.py; each job's output starts with a line ``=== job <i>``. The
series stops at the first job that does not exit 0, and exits with its status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
MARK = "=== job "


@dataclass
class Series:
    """The outcome of a series: its exit status and each job's output (rank 0's stdout, every rank's stderr)."""

    returncode: int
    stdout: list[str]
    stderr: list[str]

    def failure(self) -> str:
        return f"exit {self.returncode}\n{''.join(self.stdout)[-3000:]}\n{''.join(self.stderr)[-5000:]}"


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants. torchrun starts each rank in a session of its own, so ``killpg`` of
    torchrun's group leaves the ranks running on, orphaned."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def kill_tree(pid: int, sig: int) -> list[int]:
    """Send ``sig`` to ``pid`` and every descendant, all found before any is signalled; returns their pids."""
    tree = process_tree(pid)
    for each in tree:
        try:
            os.kill(each, sig)
        except ProcessLookupError:
            pass
    return tree


def run_series(jobs: list[list[str]], workdir: Path, *, nproc: int = 2, timeout: float = 600) -> Series:
    """Run ``jobs`` (trainer/main.py arguments each) as one torchrun series from the repository root. On a
    timeout (a hung collective) its whole process group is killed, the ranks too, and the output returned."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "jobs.json"
    spec.write_text(json.dumps(jobs))
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        __file__,
        str(spec),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    process = subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        code = process.returncode
    except subprocess.TimeoutExpired:
        kill_tree(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        code = -signal.SIGKILL
    return Series(code, _split(stdout, len(jobs)), _split(stderr, len(jobs)))


def _split(text: str, count: int) -> list[str]:
    """Each job's part of ``text``, by the marker lines (torchrun prefixes none: it does not tee)."""
    parts = [""] * count
    index = -1
    for line in text.splitlines(keepends=True):
        if line.startswith(MARK) and line[len(MARK) :].strip().isdigit():
            index = int(line[len(MARK) :])
            continue
        parts[max(index, 0)] += line
    return parts


def main(spec: str) -> int:
    import torch.distributed as dist

    from trainer.main import main as job

    jobs = json.loads(Path(spec).read_text())
    # One process group for the series: torchrun's store keeps a destroyed group's keys, so a second group
    # created on it would read the first one's addresses and fail to connect.
    with mock.patch.object(dist, "destroy_process_group"):
        # Rank 0 alone marks the streams: the ranks share torchrun's pipes, and a marker of rank 1, which can
        # be a job ahead, would cut rank 0's output of the job before it.
        first = os.environ.get("RANK", "0") == "0"
        for index, argv in enumerate(jobs):
            if first:
                print(f"{MARK}{index}", flush=True)
                print(f"{MARK}{index}", file=sys.stderr, flush=True)
            code = job(argv)
            if code:
                return code
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
