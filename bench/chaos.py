"""Chaos bench: a training job under a seeded schedule of faults ends where the undisturbed job ends, bit for bit.

    python bench/chaos.py                                   # the digits demo (python trainer/main.py)
    python bench/chaos.py --kill-every-s 20 -- train.epochs=6 train.warmup_steps=20   # overrides after --
    python bench/chaos.py --nproc 2 --backend fsdp2         # torchrun, one rank's process SIGTERMed

It runs the job once undisturbed (or reads ``--baseline DIR``, a finished run of the same command), then again
while faults strike it, each kind on its own seeded clock (every period times a factor drawn in [0.5, 1.5]):

* ``replica_kill``: SIGKILL to one of the job's own reward replicas (the pool's supervisor restarts it);
* ``replica_hang``: SIGSTOP to a replica for ``--hang-s`` (then SIGCONT): it keeps its connections but answers
  nothing, so each request to it fails at ``reward.timeout_s`` and goes to the other;
* the trainer faults, one at a time, in turn, once the run has logged a step or epoch since it (re)started:
  ``sigterm`` (a scheduler's stop: the run ends its epoch and checkpoints; under torchrun to one rank alone),
  ``ctrl_c`` (SIGINT to the job's process group, the first Ctrl-C: the same, exit 130) and ``disk_full``
  (RLIMIT_FSIZE of 1 MiB set on the running trainer, so that its next checkpoint write fails with EFBIG as on a
  full disk: the run says so and stops). Each ends the run; the bench then runs the ``continue with:`` command
  the run printed (``--resume auto``), as a user would.

At the end it compares the two runs' ``final/`` files (sha256) and every metrics.jsonl record except the
checkpoint records and the wall-clock and retry fields (``UNCOMPARED``), and prints a table: faults by kind,
reward attempts that failed and were retried, rewards lost (no replica scored them) and zeroed (NaN from a scorer,
advantage 0), the wall-time overhead, and whether the final weights are byte-identical. Exit status 1 when any
reward was lost or zeroed or the runs differ. docs/reliability.md says what is guaranteed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_NAME = "chaos"
UNCOMPARED = ("time", "time_", "images_per_s", "rollout_images_per_s", "reward_failed_attempts")
"""metrics.jsonl fields left out of the comparison (prefixes): wall-clock figures, and the failed reward attempts,
which are what the faults change."""
TRAINER_FAULTS = ("sigterm", "ctrl_c", "disk_full")
REPLICA_FAULTS = ("replica_kill", "replica_hang")
DISK_LIMIT_BYTES = 1 << 20
"""RLIMIT_FSIZE of a trainer struck by ``disk_full``: the tiny model's checkpoint files are 2.3 MiB and more, its
logs far less."""


@dataclass
class Schedule:
    """Mean seconds between faults of each kind (0: never), and what each does."""

    kill_every_s: float = 60.0
    hang_every_s: float = 120.0
    hang_s: float = 75.0
    trainer_every_s: float = 120.0
    trainer_faults: tuple[str, ...] = TRAINER_FAULTS
    seed: int = 0
    trainer_rounds: int = 0  # each trainer fault at most this many times (0: no limit)


@dataclass
class Outcome:
    """One run of the job: its wall time, run directory, the faults that struck and every metrics record written."""

    wall_s: float
    run_dir: Path
    faults: dict[str, int] = field(default_factory=dict)
    records: dict[str, dict] = field(default_factory=dict)  # every line metrics.jsonl ever held -> its record
    unscored_in_logs: int = 0  # samples the trainer said got no reward, in epochs it never logged


def job_command(nproc: int, overrides: list[str], out_dir: Path) -> list[str]:
    """The job's first command line: the demo (with ``overrides``) in ``out_dir``, under torchrun if ``nproc`` > 1."""
    args = ["trainer/main.py", *overrides, f"logging.output_dir={out_dir}", f"logging.run_name={RUN_NAME}"]
    if nproc == 1:
        return [sys.executable, *args]
    return [*_torchrun(), f"--nproc_per_node={nproc}", *args]


def _torchrun() -> list[str]:
    """torchrun with a rendezvous port of its own (``--standalone``): other jobs on the machine may hold 29500."""
    return [str(Path(sys.executable).with_name("torchrun")), "--standalone"]


def continue_command(output: str) -> list[str] | None:
    """The ``continue with:`` command a stopped run printed, runnable here (this interpreter, this torchrun)."""
    found = re.findall(r"^continue with: (.+?)(?:  \(on every machine.*)?$", output, re.MULTILINE)
    if not found:
        return None
    words = shlex.split(found[-1])
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    assert words[0] == "torchrun", words
    return [*_torchrun(), *words[1:]]


