"""``standard_normal``: noise on the model's device from a generator on any device (diffusers' rule)."""

from __future__ import annotations

import pytest
import torch

from trainer.samplers import generator_device, standard_normal


def test_cpu_generator_draws_what_torch_randn_draws():
    noise = standard_normal((3, 5), torch.Generator().manual_seed(4), "cpu")
    assert noise.dtype == torch.float32 and noise.device.type == "cpu"
    assert torch.equal(noise, torch.randn(3, 5, generator=torch.Generator().manual_seed(4)))


def test_without_a_generator_the_draw_is_on_the_target_device():
    assert generator_device(None, "cpu") == torch.device("cpu")
    torch.manual_seed(9)
    expected = torch.randn(4)
    torch.manual_seed(9)
    assert torch.equal(standard_normal((4,), None, "cpu"), expected)


@pytest.mark.gpu
def test_a_cpu_generator_gives_the_same_noise_on_the_gpu():
    noise = standard_normal((2, 8), torch.Generator().manual_seed(1), "cuda")
    assert noise.device.type == "cuda"
    assert torch.equal(noise.cpu(), standard_normal((2, 8), torch.Generator().manual_seed(1), "cpu"))


@pytest.mark.gpu
def test_a_gpu_generator_draws_on_the_gpu():
    generator = torch.Generator("cuda").manual_seed(1)
    noise = standard_normal((2, 8), generator, "cuda")
    assert noise.device.type == "cuda" and generator_device(generator).type == "cuda"
    assert torch.equal(noise, standard_normal((2, 8), torch.Generator("cuda").manual_seed(1), "cuda"))
