"""A short GRPO job (RL, evaluation) with ``parallel.sequence_parallel=2`` on 2 torchrun processes gives
the losses of the same job in one process: the 2 ranks form one data-parallel replica that splits each sample's
tokens, so it sees the single process's data and noise; and it asks the reward server for as many scores (the
group's first rank asks, the other gets its answer). Parametrized by adapter name: any adapter whose tiny
model's transformer has a diffusers context-parallel plan (tests/tiny_models).
Also: Wan 2.2 under DDP, where a backward may reach one expert only. Slow tier: per model two job start-ups, a reward
server shared (~1 min each on 2 cores).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
MODELS = ("flux", "wan")
"""Adapters whose tiny transformer has a context-parallel plan and whose token counts divide by 2: an image model
and a video model."""
KEYS = ("policy_loss", "grad_norm", "reward_mean", "kl")
TOL, ATOL = 1e-4, 1e-6
"""Relative and absolute: attention and the gradient reductions sum in another order, and the rollouts' rounding
reaches the rewards and the next step's samples (observed: 1e-6 relative)."""


@pytest.fixture(scope="module")
def reward_url(tmp_path_factory) -> Iterator[str]:
    from trainer.rewards.launcher import LocalRewardPool

    with LocalRewardPool(
        ["brightness"], replicas=1, log_dir=tmp_path_factory.mktemp("reward"), ready_timeout_s=600
    ) as pool:
        yield pool.urls[0]


def job(name: str, root: Path, out: Path, run: str, reward_url: str) -> list[str]:
    """trainer/main.py's arguments: the tiny model ``name`` (built under ``root``), 2 RL epochs of 2 prompts x 4
    samples with a KL to the reference, an evaluation after each."""
    import tiny_models as testing

    model = testing.tiny_config(name, root)
    prompts = root / "prompts.txt"
    prompts.write_text("".join(f"a {colour} square\n" for colour in ("red", "green", "blue", "white", "black")))
    return [
        f"model.name={name}",
        f"model.path={model.path}",
        *(f"model.{key}={value}" for key, value in testing.tiny(name).config.items()),  # size, frames, text length
        "model.dtype=float32",
        "data.name=prompt_file",
        f"data.path={prompts}",
        "data.prompts_per_epoch=2",
        "algorithm.group_size=4",
        "algorithm.kl_beta=0.04",
        "train.warmup_steps=0",  # a prompt file has no supervised images: RL and evaluation only
        "train.epochs=2",
        "train.checkpoint_every=0",
        "eval.samples_per_prompt=1",
        "eval.num_steps=2",
        "eval.every=1",
        "reward.weights={brightness: 1.0}",
        f"reward.urls=[{reward_url}]",
        f"logging.output_dir={out}",
        f"logging.run_name={run}",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]


def _run(nproc: int, args: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += [] if nproc == 1 else [f"--nproc_per_node={nproc}"]
    out = subprocess.run([*launcher, "trainer/main.py", *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}"


def _items_scored(url: str) -> float:
    """The items the reward server has scored so far (its ``rewardflow_items_total``, every scorer and outcome)."""
    import httpx

    text = httpx.get(f"{url}/metrics", trust_env=False, timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("rewardflow_items_total{")
    )


def _records(run_dir: Path) -> dict[str, list[dict]]:
    by_phase: dict[str, list[dict]] = {}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        by_phase.setdefault(record["phase"], []).append(record)
    return by_phase


@pytest.mark.parametrize("name", MODELS)
def test_two_ranks_splitting_tokens_train_like_one_process(name, reward_url, tmp_path):
    before = _items_scored(reward_url)
    _run(1, job(name, tmp_path / "models", tmp_path, "single", reward_url))
    single_items = _items_scored(reward_url) - before
    split = ["parallel.backend=fsdp2", "parallel.sequence_parallel=2"]
    _run(2, [*job(name, tmp_path / "models", tmp_path, "split", reward_url), *split])
    assert single_items > 0 and _items_scored(reward_url) - before - single_items == single_items
    single, parallel = _records(tmp_path / "single"), _records(tmp_path / "split")
    for phase in ("rl", "eval"):
        expected, got = single.get(phase, []), parallel.get(phase, [])
        assert expected and [r["step"] for r in got] == [r["step"] for r in expected], phase
        for a, b in zip(expected, got, strict=True):
            for key in (k for k in KEYS if k in a):
                assert abs(b[key] - a[key]) <= TOL * abs(a[key]) + ATOL, (phase, a["step"], key, a[key], b[key])


@pytest.mark.parametrize("experts", ["both", "high_noise"])
def test_wan22_trains_under_ddp_when_a_step_runs_one_expert(experts, reward_url, tmp_path):
    """Wan 2.2 under DDP on 2 ranks, one trained step an epoch drawn from all 10 (seed 0: three epochs on the high
    noise expert, the fourth on the low noise one): a backward reaches one expert's rows only, yet DDP, which needs
    every trained parameter in each backward, trains every epoch (the idle expert's zero tie). Training both
    experts, every epoch moves the weights; training the high noise one alone, the epoch whose step ran the frozen
    expert has a gradient of exactly 0 and the others do not."""
    window = [
        "algorithm.sampler.num_steps=10",
        "algorithm.sampler.sde_window=1",
        "algorithm.sampler.window_range=[0,9]",
    ]
    args = [*job("wan22", tmp_path / "models", tmp_path, "ddp", reward_url), *window]
    _run(2, [*args, "parallel.backend=ddp", f"model.experts={experts}", "train.epochs=4", "eval.every=0"])
    rl = _records(tmp_path / "ddp")["rl"]
    assert len(rl) == 4 and all(math.isfinite(r["policy_loss"]) for r in rl)
    norms = [r["grad_norm"] for r in rl]
    assert all(n > 0 for n in norms) if experts == "both" else (0 in norms and any(n > 0 for n in norms)), norms