def _children(pids: set[int]) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose parent is in ``pids``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent in pids:
                found.append(
                    (
                        int(stat.parent.name),
                        (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(),
                    )
                )
        except (OSError, IndexError, ValueError):
            continue
    return found


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


class Injector:
    """Strikes one running job (``start``, then ``tick`` while it runs) on the schedule's seeded clocks; the counts
    of faults that struck survive the job's restarts."""

    def __init__(self, schedule: Schedule, nproc: int, metrics: Path) -> None:
        self.schedule, self.nproc, self.metrics = schedule, nproc, metrics
        self.rng = random.Random(schedule.seed)
        self.kinds = [kind for kind in schedule.trainer_faults]
        self.rng.shuffle(self.kinds)
        self.faults: dict[str, int] = dict.fromkeys((*REPLICA_FAULTS, *schedule.trainer_faults), 0)
        self.hung: dict[int, float] = {}  # replica pid -> when it gets SIGCONT
        now = time.monotonic()
        self.due = {
            "replica_kill": self._next(now, schedule.kill_every_s),
            "replica_hang": self._next(now, schedule.hang_every_s),
        }

    def _next(self, now: float, every_s: float) -> float:
        return now + every_s * self.rng.uniform(0.5, 1.5) if every_s > 0 else float("inf")

    def start(self, process: subprocess.Popen) -> None:
        """A new run of the job began: its trainer fault is due a period after it has logged progress."""
        self.process, self.pending = process, None
        self.records_at_start, self.progressed = _count_lines(self.metrics), False
        self.trainer_due = self._next(time.monotonic(), self.schedule.trainer_every_s)

    def _trainers(self) -> list[int]:
        """The trainer processes: the job itself, or under torchrun its ranks."""
        if self.nproc == 1:
            return [self.process.pid]
        return sorted(pid for pid, command in _children({self.process.pid}) if "trainer/main.py" in command)

    def _replicas(self) -> list[int]:
        return sorted(pid for pid, command in _children(set(self._trainers())) if "--parent-pid" in command)

    def tick(self) -> None:
        now = time.monotonic()
        for pid, until in list(self.hung.items()):
            if now >= until:
                _signal(pid, signal.SIGCONT)
                del self.hung[pid]
        if not self._progressed():  # a replica that dies while the job starts it ends the job: not a fault here
            return
        replicas = self._replicas()
        if now >= self.due["replica_kill"] and replicas:
            self.due["replica_kill"] = self._next(now, self.schedule.kill_every_s)
            self.faults["replica_kill"] += _signal(self.rng.choice(replicas), signal.SIGKILL)
        awake = [pid for pid in replicas if pid not in self.hung]
        if now >= self.due["replica_hang"] and awake:
            self.due["replica_hang"] = self._next(now, self.schedule.hang_every_s)
            victim = self.rng.choice(awake)
            if _signal(victim, signal.SIGSTOP):
                self.faults["replica_hang"] += 1
                self.hung[victim] = now + self.schedule.hang_s
        rounds = self.schedule.trainer_rounds * len(self.kinds) or float("inf")
        struck = sum(self.faults[k] for k in self.kinds)
        if self.kinds and self.pending is None and now >= self.trainer_due and struck < rounds:
            self.pending = self.kinds[struck % len(self.kinds)]
            self._strike(self.pending)

    def _progressed(self) -> bool:
        """Whether this run of the job has logged a step or epoch (so that every restart moves the job on)."""
        self.progressed = self.progressed or _count_lines(self.metrics) > self.records_at_start
        return self.progressed

    def _strike(self, kind: str) -> None:
        trainers = self._trainers()
        if kind == "sigterm":
            _signal(self.rng.choice(trainers), signal.SIGTERM)  # under torchrun one rank alone
        elif kind == "ctrl_c":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)  # what the terminal sends to the job
        else:
            for pid in trainers:  # every rank writes its part of a checkpoint
                with contextlib.suppress(ProcessLookupError):
                    resource.prlimit(pid, resource.RLIMIT_FSIZE, (DISK_LIMIT_BYTES, DISK_LIMIT_BYTES))

    def ended(self, output: str) -> None:
        """The run of the job ended with ``output``: count its trainer fault if the fault is what stopped it."""
        for pid in list(self.hung):
            _signal(pid, signal.SIGCONT)
        self.hung.clear()
        said = {
            "sigterm": "SIGTERM received: stopped",
            "ctrl_c": "\ninterrupted: ",
            "disk_full": "File too large",
        }
        if self.pending is not None and said[self.pending] in output:
            self.faults[self.pending] += 1


