"""Parity of the learned preference scorers (``aesthetic``, ``pickscore``, ``clipscore``, ``hpsv2``, ``imagereward``,
``hpsv3``) with transcriptions of their reference scoring functions, on tiny random models.

No real weights are reachable, so each reference's math runs here on the same tiny modules the scorer loads:
its preprocessing written out (resize rule, crop rounding, interpolation, mean/std), its prompt handling
(cleaning, truncation, padding) and its score formula (normalisation, logit scale, divisor, output transform).
"""

from __future__ import annotations

import html
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transcribed import Source, transcribes

from reward_server.scorers import SCORERS, run_scorer

OPENAI_MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
OPENAI_STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)
DDPO = Source(
    "kvablack/ddpo-pytorch",
    "1958463f020112c9a7bc85768d296daacc2e1b4b",
    "ddpo_pytorch/aesthetic_scorer.py",
    "AestheticScorer.__call__",
)
# Flow-GRPO's scorers, read at the repository's commit of 2025-11-04 (the clip scorer came with 62117059).
FLOW_GRPO = "yifan123/flow_grpo"
FLOW_GRPO_COMMIT = "9745241cf1101407e9b518dd4f10498092150522"
RNG = np.random.default_rng(0)
# Shapes whose resize and centre crop leave odd margins (a floor and a round-half offset differ there).
IMAGES = [RNG.integers(0, 256, shape, dtype=np.uint8) for shape in [(48, 40, 3), (32, 67, 3), (90, 45, 1), (35, 35, 3)]]


def _clip_processor_pixels(image: np.ndarray, size: int, crop: int) -> torch.Tensor:
    """transformers' CLIPImageProcessor as the references call it (CLIPProcessor, transformers 4.40): PIL bicubic
    resize of the short side to ``size`` (long side ``int(size * long / short)``), centre crop with floored offsets,
    x / 255, OpenAI mean/std -> ``[3, crop, crop]``."""
    rgb = np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image
    height, width = rgb.shape[:2]
    short, long = min(height, width), max(height, width)
    new_w, new_h = (size, int(size * long / short)) if width <= height else (int(size * long / short), size)
    resized = np.asarray(Image.fromarray(rgb).resize((new_w, new_h), Image.BICUBIC, reducing_gap=None))
    top, left = (new_h - crop) // 2, (new_w - crop) // 2
    pixels = torch.tensor(resized[top : top + crop, left : left + crop], dtype=torch.float32).permute(2, 0, 1) / 255
    return (pixels - OPENAI_MEAN) / OPENAI_STD


def _save_processor(directory: Path, size: int, crop: int) -> None:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": crop, "width": crop}).save_pretrained(
        directory
    )


def _image_embeds(clip, pixels_BCHW: torch.Tensor) -> torch.Tensor:
    """CLIPModel.get_image_features: the vision tower's pooled state through the visual projection."""
    return clip.visual_projection(clip.vision_model(pixel_values=pixels_BCHW).pooler_output)


