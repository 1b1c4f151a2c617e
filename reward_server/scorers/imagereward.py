"""``imagereward``: ImageReward v1.0 (BLIP ViT-L/16 image tokens, cross-attended by BLIP's BERT text encoder, an
MLP on the [CLS] state, then ``(reward - 0.16717) / 1.03334``, its released normalisation; ~-2..2, unbounded).

As the reference's ``ImageReward.score``: the prompt is tokenised by BLIP's BERT tokenizer (bert-base-uncased
plus [DEC] and [ENC]), padded and truncated to 35 tokens, with [CLS] first (no [ENC] swap); the image is
resized (short side, PIL bicubic), centre-cropped (torchvision's rounding) and normalised with OpenAI CLIP's
mean/std. Runs on transformers' BlipVisionModel and BlipTextModel; the MLP is LAION's aesthetic head layout.
Departures: none.

Expected layout under the server's ``--model-dir``::

    imagereward/    config.json (a BlipConfig), model.safetensors and the BERT tokenizer, converted from the
                    released ImageReward.pt by ``python -m reward_server.scorers.convert_imagereward --src
                    ImageReward.pt --tokenizer <bert-base-uncased dir> --out <model_dir>/imagereward``
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from reward_server.scorers.aesthetic import AestheticHead
from reward_server.scorers.base import ModelFilesMissing, ScoreOutcome
from reward_server.scorers.hps import OPENAI_MEAN, OPENAI_STD
from reward_server.scorers.local_model import fingerprint, pick_device, require_files, weights_dir

REWARD_MEAN, REWARD_STD = 0.16717362830052426, 1.0333394966054072  # ImageReward's released normalisation
MAX_TOKENS = 35  # the reference tokenises with max_length=35


def imagereward_pixels(image: np.ndarray, size: int) -> torch.Tensor:
    """The reference transform of one uint8 ``[H, W, C]`` image: torchvision's Resize(size, BICUBIC) and
    CenterCrop(size) on a PIL image, ToTensor, Normalize(OpenAI mean/std) -> float ``[3, size, size]``."""
    rgb = np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image[:, :, :3]
    pil = Image.fromarray(np.ascontiguousarray(rgb))
    width, height = pil.size
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
    if (new_w, new_h) != (width, height):
        pil = pil.resize((new_w, new_h), Image.BICUBIC)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    pixels = torch.from_numpy(np.array(pil.crop((left, top, left + size, top + size)))).permute(2, 0, 1).float() / 255
    return (pixels - torch.tensor(OPENAI_MEAN).view(3, 1, 1)) / torch.tensor(OPENAI_STD).view(3, 1, 1)


class ImageRewardModel(nn.Module):
    """BLIP's ViT and multimodal BERT (transformers' classes) and the MLP head: the raw, unnormalised reward."""

    def __init__(self, config: Any) -> None:
        from transformers import BlipTextModel, BlipVisionModel

        super().__init__()
        self.vision_model = BlipVisionModel(config.vision_config)
        self.text_encoder = BlipTextModel(config.text_config, add_pooling_layer=False)
        self.mlp = AestheticHead(config.text_config.hidden_size)

    def forward(self, pixels_BCHW: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        image_BND = self.vision_model(pixel_values=pixels_BCHW).last_hidden_state
        image_mask = torch.ones(image_BND.shape[:-1], dtype=torch.long, device=image_BND.device)
        text = self.text_encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_BND,
            encoder_attention_mask=image_mask,
            is_decoder=False,
        )
        return self.mlp(text.last_hidden_state[:, 0].float()).squeeze(-1)


class ImageRewardScorer:
    """ImageReward v1.0 read from ``<model_dir>/imagereward``."""

    name = "imagereward"
    description = "ImageReward v1.0 (BLIP + MLP, human preference), normalised by its released mean/std; ~-2..2"
    score_range = (None, None)

    def __init__(self, model_dir: Path | None = None, device: str | None = None) -> None:
        """Args:
        model_dir: the server's ``--model-dir``; weights are read from ``<model_dir>/imagereward``.
        device: torch device; default CUDA when available, else CPU.
        """
        self._root = weights_dir(model_dir, "imagereward")
        self._device = pick_device(device)
        self._model: ImageRewardModel | None = None
        self._tokenizer: Any = None
        self._size = 0
        self._version = "unloaded"

    @property
    def version(self) -> str:
        return self._version

    def load(self) -> None:
        from safetensors.torch import load_file
        from transformers import AutoTokenizer, BlipConfig

        if self._root is None:
            raise ModelFilesMissing(
                "imagereward needs --model-dir with imagereward/ "
                "(see python -m reward_server.scorers.convert_imagereward)"
            )
        require_files(
            self._root,
            ("config.json", "model.safetensors", "tokenizer_config.json"),
            "convert ImageReward.pt there with python -m reward_server.scorers.convert_imagereward --tokenizer ...",
        )
        config = BlipConfig.from_pretrained(self._root)
        model = ImageRewardModel(config)
        result = model.load_state_dict(load_file(str(self._root / "model.safetensors")), strict=False)
        if result.missing_keys or result.unexpected_keys:  # never run with random weights
            raise ValueError(
                f"{self._root} lacks or has unknown weights: {(result.missing_keys + result.unexpected_keys)[:5]}"
            )
        self._model = model.eval().to(self._device)
        self._tokenizer = AutoTokenizer.from_pretrained(self._root)
        self._size = config.vision_config.image_size
        self._version = f"imagereward+blip-{config.vision_config.hidden_size}+{fingerprint(self._root)}"
        self.score([np.zeros((64, 48, 3), np.uint8)], [""], [{}])

    @torch.no_grad()
    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[ScoreOutcome]:
        assert self._model is not None, "load() must be called before score()"
        pixels_BCHW = torch.stack([imagereward_pixels(image, self._size) for image in images]).to(self._device)
        tokens = self._tokenizer(
            prompts, padding="max_length", truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
        ).to(self._device)
        lengths = [len(ids) for ids in self._tokenizer(prompts)["input_ids"]]
        raw_B = self._model(pixels_BCHW, tokens["input_ids"], tokens["attention_mask"])
        return [
            ScoreOutcome(score=(raw - REWARD_MEAN) / REWARD_STD, details={"raw": raw, "truncated": n > MAX_TOKENS})
            for raw, n in zip(raw_B.tolist(), lengths, strict=True)
        ]
