"""``flow.inpaint_velocity``: an Euler step with it is the inpainting pipelines' blend after the step, given
the trajectory's initial noise and schedule that ``rollout`` binds to the conditioning
(``Conditioning.starting_at``)."""

from __future__ import annotations

import torch

from trainer.models.base import Conditioning
from trainer.models.flow import inpaint_velocity

SCHEDULE = torch.tensor([1.0, 0.75, 0.4, 0.0])


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, v, known, noise = (torch.randn(2, 6, 3, generator=g) for _ in range(4))
    mask = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 0.0]).view(1, 6, 1).expand(2, -1, -1)  # soft, per token
    return x, v, known, noise, mask


def test_an_euler_step_with_it_is_the_pipelines_blend_at_every_step():
    """x + (s' - s) u = (1 - m) (s' noise + (1 - s') known) + m (x + (s' - s) v), with x anywhere (a soft
    mask leaves the known region's latents off the noised source); the last step lands on the source."""
    x, v, known, noise, mask = _inputs()
    schedule = SCHEDULE.expand(2, -1)
    for i in range(len(SCHEDULE) - 1):
        s, s_next = SCHEDULE[i], SCHEDULE[i + 1]
        u = inpaint_velocity(v, x, s.expand(2), known, mask, noise, schedule)
        blend = (1 - mask) * (s_next * noise + (1 - s_next) * known) + mask * (x + (s_next - s) * v)
        torch.testing.assert_close(x + (s_next - s) * u, blend, rtol=0, atol=1e-6)
        assert torch.equal(u[:, 4], v[:, 4])  # m = 1: the model's own velocity
        without = inpaint_velocity(v, x, s.expand(2), known, mask)
        if i < len(SCHEDULE) - 2:  # only the last step needs no trajectory
            assert (x + (s_next - s) * without - blend).abs().max() > 0.1
        x = blend


def test_off_the_trajectory_it_points_at_the_known_latents():
    """A sigma that is no step of the schedule (a supervised target's), or no trajectory: where m = 0 the
    velocity whose clean estimate x - sigma u is the known latents."""
    x, v, known, noise, mask = _inputs(1)
    sigma = torch.tensor([0.6, 0.3])
    for u in (
        inpaint_velocity(v, x, sigma, known, mask, noise, SCHEDULE.expand(2, -1)),
        inpaint_velocity(v, x, sigma, known, mask),
    ):
        torch.testing.assert_close(x[:, 0] - sigma.view(2, 1) * u[:, 0], known[:, 0], rtol=0, atol=1e-6)
    mixed = torch.tensor([0.75, 0.3])  # one row on the schedule, one off
    u = inpaint_velocity(v, x, mixed, known, mask, noise, SCHEDULE.expand(2, -1))
    torch.testing.assert_close(x[1, 0] - 0.3 * u[1, 0], known[1, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(
        x[0, 0] + (0.4 - 0.75) * u[0, 0], 0.4 * noise[0, 0] + 0.6 * known[0, 0], rtol=0, atol=1e-6
    )


def test_the_trajectory_travels_with_the_conditioning():
    """``select`` and ``cat`` (rollout chunks, training units) keep each row's noise and schedule."""
    noise = torch.randn(3, 4, 2)
    cond = Conditioning(embeds={"e": torch.randn(3, 5)}).starting_at(noise, SCHEDULE)
    assert cond.schedule.shape == (3, 4) and torch.equal(cond.schedule[2], SCHEDULE)
    part = cond.select(torch.tensor([2, 0]))
    assert torch.equal(part.noise, noise[[2, 0]]) and part.schedule.shape == (2, 4)
    whole = Conditioning.cat([cond.select(slice(0, 1)), cond.select(slice(1, 3))])
    assert torch.equal(whole.noise, noise) and torch.equal(whole.schedule, cond.schedule)