def _text_embeds(clip, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """CLIPModel.get_text_features."""
    return clip.text_projection(clip.text_model(input_ids=input_ids, attention_mask=attention_mask).pooler_output)


# ----------------------------------------------------------------------------------------------------- aesthetic


def _ddpo_aesthetic(images: list[np.ndarray], clip_dir: Path, head: dict[str, torch.Tensor]) -> torch.Tensor:
    """kvablack/ddpo-pytorch@1958463 ``ddpo_pytorch/aesthetic_scorer.py`` ``AestheticScorer.__call__`` (Flow-GRPO's
    is the same file): CLIPProcessor pixels in float32, ``get_image_features``, divided by its L2 norm, then LAION's
    MLP ``layers.{0,2,4,6,7}`` (dropout off, no activations), squeezed."""
    from transformers import CLIPModel

    clip = CLIPModel.from_pretrained(clip_dir, dtype=torch.float32).eval()
    pixels = torch.stack([_clip_processor_pixels(image, 35, 32) for image in images])
    with torch.no_grad():
        embed = _image_embeds(clip, pixels)
        embed = embed / torch.linalg.vector_norm(embed, dim=-1, keepdim=True)
        for index in (0, 2, 4, 6, 7):
            embed = embed @ head[f"layers.{index}.weight"].T + head[f"layers.{index}.bias"]
    return embed.squeeze(1)


@transcribes("scorer:aesthetic", source=DDPO)
def test_aesthetic_is_ddpo_aesthetic_scorer(tmp_path: Path) -> None:
    from fixtures_models import build_tiny_aesthetic

    build_tiny_aesthetic(tmp_path)
    clip_dir = tmp_path / "aesthetic" / "clip"
    _save_processor(clip_dir, 35, 32)  # the short side is resized, then cropped: odd margins
    scorer = SCORERS["aesthetic"](model_dir=tmp_path)
    scorer.load()
    outcomes = run_scorer(scorer, IMAGES, [""] * len(IMAGES), [{}] * len(IMAGES))
    expected = _ddpo_aesthetic(IMAGES, clip_dir, torch.load(tmp_path / "aesthetic" / "head.pth", weights_only=True))
    torch.testing.assert_close(torch.tensor([o.score for o in outcomes]), expected, rtol=1e-5, atol=1e-5)
    assert float(expected.std()) > 1e-2  # the items differ: the comparison is not vacuous


# ------------------------------------------------------------------------------------------ pickscore, clipscore


def _tiny_clip(root: Path, *, processor_subfolder: bool) -> Path:
    """A tiny CLIPModel with CLIP's 77-token text context, its tokenizer and a processor (short side 35, crop 32)."""
    from tiny_models import clip_tokenizer
    from transformers import CLIPConfig, CLIPModel

    processor_dir = root / "processor" if processor_subfolder else root
    tokenizer = clip_tokenizer(processor_dir, max_length=77)
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    torch.manual_seed(4)
    config = CLIPConfig(
        vision_config={**small, "image_size": 32, "patch_size": 8},
        text_config={
            **small,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 77,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        projection_dim=24,
    )
    CLIPModel(config).save_pretrained(root)
    _save_processor(processor_dir, 35, 32)
    return root


PROMPTS = [
    "a photo of the number 3",
    "a picture of a cat and a dog " * 12,
    "an image",
    "the digit seven",
]  # 2nd: cut


def _flow_grpo_pickscore(root: Path, images: list[np.ndarray], prompts: list[str]) -> torch.Tensor:
    """yifan123/flow_grpo@9745241 ``flow_grpo/pickscore_scorer.py`` ``PickScoreScorer.__call__``: CLIPProcessor
    images; text padded to the longest, truncated at 77; both features L2-normalised; ``logit_scale.exp() *
    text @ image.T``, its diagonal, / 26."""
    from transformers import AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(root, dtype=torch.float32).eval()
    text = AutoTokenizer.from_pretrained(root / "processor")(
        prompts, padding=True, truncation=True, max_length=77, return_tensors="pt"
    )
    with torch.no_grad():
        image_embs = _image_embeds(model, torch.stack([_clip_processor_pixels(im, 35, 32) for im in images]))
        image_embs = image_embs / image_embs.norm(p=2, dim=-1, keepdim=True)
        text_embs = _text_embeds(model, text["input_ids"], text["attention_mask"])
        text_embs = text_embs / text_embs.norm(p=2, dim=-1, keepdim=True)
        scores = model.logit_scale.exp() * (text_embs @ image_embs.T)
    return scores.diag() / 26


@transcribes(
    "scorer:pickscore",
    source=Source(FLOW_GRPO, FLOW_GRPO_COMMIT, "flow_grpo/pickscore_scorer.py", "PickScoreScorer.__call__"),
)
def test_pickscore_is_flow_grpo_pickscore_scorer(tmp_path: Path) -> None:
    """Also yuvalkirstain/PickScore's README usage (the same math before its softmax over images), / 26 after."""
    root = _tiny_clip(tmp_path / "pickscore", processor_subfolder=True)
    scorer = SCORERS["pickscore"](model_dir=tmp_path)
    scorer.load()
    outcomes = run_scorer(scorer, IMAGES, PROMPTS, [{}] * 4)
    expected = _flow_grpo_pickscore(root, IMAGES, PROMPTS)
    torch.testing.assert_close(torch.tensor([o.score for o in outcomes]), expected, rtol=1e-5, atol=1e-6)
    assert [o.details["truncated"] for o in outcomes] == [False, True, False, False]
    assert float(expected.std()) > 1e-2


def _torchvision_resize_crop_normalize(image: np.ndarray, size: int, crop: int) -> torch.Tensor:
    """Flow-GRPO's ``get_image_transform(processor)`` on ``uint8 / 255`` floats (torchvision 0.21 on tensors):
    ``Resize(size)`` (short side to ``size``, long side ``int(size * long / short)``, bilinear, antialias on, no
    clamp), ``CenterCrop(crop)`` (offsets ``int(round((side - crop) / 2))``), ``Normalize(mean, std)``."""
    rgb = np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image
    x = torch.tensor(rgb, dtype=torch.float32).permute(2, 0, 1) / 255.0
    height, width = x.shape[1:]
    short, long = min(height, width), max(height, width)
    new_h, new_w = (int(size * long / short), size) if width <= height else (size, int(size * long / short))
    if (new_h, new_w) != (height, width):
        x = F.interpolate(x[None], size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True)[0]
    top, left = int(round((new_h - crop) / 2.0)), int(round((new_w - crop) / 2.0))
    return (x[:, top : top + crop, left : left + crop] - OPENAI_MEAN) / OPENAI_STD


def _flow_grpo_clipscore(root: Path, pixels_BCHW: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """yifan123/flow_grpo@9745241 ``flow_grpo/clip_scorer.py`` ``ClipScorer.__call__`` after its image transform:
    text padded to ``max_length`` (77) and truncated; ``model(...).logits_per_image.diagonal() / 30``."""
    from transformers import AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(root, dtype=torch.float32).eval()
    texts = AutoTokenizer.from_pretrained(root)(prompts, padding="max_length", truncation=True, return_tensors="pt")
    with torch.no_grad():
        out = model(pixel_values=pixels_BCHW, input_ids=texts["input_ids"], attention_mask=texts["attention_mask"])
    return out.logits_per_image.diagonal() / 30


@transcribes(
    "scorer:clipscore",
    "scorer:clipscore_flow_grpo",
    source=Source(FLOW_GRPO, FLOW_GRPO_COMMIT, "flow_grpo/clip_scorer.py", "ClipScorer.__call__"),
)
def test_clipscore_is_flow_grpo_clip_scorer_up_to_its_resize(tmp_path: Path) -> None:
    """``clipscore_flow_grpo`` equals Flow-GRPO's scorer. Departure (docs/departures.md): ``clipscore`` resizes and
    crops as CLIPProcessor does (PIL bicubic, floored crop offsets: CLIP's own preprocessing) where Flow-GRPO's
    transform is torchvision's (bilinear, offsets rounded); the formula on its pixels is Flow-GRPO's."""
    root = _tiny_clip(tmp_path / "clipscore", processor_subfolder=False)
    scores = {}
    for name in ("clipscore", "clipscore_flow_grpo"):
        scorer = SCORERS[name](model_dir=tmp_path)
        scorer.load()
        scores[name] = torch.tensor([o.score for o in run_scorer(scorer, IMAGES, PROMPTS, [{}] * 4)])
    theirs = _flow_grpo_clipscore(
        root, torch.stack([_torchvision_resize_crop_normalize(im, 35, 32) for im in IMAGES]), PROMPTS
    )
    torch.testing.assert_close(scores["clipscore_flow_grpo"], theirs, rtol=1e-5, atol=1e-6)
    clip_pixels = _flow_grpo_clipscore(
        root, torch.stack([_clip_processor_pixels(im, 35, 32) for im in IMAGES]), PROMPTS
    )
    torch.testing.assert_close(scores["clipscore"], clip_pixels, rtol=1e-5, atol=1e-6)
    # The transforms differ on every image, even the 35x35 one that is only cropped (a margin of 3: floored to 1 by
    # CLIPProcessor, rounded to 2 by torchvision).
    assert float((scores["clipscore"] - theirs).abs().min()) > 1e-4


# --------------------------------------------------------------------------------------------------------- hpsv2


def _hpsv2_preprocess_val(image: np.ndarray, size: int) -> torch.Tensor:
    """tgxs002/HPSv2's ``preprocess_val`` (``light_augmentation=True``: ``image_transform(resize_longest_max=True)``):
    convert to RGB, ToTensor, ``ResizeMaxSize`` (the long side to ``size``, ``round`` of each scaled side, bicubic
    tensor resize with antialias, zero fill padded half on each side, the odd pixel after), Normalize."""
    rgb = np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image
    x = torch.tensor(rgb, dtype=torch.float32).permute(2, 0, 1) / 255
    height, width = x.shape[1:]
    scale = size / float(max(height, width))
    if scale != 1.0:
        new_h, new_w = round(height * scale), round(width * scale)
        x = F.interpolate(x[None], size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)[0]
        pad_h, pad_w = size - new_h, size - new_w
        padded = torch.zeros(3, size, size)
        padded[:, pad_h // 2 : pad_h // 2 + new_h, pad_w // 2 : pad_w // 2 + new_w] = x
        x = padded
    return (x - OPENAI_MEAN) / OPENAI_STD


def _openclip_tokenize(tokenizer, prompt: str, context: int = 77) -> torch.Tensor:
    """HPSv2's ``open_clip.tokenize``: ``whitespace_clean(basic_clean(text)).lower()`` (``basic_clean``: ftfy, the
    identity on these ASCII prompts, then ``html.unescape`` twice and strip; ``whitespace_clean``: runs of
    whitespace to one space, strip), BPE, [sot] + ids + [eot], cut to ``context`` with eot last, zero padded."""
    cleaned = re.sub(r"\s+", " ", html.unescape(html.unescape(prompt)).strip()).strip().lower()
    ids = (
        [tokenizer.bos_token_id] + tokenizer(cleaned, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    )
    if len(ids) > context:
        ids = ids[:context]
        ids[-1] = tokenizer.eos_token_id
    return torch.tensor(ids + [0] * (context - len(ids)))


def _hpsv2_score(
    state: dict[str, torch.Tensor], tokenizer, images: list[np.ndarray], prompts: list[str]
) -> torch.Tensor:
    """tgxs002/HPSv2@866735e ``hpsv2/img_score.py`` ``score``: the checkpoint loaded into the float32 OpenCLIP model
    (``precision='amp'``: fp32 weights, fp16 autocast on CUDA only), ``model(image, text)`` with normalised
    features, ``image_features @ text_features.T`` and its diagonal (one image per prompt)."""
    from fixtures_hps import TINY, openclip_image_features, openclip_text_features

    fp32 = {key: value.float() for key, value in state.items()}
    pixels = torch.stack([_hpsv2_preprocess_val(image, TINY["image"]) for image in images])
    tokens = torch.stack([_openclip_tokenize(tokenizer, prompt) for prompt in prompts])
    with torch.no_grad():
        image_features = F.normalize(openclip_image_features(fp32, pixels), dim=-1)
        text_features = F.normalize(openclip_text_features(fp32, tokens, tokenizer.eos_token_id), dim=-1)
    return torch.diagonal(image_features @ text_features.T)


@transcribes(
    "scorer:hpsv2",
    source=Source("tgxs002/HPSv2", "866735ecaae999fa714bd9edfa05aa2672669ee3", "hpsv2/img_score.py", "score"),
)
def test_hpsv2_is_hps_img_score_on_a_half_precision_checkpoint(tmp_path: Path) -> None:
    """A half-precision checkpoint, which the reference's ``load_state_dict`` upcasts into its float32 model; prompts
    go through OpenCLIP's cleaning (an HTML entity, escaped twice, and stray whitespace here)."""
    from fixtures_hps import TINY, tiny_openclip_state
    from tiny_models import clip_tokenizer

    from reward_server.scorers.convert_hps import convert

    tokenizer = clip_tokenizer(tmp_path / "tokenizer", max_length=77)
    state = {key: value.half() for key, value in tiny_openclip_state(len(tokenizer), seed=7).items()}
    torch.save({"state_dict": {f"module.{key}": value for key, value in state.items()}}, tmp_path / "hps.pt")
    convert(
        tmp_path / "hps.pt",
        tmp_path / "models" / "hpsv2",
        tokenizer=tmp_path / "tokenizer",
        vision_heads=TINY["v_heads"],
        text_heads=TINY["t_heads"],
    )
    scorer = SCORERS["hpsv2"](model_dir=tmp_path / "models")
    scorer.load()
    prompts = [
        "a handwritten digit &amp;#55;",
        "  A photo of\tthe  NUMBER 3 ",
        "a picture of a cat " * 20,
        "an image",
    ]
    outcomes = run_scorer(scorer, IMAGES, prompts, [{}] * 4)
    expected = _hpsv2_score(state, tokenizer, IMAGES, prompts)
    torch.testing.assert_close(torch.tensor([o.score for o in outcomes]), expected, rtol=0, atol=2e-6)
    assert [o.details["truncated"] for o in outcomes] == [False, False, True, False]
    assert float(expected.std()) > 1e-3


# --------------------------------------------------------------------------------------------------- imagereward


def _imagereward_transform(image: np.ndarray, n_px: int) -> torch.Tensor:
    """ImageReward's ``_transform(n_px)`` on a PIL image: Resize(n_px, BICUBIC) (PIL resize, short side to n_px,
    long side ``int(n_px * long / short)``), CenterCrop(n_px) (offsets ``int(round((side - n_px) / 2))``), RGB,
    ToTensor, Normalize(OpenAI mean/std)."""
    pil = Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image)
    width, height = pil.size
    short, long = min(width, height), max(width, height)
    new_w, new_h = (n_px, int(n_px * long / short)) if width <= height else (int(n_px * long / short), n_px)
    pil = pil.resize((new_w, new_h), Image.BICUBIC)
    top, left = int(round((new_h - n_px) / 2.0)), int(round((new_w - n_px) / 2.0))
    pil = pil.crop((left, top, left + n_px, top + n_px)).convert("RGB")
    x = torch.tensor(np.asarray(pil), dtype=torch.float32).permute(2, 0, 1) / 255
    return (x - OPENAI_MEAN) / OPENAI_STD


def _imagereward_score(state: dict[str, torch.Tensor], tokenizer, image: np.ndarray, prompt: str) -> float:
    """THUDM/ImageReward@c1392c6 ``ImageReward/ImageReward.py`` ``ImageReward.score``: BLIP's tokenizer padded to
    ``max_length`` 35 and truncated; the image transform; the text encoder's [CLS] state with cross-attention
    to every image token; the MLP; ``(reward - 0.16717362830052426) / 1.0333394966054072``."""
    from fixtures_imagereward import TINY, imagereward_raw

    text = tokenizer(prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    with torch.no_grad():
        raw = imagereward_raw(
            state,
            _imagereward_transform(image, TINY["image"])[None],
            text["input_ids"],
            text["attention_mask"],
        )
    return (float(raw) - 0.16717362830052426) / 1.0333394966054072


@transcribes(
    "scorer:imagereward",
    source=Source(
        "THUDM/ImageReward",
        "c1392c6dd0fd6ecd6d416c96959ab744a6d0a8fb",
        "ImageReward/ImageReward.py",
        "ImageReward.score",
    ),
)
def test_imagereward_is_imagereward_score(tmp_path: Path) -> None:
    from fixtures_imagereward import build_tiny_imagereward
    from transformers import AutoTokenizer

    root, state = build_tiny_imagereward(tmp_path)
    scorer = SCORERS["imagereward"](model_dir=tmp_path)
    scorer.load()
    prompts = ["a red cat on a table", "a photo of the big blue dog " * 6, "digit 7", "a small green cup"]
    outcomes = run_scorer(scorer, IMAGES, prompts, [{}] * 4)
    tokenizer = AutoTokenizer.from_pretrained(root)
    expected = [
        _imagereward_score(state, tokenizer, image, prompt) for image, prompt in zip(IMAGES, prompts, strict=True)
    ]
    assert [o.score for o in outcomes] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert [o.details["truncated"] for o in outcomes] == [False, True, False, False]
    assert np.std(expected) > 1e-2


# --------------------------------------------------------------------------------------------------------- hpsv3


def _hpsv3_reward(src: Path, base: Path, images: list[np.ndarray], prompts: list[str], pixels: int) -> torch.Tensor:
    """MizzenAI/HPSv3 ``hpsv3/inference.py`` ``HPSv3RewardInferencer.reward`` through ``Qwen2VLRewardModelBT.forward``
    (``hpsv3/model/qwen2vl_trainer.py``, ``reward_token="special"``, ranknet head): each image resized by qwen-vl-utils
    (``smart_resize`` with min = max pixels, PIL bicubic); Qwen2-VL's chat text (default system turn, image, the
    instruction with the prompt, the reward question, generation prompt); one batch padded on the right; image
    features scattered into the token embeddings; the language model with its default positions; the float32 head
    on every position, read at ``<|Reward|>``: (mu, sigma). The model is the base's with the checkpoint loaded
    strictly (its transformers 4.45 names mapped to the installed ones), the tokenizer the base's plus <|Reward|>."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from reward_server.scorers.hpsv3 import INSTRUCTION, REWARD_QUESTION

    state = load_file(str(src))
    config = AutoConfig.from_pretrained(base)
    config.text_config.vocab_size = state["model.embed_tokens.weight"].shape[0]
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.load_state_dict(
        {
            ("model." + key if key.startswith("visual.") else key.replace("model.", "model.language_model.", 1)): value
            for key, value in state.items()
            if not key.startswith("rm_head.")
        },
        strict=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(base, padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    processor = Qwen2VLImageProcessorPil.from_pretrained(base)
    resized = []
    for image in images:
        height, width = image.shape[:2]
        h_bar, w_bar = (max(28, round(side / 28) * 28) for side in (height, width))
        if h_bar * w_bar > pixels:
            beta = math.sqrt(height * width / pixels)
            h_bar, w_bar = (math.floor(side / beta / 28) * 28 for side in (height, width))
        elif h_bar * w_bar < pixels:
            beta = math.sqrt(pixels / (height * width))
            h_bar, w_bar = (math.ceil(side * beta / 28) * 28 for side in (height, width))
        pil = Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image).convert("RGB")
        resized.append(pil.resize((w_bar, h_bar), Image.BICUBIC))
    vision = processor(images=resized, return_tensors="pt")
    counts = (vision["image_grid_thw"].prod(-1) // processor.merge_size**2).tolist()
    texts = [
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
        + "<|image_pad|>" * count
        + "<|vision_end|>"
        + INSTRUCTION.format(text_prompt=prompt)
        + REWARD_QUESTION
        + "<|im_end|>\n<|im_start|>assistant\n"
        for prompt, count in zip(prompts, counts, strict=True)
    ]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    head = {key.removeprefix("rm_head."): value for key, value in state.items() if key.startswith("rm_head.")}
    with torch.no_grad():
        embeds = model.model.language_model.embed_tokens(batch["input_ids"])
        features = model.model.visual(vision["pixel_values"], grid_thw=vision["image_grid_thw"]).pooler_output
        mask = (batch["input_ids"] == model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, features)
        hidden = model.model.language_model(
            inputs_embeds=embeds, attention_mask=batch["attention_mask"]
        ).last_hidden_state
        h = hidden.float()
        for index in (0, 3, 5):
            h = h @ head[f"{index}.weight"].T + head[f"{index}.bias"]
            h = torch.relu(h) if index != 5 else h
    special = batch["input_ids"] == tokenizer.convert_tokens_to_ids("<|Reward|>")
    return h[special].view(len(images), -1)


@transcribes(
    "scorer:hpsv3",
    source=Source(
        "MizzenAI/HPSv3",
        "72b7ebaf0fe76bce636b3f4997aee319d0f65aef",
        "hpsv3/inference.py",
        "HPSv3RewardInferencer.reward",
    ),
)
def test_hpsv3_is_hpsv3_reward_batched_with_right_padding(tmp_path: Path) -> None:
    """Ours pads on the left with positions counted from each row's first token; the reference pads on the right
    with positions from 0: the same positions on every real token."""
    from fixtures_hpsv3 import build_tiny_hpsv3_reference

    from reward_server.scorers.convert_hpsv3 import convert

    src, base = build_tiny_hpsv3_reference(tmp_path / "reference")
    convert(src, base, tmp_path / "models" / "hpsv3")
    # 8 * 28 * 28 pixels keeps every resized image inside the tiny image processor's own pixel bounds, as HPSv3's
    # 256 * 28 * 28 is inside Qwen2-VL's: the reference's processor then leaves the sizes alone (ours skips it).
    pixels = 8 * 28 * 28
    (tmp_path / "models" / "hpsv3.json").write_text(f'{{"image_pixels": {pixels}}}')
    scorer = SCORERS["hpsv3"](model_dir=tmp_path / "models")
    scorer.load()
    images = [IMAGES[0], IMAGES[2], IMAGES[1]]
    prompts = [
        "a cat",
        "a red bicycle leaning on a blue wall at sunset, seen from far away",
        "dog",
    ]  # lengths differ
    outcomes = run_scorer(scorer, images, prompts, [{}] * 3)
    got = torch.tensor([[o.score, o.details["sigma"]] for o in outcomes])
    expected = _hpsv3_reward(src, base, images, prompts, pixels)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert float(expected[:, 0].std()) > 1e-2