def _count_lines(path: Path) -> int:
    try:
        return len(path.read_bytes().splitlines())
    except FileNotFoundError:
        return 0


def _default_sigint() -> None:
    """In the job's process: SIGINT as a terminal's job has it (a bench started with ``nohup ... &`` ignores it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_job(command: list[str], out_dir: Path, nproc: int, schedule: Schedule | None, log: Path) -> Outcome:
    """Run the job to its end (``schedule``: under its faults, continuing it after each stop as printed)."""
    run_dir = out_dir / RUN_NAME
    injector = Injector(schedule, nproc, run_dir / "metrics.jsonl") if schedule is not None else None
    outcome = Outcome(0.0, run_dir)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    started, runs = time.monotonic(), 0
    log.write_text("")
    while True:
        runs += 1
        with open(log, "a") as sink:
            sink.write(f"\n=== run {runs}: {shlex.join(command)}\n")
            sink.flush()
            begin = sink.tell()
            process = subprocess.Popen(
                command,
                cwd=REPO,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_default_sigint,
            )
        if injector is not None:
            injector.start(process)
        while process.poll() is None:
            if injector is not None:
                injector.tick()
            time.sleep(0.2)
        with open(log) as sink:
            sink.seek(begin)
            output = sink.read()
        _collect(outcome, run_dir / "metrics.jsonl", output)
        if injector is not None:
            injector.ended(output)
        if process.returncode == 0:
            break
        resumed = continue_command(output)
        if "before training started" in output:  # stopped while it loaded: the same command again
            resumed = command
        if resumed is None or injector is None:
            raise RuntimeError(f"the job failed (exit status {process.returncode}), see {log}:\n{output[-3000:]}")
        command = resumed
    outcome.wall_s = time.monotonic() - started
    outcome.faults = injector.faults if injector is not None else {}
    return outcome


def _collect(outcome: Outcome, metrics: Path, output: str) -> None:
    """Keep every metrics record this run of the job wrote (a continuation truncates those past its checkpoint)
    and the samples it said got no reward."""
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            outcome.records.setdefault(line, json.loads(line))
    outcome.unscored_in_logs += sum(int(n) for n in re.findall(r": (\d+) samples got no reward", output))


def final_hashes(run_dir: Path) -> dict[str, str]:
    """sha256 of every file under the run's ``final/``, by relative path."""
    final = run_dir / "final"
    return {
        str(p.relative_to(final)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(final.rglob("*"))
        if p.is_file()
    }


def compared_records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl as it ended, without checkpoint records and the ``UNCOMPARED`` fields."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(UNCOMPARED)} for r in records if r["phase"] != "checkpoint"]


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    """Where two lists of records first differ, or None. NaN equals NaN (JSON's NaN: an evaluation without rewards)."""
    if len(a) != len(b):
        return f"{len(a)} records against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if json.dumps(x, sort_keys=True) != json.dumps(y, sort_keys=True):
            keys = sorted(k for k in {*x, *y} if json.dumps(x.get(k)) != json.dumps(y.get(k)))
            return f"record {i} ({x.get('phase')} {x.get('step', x.get('epoch'))}): {keys}"
    return None


def report(baseline: Outcome, chaos: Outcome, device_is_cpu: bool = True) -> dict:
    """The bench's findings: faults, reward attempts retried, rewards lost and zeroed, overhead, identity."""
    rl = [r for r in chaos.records.values() if r.get("phase") == "rl"]
    difference = first_difference(compared_records(baseline.run_dir), compared_records(chaos.run_dir))
    return {
        "faults": chaos.faults,
        "reward_attempts_retried": int(sum(r.get("reward_failed_attempts", 0) for r in rl)),
        "rewards_lost": int(max(sum(r.get("reward_lost", 0) for r in rl), chaos.unscored_in_logs)),
        "rewards_zeroed": int(sum(r.get("reward_zeroed", 0) for r in rl)),
        "wall_s": {"undisturbed": round(baseline.wall_s, 1), "chaos": round(chaos.wall_s, 1)},
        "overhead": chaos.wall_s / baseline.wall_s - 1,
        "final_identical": final_hashes(baseline.run_dir) == final_hashes(chaos.run_dir),
        "metrics_difference": difference,
        "cpu": device_is_cpu,
    }


def table(found: dict) -> str:
    """The report as a Markdown table."""
    rows = [(f"faults: {kind}", str(n)) for kind, n in found["faults"].items()]
    rows += [
        ("reward attempts failed and retried", str(found["reward_attempts_retried"])),
        ("rewards lost (must be 0)", str(found["rewards_lost"])),
        ("rewards zeroed (must be 0)", str(found["rewards_zeroed"])),
        (
            "wall time undisturbed / under chaos",
            f"{found['wall_s']['undisturbed']:.0f} s / {found['wall_s']['chaos']:.0f} s",
        ),
        ("wall-time overhead", f"{found['overhead']:+.0%}"),
        ("final weights byte-identical (sha256 of final/)", "yes" if found["final_identical"] else "NO"),
        (
            "metrics.jsonl records identical (timing fields aside)",
            "yes" if found["metrics_difference"] is None else f"NO: {found['metrics_difference']}",
        ),
    ]
    width = max(len(what) for what, _ in rows)
    return "\n".join(
        [
            f"| {'':{width}} | result |",
            f"|{'-' * (width + 2)}|--------|",
            *(f"| {what:{width}} | {value} |" for what, value in rows),
        ]
    )


def passed(found: dict) -> bool:
    return (
        found["rewards_lost"] == 0
        and found["rewards_zeroed"] == 0
        and found["metrics_difference"] is None
        and (found["final_identical"] or not found["cpu"])
    )


def chaos(
    out: Path, overrides: list[str], schedule: Schedule, nproc: int = 1, baseline_dir: Path | None = None
) -> dict:
    """Run the job undisturbed (unless ``baseline_dir`` holds such a run) and under ``schedule``; report both."""
    out.mkdir(parents=True, exist_ok=True)
    if baseline_dir is None:
        baseline_dir = out / "undisturbed"
        shutil.rmtree(baseline_dir, ignore_errors=True)
        done = run_job(job_command(nproc, overrides, baseline_dir), baseline_dir, nproc, None, out / "undisturbed.log")
        (baseline_dir / "bench.json").write_text(
            json.dumps({"wall_s": done.wall_s, "overrides": overrides, "nproc": nproc})
        )
    saved = json.loads((baseline_dir / "bench.json").read_text())
    if (saved["overrides"], saved["nproc"]) != (overrides, nproc):
        raise ValueError(
            f"--baseline {baseline_dir} ran {saved['overrides']} on {saved['nproc']} processes, not "
            f"{overrides} on {nproc}: run without --baseline"
        )
    baseline = Outcome(saved["wall_s"], baseline_dir / RUN_NAME)
    chaos_dir = out / "chaos"
    shutil.rmtree(chaos_dir, ignore_errors=True)
    struck = run_job(job_command(nproc, overrides, chaos_dir), chaos_dir, nproc, schedule, out / "chaos.log")
    found = report(baseline, struck)
    (out / "report.json").write_text(json.dumps(found, indent=1))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "chaos", help="where both runs and logs go")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (not of the job)")
    parser.add_argument("--kill-every-s", type=float, default=60.0, help="mean seconds between replica SIGKILLs")
    parser.add_argument("--hang-every-s", type=float, default=120.0, help="mean seconds between replica hangs")
    parser.add_argument("--hang-s", type=float, default=75.0, help="how long a hang lasts (> reward.timeout_s)")
    parser.add_argument(
        "--trainer-every-s",
        type=float,
        default=120.0,
        help="mean seconds from a (re)start's first logged step to its trainer fault",
    )
    parser.add_argument(
        "--trainer-faults",
        default=None,
        help="trainer faults in turn (default: sigterm,ctrl_c,disk_full; torchrun: sigterm)",
    )
    parser.add_argument(
        "--trainer-rounds", type=int, default=0, help="each trainer fault at most N times (0: no limit)"
    )
    parser.add_argument("--nproc", type=int, default=1, help="torchrun processes (1: no torchrun)")
    parser.add_argument("--backend", help="parallel.backend under torchrun (ddp, fsdp2, ...)")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="the --out of an earlier bench of the same job: reuse its undisturbed run",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides of the job (after --)")
    args = parser.parse_args()
    overrides = list(args.overrides) + ([f"parallel.backend={args.backend}"] if args.backend else [])
    chosen = args.trainer_faults or (",".join(TRAINER_FAULTS) if args.nproc == 1 else "sigterm")
    kinds = tuple(k for k in chosen.split(",") if k)
    if unknown := set(kinds) - set(TRAINER_FAULTS):
        parser.error(f"--trainer-faults: unknown {sorted(unknown)}; choose from {TRAINER_FAULTS}")
    periods = (args.kill_every_s, args.hang_every_s, args.hang_s, args.trainer_every_s)
    schedule = Schedule(*periods, kinds, args.seed, args.trainer_rounds)
    baseline = args.baseline / "undisturbed" if args.baseline else None
    found = chaos(args.out.absolute(), overrides, schedule, args.nproc, baseline)
    print(table(found))
    return 0 if passed(found) else 1


if __name__ == "__main__":
    sys.exit(main())
