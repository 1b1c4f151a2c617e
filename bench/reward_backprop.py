"""CPU cost of one RL epoch of the differentiable-reward algorithms beside GRPO's, on the embedded digits task.

For each algorithm preset (``configs/algorithms/<name>.yaml`` over the embedded job): one rollout of the epoch's
160 images (10 prompts x 16) with its sampler, then its whole update (every unit's loss and backward; no optimizer
step), on the tiny model in ``--model`` (the demo's; built by the first ``trainer/main.py`` run). Process CPU
seconds on one thread, so the numbers do not depend on the machine's load; the median of ``--repeats``.

    python bench/reward_backprop.py [--only grpo,draft,drtune,refl] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from trainer.algorithms import build_algorithm
from trainer.algorithms.base import LossContext, Rewards
from trainer.config import load_config
from trainer.distributed import SingleProcess
from trainer.models.sd3 import SD3Adapter
from trainer.models.tiny import TinyConfig
from trainer.rollout import rollout

REPO = Path(__file__).resolve().parents[1]


def epoch_cost(name: str, model: str, seed: int) -> tuple[float, float]:
    """(rollout CPU s, update CPU s) of one epoch of algorithm preset ``name``."""
    config = load_config([str(REPO / "configs/embedded_digits.yaml"), str(REPO / f"configs/algorithms/{name}.yaml")])
    torch.manual_seed(seed)
    adapter = SD3Adapter(TinyConfig(path=model))
    algo = build_algorithm(config.algorithm)
    algo.setup(adapter, None, SingleProcess(torch.device("cpu")))
    digits = torch.arange(10).repeat_interleave(config.algorithm.group_size)
    prompts = [f"a handwritten digit {d}" for d in digits.tolist()]
    start = time.process_time()
    ro = rollout(adapter, adapter.denoiser, prompts, digits, algo.sampler, torch.Generator().manual_seed(seed))
    sampled = time.process_time()
    rewards = torch.rand(len(prompts), generator=torch.Generator().manual_seed(seed))
    batch = algo.make_batch(ro, Rewards(rewards, rewards, digits, 0))
    ctx = LossContext(adapter, adapter.denoiser, None)
    for units in algo.plan(batch, torch.Generator().manual_seed(seed)):
        for unit in units:
            loss, _ = algo.loss(ctx, unit)
            loss.backward()
    return sampled - start, time.process_time() - sampled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="grpo,draft,drtune,refl")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=str(REPO / ".cache/rewardflow/tiny-sd3-digits"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| algorithm | rollout CPU s | update CPU s | epoch CPU s |\n|---|---|---|---|")
    for name in args.only.split(","):
        costs = [epoch_cost(name, args.model, seed) for seed in range(args.repeats)]
        rollout_s, update_s = (statistics.median(c[i] for c in costs) for i in (0, 1))
        print(f"| {name} | {rollout_s:.2f} | {update_s:.2f} | {rollout_s + update_s:.2f} |", flush=True)


if __name__ == "__main__":
    main()
