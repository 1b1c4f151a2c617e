"""bench/chaos.py at toy size: the digits demo under every fault at once (reward replicas SIGKILLed and hung,
SIGTERM, Ctrl-C, a file size limit cutting a checkpoint write, each run continued as it printed) ends with no
reward lost or zeroed, the undisturbed run's metrics and byte-identical final/ files; under torchrun (FSDP2) with
one rank's process SIGTERMed mid-run, the same. (DDP's kill -9 and resume under torchrun are test_backends.py's,
and its stop signals to one rank test_interrupt.py's: a DDP chaos run here cost 60-90 s of the slow tier.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("bench_chaos", REPO / "bench" / "chaos.py")
bench = sys.modules[SPEC.name] = importlib.util.module_from_spec(SPEC)  # its dataclasses look themselves up
SPEC.loader.exec_module(bench)

pytestmark = pytest.mark.slow
TOY = [
    "algorithm.group_size=2",
    "algorithm.sampler.num_steps=4",
    "algorithm.sampler.window_range=[0,2]",
    "data.prompts_per_epoch=4",
    "eval.samples_per_prompt=1",
    "eval.num_steps=2",
    "eval.every=3",
    "train.warmup_steps=4",
    "train.warmup_checkpoint_every=2",
    "train.checkpoint_every=1",
    "logging.progress=false",
    "logging.tensorboard=false",
    "reward.timeout_s=3",
]  # a hung replica's requests fail over after 3 s


def _check(found: dict, kinds: tuple[str, ...], out: Path) -> None:
    assert all(found["faults"][kind] >= 1 for kind in kinds), found
    assert found["rewards_lost"] == 0 and found["rewards_zeroed"] == 0, found
    assert found["metrics_difference"] is None, found
    assert found["final_identical"], found
    records = bench.Outcome(0.0, out / "chaos" / bench.RUN_NAME)
    bench._collect(records, records.run_dir / "metrics.jsonl", "")
    rl = [r for r in records.records.values() if r["phase"] == "rl"]
    assert rl and all({"reward_lost", "reward_zeroed", "reward_failed_attempts"} <= set(r) for r in rl)


def test_the_demo_under_every_fault_ends_as_the_undisturbed_run(tmp_path):
    schedule = bench.Schedule(kill_every_s=6, hang_every_s=8, hang_s=5, trainer_every_s=3, seed=1, trainer_rounds=1)
    found = bench.chaos(tmp_path, [*TOY, "train.epochs=6"], schedule)
    print(bench.table(found))
    _check(found, (*bench.REPLICA_FAULTS, *bench.TRAINER_FAULTS), tmp_path)


def test_a_rank_stopped_under_torchrun_continues_to_the_undisturbed_weights(tmp_path):
    schedule = bench.Schedule(
        kill_every_s=8,
        hang_every_s=0,
        trainer_every_s=3,
        trainer_faults=("sigterm",),
        seed=2,
        trainer_rounds=1,
    )
    found = bench.chaos(tmp_path, [*TOY, "train.epochs=4", "parallel.backend=fsdp2"], schedule, nproc=2)
    print(bench.table(found))
    _check(found, ("replica_kill", "sigterm"), tmp_path)
