"""Parity of ``videoalign`` (VideoReward) with transcriptions of the authors' inference code (KwaiVGI/VideoAlign), on
a tiny random checkpoint in their layout: their frame sampling and resize (``vision_process.py``), their prompt
(``prompt_template.py``) and their reward (``inference.py``: the model's forward through the LoRA at run time, the
heads at the special tokens, the normalisation and Overall).

No video file is read: the authors decode one with decord and sample its frames; ours arrive decoded with their
fps, so the transcription samples from the decoded clip with that fps as decord's average fps.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transcribed import Source, transcribes

from reward_server.scorers import SCORERS, run_scorer

REPO, COMMIT = "KwaiVGI/VideoAlign", "219ab9db64c045e5181a2202d11f686439351292"
RNG = np.random.default_rng(5)
VIDEOS = [
    RNG.integers(0, 256, (9, 40, 60, 3), dtype=np.uint8),
    RNG.integers(0, 256, (5, 64, 48, 3), dtype=np.uint8),
    RNG.integers(0, 256, (12, 30, 30, 3), dtype=np.uint8),
]
FPS = [4.0, 8.0, 24.0]
CAPTIONS = ["a cat", "a red bicycle leaning on a blue wall at sunset, seen from far away", "dog"]


# --------------------------------------------------------------------------------------------- preprocessing


def _smart_nframes(ele: dict, total_frames: int, video_fps: float) -> int:
    """``vision_process.smart_nframes``: nframes rounded to 2, or duration * fps clamped to [4, min(768, total)]
    (ceil / floor to 2) then rounded to 2; capped at total; an error outside [2, total]."""
    if "nframes" in ele:
        nframes = round(ele["nframes"] / 2) * 2
    else:
        min_frames = math.ceil(ele.get("min_frames", 4) / 2) * 2
        max_frames = math.floor(ele.get("max_frames", min(768, total_frames)) / 2) * 2
        nframes = total_frames / video_fps * ele.get("fps", 2.0)
        nframes = round(min(max(nframes, min_frames), max_frames) / 2) * 2
    if nframes > total_frames:
        nframes = total_frames
    if not 2 <= nframes <= total_frames:
        raise ValueError(f"nframes should in interval [2, {total_frames}], but got {nframes}.")
    return nframes


def _fetch_video(clip_FHWC: np.ndarray, ele: dict, video_fps: float) -> torch.Tensor:
    """``vision_process.fetch_video`` on a decoded clip (``_read_video_decord``, ``uniform``): the frames at
    ``linspace(0, total - 1, nframes).round()``, resized by ``smart_resize`` (factor 28, min 128 * 28 * 28, max
    ``ele["max_pixels"]``) with torchvision's bicubic antialiased tensor resize (float math, clamp, round to uint8),
    then ``.float()`` -> ``[T, C, H, W]``."""
    total = len(clip_FHWC)
    idx = torch.linspace(0, total - 1, _smart_nframes(ele, total, video_fps)).round().long().tolist()
    video = torch.tensor(clip_FHWC[idx]).permute(0, 3, 1, 2)
    height, width = video.shape[2:]
    min_pixels, max_pixels = 128 * 28 * 28, ele["max_pixels"]
    h_bar, w_bar = max(28, round(height / 28) * 28), max(28, round(width / 28) * 28)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar, w_bar = math.floor(height / beta / 28) * 28, math.floor(width / beta / 28) * 28
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / 28) * 28, math.ceil(width * beta / 28) * 28
    resized = torch.nn.functional.interpolate(
        video.float(), size=[h_bar, w_bar], mode="bicubic", align_corners=False, antialias=True
    )
    return resized.clamp(0, 255).round().to(torch.uint8).float()


def _qwen2vl_video_pixels(video_TCHW: torch.Tensor, processor) -> tuple[np.ndarray, list[int]]:
    """transformers 4.45 ``Qwen2VLImageProcessor._preprocess`` on one video whose size its own resize keeps
    (multiples of 28 inside its pixel bounds): x / 255, mean/std, reshape to (t, 2, C, h/2, 2, 14, w/2, 2, 14),
    transpose (0, 3, 6, 4, 7, 2, 1, 5, 8), flatten."""
    patches = (video_TCHW.numpy() / 255.0 - np.array(processor.image_mean)[:, None, None]) / np.array(
        processor.image_std
    )[:, None, None]
    t, c, h, w = patches.shape
    gt, gh, gw = t // 2, h // 14, w // 14
    patches = patches.reshape(gt, 2, c, gh // 2, 2, 14, gw // 2, 2, 14).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, c * 2 * 14 * 14), [gt, gh, gw]


@transcribes(
    "scorer:videoalign", source=Source(REPO, COMMIT, "vision_process.py", "fetch_video (_read_video_decord uniform)")
)
def test_frames_are_sampled_and_resized_as_the_authors_fetch_video() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from reward_server.scorers.videoalign import resize_frames, sample_frames, smart_resize, video_patches

    processor = Qwen2VLImageProcessorPil()
    cases = [(9, 4.0, 2.0, None), (61, 30.0, 2.0, None), (121, 24.0, 2.0, None), (5, 8.0, 2.0, None)]
    cases += [(3, 24.0, 2.0, None), (17, 16.0, 3.0, None), (10, 8.0, None, 7), (12, 8.0, None, 16)]
    for total, video_fps, fps, nframes in cases:
        ele = {"nframes": nframes} if nframes is not None else {"fps": fps}
        expected = torch.linspace(0, total - 1, _smart_nframes(ele, total, video_fps)).round().long().tolist()
        assert sample_frames(total, video_fps, fps, nframes) == expected, (total, video_fps, fps, nframes)
    with pytest.raises(ValueError, match="at least 2"):  # smart_nframes: 0 frames from a 1-frame clip
        sample_frames(1, 8.0, 2.0, None)
    assert sample_frames(7, 8.0, None, 8) == list(range(7))  # capped at an odd count: the 4.45 processor then
    with pytest.raises(ValueError, match="temporal patch"):  # fails to reshape; ours says so
        video_patches(torch.zeros(7, 3, 28, 28), processor)
    for clip, video_fps, max_pixels in [(VIDEOS[0], 4.0, 160 * 28 * 28), (VIDEOS[1], 8.0, 100 * 28 * 28)]:
        reference = _fetch_video(clip, {"fps": 2.0, "max_pixels": max_pixels}, video_fps)
        indices = sample_frames(len(clip), video_fps, 2.0, None)
        height, width = smart_resize(*clip.shape[1:3], 128 * 28 * 28, max_pixels)
        ours = resize_frames(clip[indices], height, width)
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)
        pixels, grid = video_patches(ours, processor)
        expected_pixels, expected_grid = _qwen2vl_video_pixels(reference, processor)
        assert grid.tolist() == expected_grid
        np.testing.assert_allclose(pixels.numpy(), expected_pixels, rtol=1e-5, atol=1e-5)
    large = RNG.integers(0, 256, (2, 300, 500, 3), dtype=np.uint8)  # a downscale: the antialiasing matters
    height, width = smart_resize(300, 500, 128 * 28 * 28, 160 * 28 * 28)
    reference = _fetch_video(large, {"nframes": 2, "max_pixels": 160 * 28 * 28}, 8.0)
    torch.testing.assert_close(resize_frames(large, height, width), reference, rtol=0, atol=0)


def test_video_patches_of_a_still_pair_are_the_image_processors_patches() -> None:
    """Two equal frames are what Qwen2-VL's image processor makes of one image (it repeats it in time)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from reward_server.scorers.videoalign import video_patches

    processor = Qwen2VLImageProcessorPil()
    frame = RNG.integers(0, 256, (56, 84, 3), dtype=np.uint8)
    image = processor(images=[frame], return_tensors="pt", do_resize=False)
    pixels, grid = video_patches(torch.tensor(np.stack([frame, frame])).permute(0, 3, 1, 2).float(), processor)
    assert grid.tolist() == image["image_grid_thw"][0].tolist()
    torch.testing.assert_close(pixels, image["pixel_values"], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- prompt

AUTHORS_TEMPLATE_SHA256 = "fdb6309bac618dd0c8b1b589d3a0970a974f7856eecbb355a190b2dce54af700"
"""sha256 of ``DETAILED_PROMPT_WITH_SPECIAL_TOKEN`` in the authors' prompt_template.py at COMMIT (UTF-8)."""


def _build_prompt(prompt: str, dimension: list[str], template_type: str, template: str) -> str:
    """``prompt_template.build_prompt`` for the released settings: several dimensions make an "overall performance"
    name that the ``detailed_special`` branch does not use; it formats the template with ``text_prompt`` only."""
    assert isinstance(dimension, list) and len(dimension) > 1
    if template_type != "detailed_special":
        raise ValueError("Invalid template type")
    return template.format(text_prompt=prompt)


@transcribes("scorer:videoalign", source=Source(REPO, COMMIT, "prompt_template.py", "build_prompt"))
def test_prompt_is_the_authors_detailed_special_template() -> None:
    from reward_server.scorers.videoalign import PROMPT, SPECIAL_TOKENS, question

    assert hashlib.sha256(PROMPT.encode()).hexdigest() == AUTHORS_TEMPLATE_SHA256
    caption = 'a "quoted" caption with {braces}'
    text = question(caption)
    assert text == _build_prompt(caption, ["VQ", "MQ", "TA"], "detailed_special", PROMPT)
    at = [text.index(token) for token in SPECIAL_TOKENS]
    assert at == sorted(at) and all(text.count(token) == 1 for token in SPECIAL_TOKENS)
    for token, name in zip(SPECIAL_TOKENS, ("Visual Quality", "Motion Quality", "Text Alignment"), strict=True):
        assert f"Please provide the ratings of {name}: {token}\nEND\n" in text
    assert f"Textual prompt - {caption}\nPlease provide the ratings of Text Alignment" in text


# ---------------------------------------------------------------------------------------------------- reward


def _reference_model(src: Path, base: Path):
    """``create_model_and_processor`` + ``load_model_from_checkpoint``: the base Qwen2-VL with the reward tokens,
    its embeddings resized, the non-LoRA tensors loaded over it (4.45 names mapped here by hand) and PEFT's LoRA
    applied at run time (a forward hook adding ``x A^T B^T * alpha / r`` on each adapted layer)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    checkpoint = src / "checkpoint-12"
    tokenizer = AutoTokenizer.from_pretrained(base, padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>"]})
    model = Qwen2VLForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
    model.resize_token_embeddings(len(tokenizer))
    non_lora = torch.load(checkpoint / "non_lora_state_dict.pth", weights_only=True)
    rm_head = non_lora.pop("base_model.model.rm_head.weight")

    def current(key: str) -> str:
        key = key.removeprefix("base_model.model.")
        return "model." + key if key.startswith("visual.") else key.replace("model.", "model.language_model.", 1)

    state = model.state_dict()
    state.update({current(key): value for key, value in non_lora.items()})
    model.load_state_dict(state, strict=True)
    adapter = json.loads((checkpoint / "adapter_config.json").read_text())
    scaling = adapter["lora_alpha"] / adapter["r"]
    lora = load_file(str(checkpoint / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    for key in [k for k in lora if k.endswith(".lora_A.weight")]:
        a, b = lora[key], lora[key.replace("lora_A", "lora_B")]
        module = modules[current(key.removesuffix(".lora_A.weight"))]
        module.register_forward_hook(lambda _m, inp, out, a=a, b=b: out + inp[0] @ a.T @ b.T * scaling)
    return model, tokenizer, rm_head


def _reference_reward(src: Path, base: Path, videos, fps, captions, use_norm: bool = True) -> list[dict[str, float]]:
    """``VideoVLMRewardInference.reward`` (``inference.py``): ``prepare_batch`` (fetch_video with data_config's fps
    and max_frame_pixels, the chat template with the video first, the processor padding on the right), then
    ``Qwen2VLRewardModelBT.forward`` (``trainer.py``): video features scattered into the embeddings, the language
    model with its default positions, ``rm_head`` at every position, the special tokens' rows as [B, 3, 3], the
    diagonal; then ``_norm`` and Overall = VQ + MQ + TA."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from reward_server.scorers.videoalign import PROMPT

    config = json.loads((src / "model_config.json").read_text())
    data_config, inference_config = config["data_config"], config["inference_config"]
    model, tokenizer, rm_head = _reference_model(src, base)
    processor = Qwen2VLImageProcessorPil.from_pretrained(base)
    pixels, grids, texts = [], [], []
    for clip, clip_fps, caption in zip(videos, fps, captions, strict=True):
        ele = {"fps": data_config["fps"], "max_pixels": data_config["max_frame_pixels"]}
        flat, grid = _qwen2vl_video_pixels(_fetch_video(clip, ele, clip_fps), processor)
        pixels.append(torch.tensor(flat, dtype=torch.float32))
        grids.append(grid)
        texts.append(
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
            + "<|video_pad|>" * (math.prod(grid) // 4)
            + "<|vision_end|>"
            + _build_prompt(caption, data_config["eval_dim"], data_config["prompt_template_type"], PROMPT)
            + "<|im_end|>\n<|im_start|>assistant\n"
        )
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        embeds = model.model.language_model.embed_tokens(batch["input_ids"])
        features = model.model.visual(torch.cat(pixels), grid_thw=torch.tensor(grids)).pooler_output
        mask = (batch["input_ids"] == model.config.video_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, features)
        hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"])
        logits = hidden.last_hidden_state @ rm_head.T
    special = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    for token_id in tokenizer.convert_tokens_to_ids(["<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>"]):
        special |= batch["input_ids"] == token_id
    rewards_B3 = logits[special].view(len(videos), 3, -1).diagonal(dim1=1, dim2=2)
    out = []
    for row in rewards_B3.tolist():
        reward = dict(zip(("VQ", "MQ", "TA"), row, strict=True))
        if use_norm:
            reward = {k: (v - inference_config[f"{k}_mean"]) / inference_config[f"{k}_std"] for k, v in reward.items()}
        out.append({**reward, "Overall": reward["VQ"] + reward["MQ"] + reward["TA"]})
    return out


@transcribes("scorer:videoalign", source=Source(REPO, COMMIT, "inference.py", "VideoVLMRewardInference.reward"))
def test_videoalign_is_the_authors_reward_batched_with_right_padding(tmp_path: Path) -> None:
    """Ours merges the LoRA, pads on the left and counts positions from each row's first token; theirs adds the
    LoRA at run time and pads on the right with positions from 0: the same rewards."""
    from fixtures_videoalign import build_tiny_videoalign_reference

    from reward_server.scorers.convert_videoalign import convert

    src, base = build_tiny_videoalign_reference(tmp_path / "reference")
    convert(src, base, tmp_path / "models" / "videoalign")
    scorer = SCORERS["videoalign"](model_dir=tmp_path / "models")
    scorer.load()
    metadata = [{"fps": value} for value in FPS]
    outcomes = run_scorer(scorer, VIDEOS, CAPTIONS, metadata)
    expected = _reference_reward(src, base, VIDEOS, FPS, CAPTIONS)
    keys = ("VQ", "MQ", "TA", "Overall")
    got = torch.tensor([[o.details[k] for k in keys] for o in outcomes])
    want = torch.tensor([[e[k] for k in keys] for e in expected])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert [o.score for o in outcomes] == [o.details["Overall"] for o in outcomes]
    assert float(want[:, 3].std()) > 1e-2  # the clips score differently
    (tmp_path / "models" / "videoalign.json").write_text('{"score": "MQ", "use_norm": false}')
    raw = SCORERS["videoalign"](model_dir=tmp_path / "models")
    raw.load()
    unnormed = _reference_reward(src, base, VIDEOS[:1], FPS[:1], CAPTIONS[:1], use_norm=False)[0]
    (outcome,) = run_scorer(raw, VIDEOS[:1], CAPTIONS[:1], metadata[:1])
    assert outcome.score == pytest.approx(unnormed["MQ"], abs=1e-4)
    assert outcome.details["Overall"] == pytest.approx(unnormed["Overall"], abs=1e-4)
