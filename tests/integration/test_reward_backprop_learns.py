"""refl, draft and drtune climb the reward they differentiate: a few optimizer steps on one rollout of the tiny
model raise the in-process digit reward of that rollout's prompts and noise."""

from __future__ import annotations

import pytest
import torch

from trainer.algorithms.base import LossContext, Rewards
from trainer.algorithms.draft import DRaFT, DRaFTConfig
from trainer.algorithms.drtune import DRTune, DRTuneConfig
from trainer.algorithms.refl import ReFL, ReFLConfig
from trainer.distributed import SingleProcess
from trainer.models.sd3 import SD3Adapter
from trainer.models.tiny import TinyConfig
from trainer.rollout import SamplerSettings, rollout

SETTINGS = SamplerSettings(num_steps=6, noise_level=0.0)
CASES = {
    "refl": lambda: ReFL(ReFLConfig(sampler=SETTINGS, loss="negative")),
    "draft": lambda: DRaFT(DRaFTConfig(backprop_steps=2, sampler=SETTINGS)),
    "drtune": lambda: DRTune(DRTuneConfig(train_steps=2, sampler=SETTINGS)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_few_steps_raise_the_differentiated_reward(tiny_model_dir, name):
    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))
    algo = CASES[name]()
    algo.setup(adapter, None, SingleProcess(torch.device("cpu")))
    prompts = [f"a handwritten digit {d}" for d in range(10)] * 2
    group_ids = torch.arange(len(prompts))
    params = [p for p in adapter.trainable.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    ctx = LossContext(adapter, adapter.denoiser, None)

    def sample():
        ro = rollout(adapter, adapter.denoiser, prompts, group_ids, SETTINGS, torch.Generator().manual_seed(0))
        return ro, algo.scorer(ro.images, prompts)

    ro, before = sample()
    for step in range(8):
        batch = algo.make_batch(ro, Rewards(before, before, group_ids, 0))
        for units in algo.plan(batch, torch.Generator().manual_seed(step)):
            optimizer.zero_grad()
            for unit in units:
                algo.loss(ctx, unit)[0].backward()
            optimizer.step()
        ro, _ = sample()
    _, after = sample()
    assert float(after.mean()) > float(before.mean()) + 0.05, (float(before.mean()), float(after.mean()))
