"""Rollout forwards per trained sample for each sampler, counted: the denoiser's rows, seen by a forward hook.

SD3.5-M's Flow-GRPO recipe shape (10 steps, groups of 8) on the tiny model (the count does not depend on the
model); one forward is one latent row through the denoiser (CFG would double every row alike). A trained sample
is one (image, step) pair the policy loss takes: the stochastic steps but the last, all of them trained.

    python bench/branching_forwards.py [--prompts 4] [--seeds 0,1,2,3,4,5]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from trainer.models.sd3 import SD3Adapter
from trainer.models.tiny import TinyConfig, build_tiny_sd3
from trainer.rollout import SamplerSettings, rollout

STEPS, GROUP = 10, 8
SAMPLERS = {
    "none (every step SDE)": SamplerSettings(num_steps=STEPS),
    "sde_window 2 in [0, 5)": SamplerSettings(num_steps=STEPS, sde_window=2, window_range=(0, 5)),
    "branch, S1 (window 1 in [0, 2))": SamplerSettings(num_steps=STEPS, sde_window=1, window_range=(0, 2), branch=True),
    "branch, window 2 in [0, 5)": SamplerSettings(num_steps=STEPS, sde_window=2, window_range=(0, 5), branch=True),
    "tree 2x2x2 at BranchGRPO's steps (0, 3, 6)": SamplerSettings(num_steps=STEPS, tree=(2, 2, 2)),
    "tree 2x2x2 at steps (0, 1, 2)": SamplerSettings(num_steps=STEPS, tree=(2, 2, 2), tree_steps=(0, 1, 2)),
}


def count(adapter, prompts: int, settings: SamplerSettings, seed: int) -> tuple[int, int, int]:
    """(rows through the denoiser, images, trained (image, step) pairs) of one rollout of ``prompts`` groups."""
    rows = []
    hook = adapter.denoiser.register_forward_pre_hook(
        lambda _, args, kwargs: rows.append(len(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])),
        with_kwargs=True,
    )
    group_ids = torch.arange(prompts).repeat_interleave(GROUP)
    texts = [f"a handwritten digit {int(g) % 10}" for g in group_ids]
    try:
        ro = rollout(adapter, adapter.denoiser, texts, group_ids, settings, torch.Generator().manual_seed(seed))
    finally:
        hook.remove()
    assert sum(rows) == ro.forwards, (sum(rows), ro.forwards)
    return sum(rows), len(texts), len(texts) * len(ro.trainable_steps())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--seeds", default="0,1,2,3,4,5")
    parser.add_argument("--model", default=".cache/rewardflow/tiny-sd3-digits")
    args = parser.parse_args()
    if not Path(args.model).is_dir():
        build_tiny_sd3(args.model)
    adapter = SD3Adapter(TinyConfig(path=args.model))
    adapter.denoiser.eval()
    print("| sampler | forwards per image | trained steps per image | forwards per trained (image, step) |")
    print("|---|---|---|---|")
    for name, settings in SAMPLERS.items():
        totals = [count(adapter, args.prompts, settings, int(s)) for s in args.seeds.split(",")]
        forwards, images, trained = (sum(t[k] for t in totals) for k in range(3))
        print(f"| {name} | {forwards / images:.3f} | {trained / images:.2f} | {forwards / trained:.3f} |")


if __name__ == "__main__":
    main()
