"""Which steps of a rollout are stochastic (``trainer.rollout.window_mask``), and which windows are refused."""

from __future__ import annotations

import pytest
import torch

from trainer.rollout import SamplerSettings, window_mask


@pytest.mark.parametrize("window_range", [(0, 0), (0, 2), (1, 2)])
def test_every_window_trains_the_same_number_of_steps(window_range):
    """A window never reaches the last step (never trained), so every draw, on every rank, trains
    ``sde_window`` steps: sharded backends run one forward per unit and need the same count on each rank."""
    settings = SamplerSettings(num_steps=4, sde_window=2, window_range=window_range)
    starts = set()
    for seed in range(50):
        mask = window_mask(settings, torch.Generator().manual_seed(seed))
        steps = torch.nonzero(mask).flatten()
        assert len(steps) == 2 and int(steps[-1]) < 3 and int(steps[1] - steps[0]) == 1
        starts.add(int(steps[0]))
    assert starts == set(range(*window_range) if window_range != (0, 0) else range(2))


def test_a_window_reaching_the_last_step_is_refused():
    """As the settings are made (the config is read), not at the first rollout after a warm-up."""
    with pytest.raises(ValueError, match=r"window_range=\(0, 3\).*num_steps=4.*\[0, 2\).*last step"):
        SamplerSettings(num_steps=4, sde_window=2, window_range=(0, 3))
    with pytest.raises(
        ValueError,
        match=r"^sde_window=4 must be less than num_steps=4 \(the last step is never "
        r"trained\): lower sde_window or raise num_steps$",
    ):  # was "in [0, 0)"
        SamplerSettings(num_steps=4, sde_window=4)
    assert window_mask(SamplerSettings(num_steps=4), None).all()  # no window: every step
