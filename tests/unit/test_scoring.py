"""The differentiable scorers (scoring/): the in-process score equals the served one, its gradient reaches the
pixels, and the flow adapters decode differentiably without changing the no-grad numbers."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_models as testing
import torch

from reward_server.scorers.digit import DigitScorer
from scoring import build_differentiable
from scoring.digit import to_digit_features
from scoring.modules import DigitProbability, digit_features
from trainer.config import load_config
from trainer.models import build_adapter


@pytest.fixture(scope="module")
def served_and_inprocess():
    served = DigitScorer()
    served.load()
    return served, DigitProbability()


def test_the_in_process_digit_reward_equals_the_served_one(served_and_inprocess):
    """The same uint8 pixels: the server's predict_proba and the differentiable softmax agree to 1e-9."""
    served, inprocess = served_and_inprocess
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (12, 16, 16, 1), dtype=np.uint8)
    prompts = [f"a handwritten digit {d}" for d in range(10)] + ["seven", "a digit 3"]
    expected = [o.score for o in served.score(list(images), prompts, [{}] * len(prompts))]
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).double() / 255.0
    got = inprocess(pixels, prompts)
    assert torch.allclose(got.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0)
    assert np.allclose(digit_features(pixels).numpy(), np.stack([to_digit_features(i) for i in images]), atol=1e-12)


def test_its_gradient_reaches_every_pixel_block_the_classifier_reads(served_and_inprocess):
    """Every 8x8 block with a classifier weight gets gradient (the always-blank border blocks have none)."""
    _, inprocess = served_and_inprocess
    pixels = torch.rand(2, 3, 16, 16, requires_grad=True)
    inprocess(pixels, ["a handwritten digit 4", "a handwritten digit 0"]).sum().backward()
    blocks = pixels.grad.abs().sum(1).reshape(2, 8, 2, 8, 2).sum((2, 4)).reshape(2, 64)
    read = inprocess.weight.abs().sum(0) > 0
    assert int(read.sum()) > 50
    assert torch.equal(blocks > 0, read.expand(2, 64))


def test_a_scorer_without_differentiable_form_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^scorer 'ocr' has no differentiable form: set algorithm.scorer") as err:
        build_differentiable("ocr")
    assert "\n" not in str(err.value)


def test_the_trained_scorer_must_be_served(tmp_path):
    with pytest.raises(ValueError, match=r"algorithm.scorer=digit is not served: add it to reward.weights"):
        load_config(None, ["algorithm.name=draft", "reward.weights={brightness: 1.0}"])


def test_a_prompt_without_digit_is_refused(served_and_inprocess):
    with pytest.raises(ValueError, match="needs a digit 0-9 or digit word in every prompt: 'a cat'"):
        served_and_inprocess[1](torch.rand(1, 1, 16, 16), ["a cat"])


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_flow_adapters_decode_with_gradient_and_unchanged_numbers(tmp_path_factory, name):
    """decode under no_grad (rollouts) and with gradient give the same images; the gradient reaches the latents."""
    adapter = build_adapter(testing.tiny_config(name, tmp_path_factory.mktemp("models")), "cpu")
    latents = adapter.prepare_latents(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = adapter.decode(latents)
    wanting = latents.clone().requires_grad_(True)
    images = adapter.decode(wanting)
    assert torch.equal(images.detach(), plain)
    (images * torch.rand_like(images)).sum().backward()
    assert wanting.grad is not None and float(wanting.grad.abs().sum()) > 0


def test_clip_preprocessing_in_torch_is_the_pil_processors_to_a_pixel_level(tiny_aesthetic_model_dir):
    """clip_pixels of images in [0, 1] against CLIPImageProcessorPil of their uint8 form: the same sizes, crop and
    normalisation; the resampling of a smooth image within 2 levels of 255 (PIL's bicubic kernel is a = -0.5 on a
    rounded uint8 grid, torch's a = -0.75 on floats: sharp edges differ by up to 7); no resize: exact."""
    from scoring.aesthetic import clip_pixels, load_aesthetic

    _, _, processor, _ = load_aesthetic(tiny_aesthetic_model_dir / "aesthetic")
    rng = np.random.default_rng(0)
    smooth = torch.nn.functional.interpolate(
        torch.from_numpy(rng.random((2, 3, 12, 20))).float(), size=(48, 80), mode="bilinear"
    )
    for images in (smooth, torch.from_numpy(rng.random((2, 3, 32, 32))).float()):
        uint8 = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        pil = processor(images=list(uint8), return_tensors="pt")["pixel_values"]
        ours = clip_pixels(torch.from_numpy(uint8).permute(0, 3, 1, 2).float() / 255, processor)
        assert ours.shape == pil.shape
        std = torch.tensor(processor.image_std).view(1, 3, 1, 1)
        error = ((ours - pil) * std * 255).abs()  # in levels of 255
        assert float(error.max()) < (1e-3 if images.shape[-1] == 32 else 2.0) and float(error.mean()) < 0.5


def test_the_in_process_aesthetic_equals_the_served_one_and_has_gradient(tiny_aesthetic_model_dir):
    from reward_server.scorers.aesthetic import AestheticScorer

    served = AestheticScorer(model_dir=tiny_aesthetic_model_dir, device="cpu")
    served.load()
    inprocess = build_differentiable("aesthetic", model_dir=str(tiny_aesthetic_model_dir))
    images = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (2, 3, 32, 32))).float() / 255
    expected = served.score(list((images * 255).round().byte().permute(0, 2, 3, 1).numpy()), ["", ""], [{}, {}])
    wanting = images.clone().requires_grad_(True)
    got = inprocess(wanting, ["", ""])
    assert torch.allclose(got.detach(), torch.tensor(expected), atol=1e-4)
    got.sum().backward()
    assert float(wanting.grad.abs().sum()) > 0


def test_a_scorer_with_weights_needs_its_folder():
    from trainer.algorithms.draft import DRaFTConfig

    with pytest.raises(ValueError, match=r"algorithm.scorer=aesthetic reads weights: set algorithm.scorer_dir"):
        DRaFTConfig(scorer="aesthetic")


def test_an_epsilon_model_is_refused_before_training(tmp_path_factory):
    """The differentiable-reward algorithms redo flow steps: a DDIM model is refused as the trainer sets them up."""
    from trainer.algorithms.drtune import DRTune, DRTuneConfig
    from trainer.distributed import SingleProcess

    adapter = build_adapter(testing.tiny_config("sd15_inpaint", tmp_path_factory.mktemp("models")), "cpu")
    with pytest.raises(ValueError, match=r"^algorithm.name=drtune needs a flow model; this one samples with ddim"):
        DRTune(DRTuneConfig()).setup(adapter, None, SingleProcess(torch.device("cpu")))


def test_the_in_process_brightness_equals_the_served_one():
    from reward_server.scorers.brightness import BrightnessScorer

    images = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (3, 3, 8, 8))).float() / 255
    served = BrightnessScorer().score(
        list((images * 255).round().byte().permute(0, 2, 3, 1).numpy()), [""] * 3, [{}] * 3
    )
    assert torch.allclose(build_differentiable("brightness")(images, [""] * 3), torch.tensor(served), atol=1e-6)
