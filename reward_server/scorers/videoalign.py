"""``videoalign``: VideoReward (KwaiVGI/VideoAlign), a Qwen2-VL video reward model with three heads.

VideoReward reads a whole clip and the prompt it was generated from and gives three rewards, each a linear head
(``rm_head``, no bias) read at its own special token in its training prompt: ``VQ`` visual quality at
``<|VQ_reward|>``, ``MQ`` motion quality at ``<|MQ_reward|>``, ``TA`` text alignment at ``<|TA_reward|>``. As the
authors' ``VideoVLMRewardInference.reward`` (``use_norm=True``) does, each is normalised by the mean and std in
their ``model_config.json`` (``inference_config``; raw when it has none) and ``Overall = VQ + MQ + TA``. The score
is ``Overall`` (unbounded) unless ``videoalign.json`` picks one head; ``details`` holds all four.

Preprocessing as the authors' ``vision_process.py`` (qwen-vl-utils) with their ``data_config`` (``uniform``
sampling at ``fps`` frames per second, 2.0 as released, or a fixed ``num_frames``; ``max_frame_pixels``): the
frame count is the clip's duration times ``fps``, at least 4, at most the clip's frames (and 768), rounded to the
temporal patch of 2; frames are picked at ``round(linspace(0, F - 1, n))``; each frame is resized (bicubic with
antialiasing, rounded back to uint8) to ``smart_resize``'s multiples of 28 between 128 * 28 * 28 pixels and
``max_frame_pixels``. The clip arrives decoded with its fps (``metadata["fps"]``), where the authors decode a file
with decord: choosing frames of the clip we receive is their choosing frames of the file's decoded stream, with
our fps in place of decord's average fps. The chat text is Qwen2-VL's (default system turn, the video, then the
``detailed_special`` prompt with the caption), the language model runs with sequential 1-D positions (the authors'
forward calls it without M-RoPE positions) in the backbone's dtype, the head in that dtype too.
Departures (docs/departures.md): the LoRA is merged into the weights by ``convert_videoalign`` (the authors add it
at run time), equal up to the rounding of the merged weights.

Runs on transformers only. Expected layout under ``--model-dir``::

    videoalign/      the backbone (a Qwen2-VL save_pretrained directory whose tokenizer has the three reward tokens),
                     reward_head.safetensors and the authors' model_config.json, converted from the released
                     checkpoint by ``python -m reward_server.scorers.convert_videoalign --src <VideoReward dir>
                     --base <Qwen2-VL-2B-Instruct dir> --out <model_dir>/videoalign``
    videoalign.json  optional: {"score": "Overall" | "VQ" | "MQ" | "TA", "fps": 2.0, "num_frames": null,
                     "max_pixels": 200704, "use_norm": true} (the last four as the authors' ``reward()`` arguments;
                     unset: their model_config.json's values)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reward_server.scorers.base import ScoreOutcome
from reward_server.scorers.qwenvl import LocalQwenVL, chat_text, converted_judge
from shared.protocol import ErrorCode

HEADS = ("VQ", "MQ", "TA")
SPECIAL_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
SCORES = ("Overall", *HEADS)
HEAD_FILE = "reward_head.safetensors"
CONFIG_FILE = "model_config.json"
OPTION_KEYS = {"score", "fps", "num_frames", "max_pixels", "use_norm"}
FACTOR, FRAME_FACTOR = 28, 2
VIDEO_MIN_PIXELS = 128 * 28 * 28
FPS_MIN_FRAMES, FPS_MAX_FRAMES = 4, 768
MAX_RATIO = 200

# The authors' "detailed_special" template, verbatim (trailing spaces included): the heads were trained on it.
PROMPT = """
You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of the others.

**Visual Quality:**  
Evaluate the overall visual quality of the video, with a focus on static factors. The following sub-dimensions should be considered:
- **Reasonableness:** The video should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

Please provide the ratings of Visual Quality: <|VQ_reward|>
END

**Motion Quality:**  
Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following sub-dimensions:
- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing body parts).
- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing should flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, mouth movements).
- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.
- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.
- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the video might have blurry or unsteady sections that hinder visual continuity.
- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion quality.

Please provide the ratings of Motion Quality: <|MQ_reward|>
END

**Text Alignment:**  
Assess how well the video matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, scale, and direction.
- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking if real-world locations or scenes are accurately represented, though some stylistic adaptation is acceptable.  
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the video adheres to this style.
- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) are consistent with the expected behavior from the prompt.

Textual prompt - {text_prompt}
Please provide the ratings of Text Alignment: <|TA_reward|>
END
"""  # noqa: W291 (the trailing spaces are part of the trained prompt)


def question(caption: str) -> str:
    """The text VideoReward reads after the video: its prompt with the caption, the three reward tokens in it."""
    return PROMPT.format(text_prompt=caption)


def frame_count(total: int, video_fps: float, fps: float | None, nframes: int | None) -> int:
    """How many frames the model sees (qwen-vl-utils' ``smart_nframes``): ``nframes`` rounded to 2, or the clip's
    duration times ``fps`` within [4, min(768, total) floored to 2] rounded to 2; never more than ``total``.
    ValueError when that leaves fewer than 2."""
    if nframes is not None:
        count = round(nframes / FRAME_FACTOR) * FRAME_FACTOR
    else:
        low = math.ceil(FPS_MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
        high = math.floor(min(FPS_MAX_FRAMES, total) / FRAME_FACTOR) * FRAME_FACTOR
        count = round(min(max(total / video_fps * fps, low), high) / FRAME_FACTOR) * FRAME_FACTOR  # type: ignore[operator]
    count = min(count, total)
    if not FRAME_FACTOR <= count <= total:
        raise ValueError(f"a clip of {total} frames gives {count} frames to score; VideoReward needs at least 2")
    return count


def sample_frames(total: int, video_fps: float, fps: float | None, nframes: int | None) -> list[int]:
    """The indices of the frames scored: ``frame_count`` of them evenly over the clip, as the authors' ``uniform``
    sampling picks them (float32 ``linspace``, rounded half to even)."""
    count = frame_count(total, video_fps, fps, nframes)
    return torch.linspace(0, total - 1, count).round().long().tolist()


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """qwen-vl-utils' rule: (h, w) multiples of 28 nearest the frame's, scaled (floor) to at most ``max_pixels``
    or else (ceil) to at least ``min_pixels``, the aspect ratio kept."""
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"aspect ratio of {height}x{width} is over {MAX_RATIO}")
    h_bar, w_bar = (max(FACTOR, round(side / FACTOR) * FACTOR) for side in (height, width))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar, w_bar = (math.floor(side / beta / FACTOR) * FACTOR for side in (height, width))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = (math.ceil(side * beta / FACTOR) * FACTOR for side in (height, width))
    return h_bar, w_bar


def resize_frames(frames_FHWC: np.ndarray, height: int, width: int) -> torch.Tensor:
    """uint8 frames resized as torchvision's tensor ``resize`` (bicubic, antialias) does: float interpolation,
    clamped to [0, 255] and rounded -> float ``[F, C, h, w]`` holding whole numbers."""
    frames = torch.from_numpy(np.ascontiguousarray(frames_FHWC)).permute(0, 3, 1, 2).float()
    if frames.shape[1] == 1:
        frames = frames.expand(-1, 3, -1, -1)
    if tuple(frames.shape[2:]) == (height, width):
        return frames
    resized = torch.nn.functional.interpolate(
        frames, size=(height, width), mode="bicubic", align_corners=False, antialias=True
    )
    return resized.clamp(0, 255).round()


def video_patches(frames_FCHW: torch.Tensor, processor: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL's video input from resized frames (values 0..255): x / 255, the processor's mean and std, then
    patches of ``temporal_patch_size`` frames and ``patch_size``^2 pixels in its merge order -> (``[N, C*T*P*P]``,
    grid ``[3]`` = (t, h, w) in patches)."""
    t_patch, patch, merge = processor.temporal_patch_size, processor.patch_size, processor.merge_size
    mean = torch.tensor(processor.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(processor.image_std).view(1, 3, 1, 1)
    pixels = (frames_FCHW / 255.0 - mean) / std
    frames, channels, height, width = pixels.shape
    if frames % t_patch:
        raise ValueError(f"{frames} frames is not a multiple of the temporal patch {t_patch}")
    grid = (frames // t_patch, height // patch, width // patch)
    pixels = pixels.reshape(
        grid[0], t_patch, channels, grid[1] // merge, merge, patch, grid[2] // merge, merge, patch
    ).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return pixels.reshape(grid[0] * grid[1] * grid[2], channels * t_patch * patch * patch), torch.tensor(grid)


def normalise(raw: list[float], inference_config: dict[str, float] | None) -> dict[str, float]:
    """The authors' output transform: each head (VQ, MQ, TA) as ``(raw - mean) / std`` from ``inference_config``
    (raw without one), then ``Overall`` their sum."""
    rewards = dict(zip(HEADS, raw, strict=True))
    if inference_config is not None:
        rewards = {k: (v - inference_config[f"{k}_mean"]) / inference_config[f"{k}_std"] for k, v in rewards.items()}
    return {**rewards, "Overall": rewards["VQ"] + rewards["MQ"] + rewards["TA"]}


def read_settings(root: Path, options_path: Path) -> dict[str, Any]:
    """The authors' ``data_config`` and ``inference_config`` from ``root/model_config.json``, with the options file's
    overrides: {"fps", "num_frames", "max_pixels", "use_norm", "score", "inference_config"}."""
    data = json.loads((root / CONFIG_FILE).read_text())
    data_config = data["data_config"]
    if data_config.get("sample_type", "uniform") != "uniform":
        raise ValueError(f"{root / CONFIG_FILE}: sample_type {data_config['sample_type']!r}; only 'uniform' is done")
    if data_config.get("prompt_template_type") != "detailed_special" or list(data_config.get("eval_dim", [])) != list(
        HEADS
    ):
        raise ValueError(f"{root / CONFIG_FILE}: expected the detailed_special prompt with eval_dim {list(HEADS)}")
    options = json.loads(options_path.read_text()) if options_path.is_file() else {}
    if set(options) - OPTION_KEYS:
        raise ValueError(
            f"{options_path}: unknown keys {sorted(set(options) - OPTION_KEYS)}; allowed: {sorted(OPTION_KEYS)}"
        )
    if options.get("fps") is not None and options.get("num_frames") is not None:
        raise ValueError(f"{options_path}: fps and num_frames cannot be set at the same time (as the authors' reward)")
    settings = {
        "fps": options.get("fps", data_config.get("fps")),
        "num_frames": options.get("num_frames", data_config.get("num_frames")),  # wins over fps when set
        "max_pixels": int(options.get("max_pixels", data_config["max_frame_pixels"])),
        "use_norm": bool(options.get("use_norm", True)),
        "score": options.get("score", "Overall"),
    }
    if settings["score"] not in SCORES:
        raise ValueError(f"{options_path}: score {settings['score']!r}; one of {list(SCORES)}")
    if settings["fps"] is None and settings["num_frames"] is None:
        raise ValueError(f"{root / CONFIG_FILE}: neither fps nor num_frames is set")
    settings["inference_config"] = data.get("inference_config") if settings["use_norm"] else None
    return settings


class VideoAlignScorer:
    """VideoReward's Overall (or one head) for each clip and prompt, from ``<model_dir>/videoalign``."""

    name = "videoalign"
    description = "VideoReward (VideoAlign, Qwen2-VL + 3 heads): normalised VQ + MQ + TA of a video, unbounded"
    score_range = (None, None)
    modality = "video"

    def __init__(self, model_dir: Path | None = None, device: str | None = None) -> None:
        """Args:
        model_dir: the server's ``--model-dir`` (layout in the module docstring).
        device: torch device; default CUDA when available, else CPU.
        """
        self._model_dir = None if model_dir is None else Path(model_dir)
        self._device = device
        self._judge: LocalQwenVL | None = None
        self._head: torch.Tensor | None = None
        self._token_ids: list[int] = []
        self.settings: dict[str, Any] = {}

    @property
    def version(self) -> str:
        return "unloaded" if self._judge is None else f"videoalign+{self._judge.version}"

    def load(self) -> None:
        from safetensors.torch import load_file

        root, judge, self._token_ids = converted_judge(
            "videoalign", self._model_dir, (HEAD_FILE, CONFIG_FILE), SPECIAL_TOKENS, self._device
        )
        self.settings = read_settings(root, self._model_dir / "videoalign.json")
        head = load_file(str(root / HEAD_FILE))["weight"]
        if head.shape != (len(HEADS), judge.model.config.get_text_config().hidden_size):
            raise ValueError(f"{root / HEAD_FILE}: weight of shape {tuple(head.shape)}, expected [3, hidden]")
        self._head = head.to(judge.model.device, judge.model.dtype)
        self._judge = judge
        self.score([np.zeros((4, 56, 56, 3), np.uint8)], [""], [{"fps": 2.0}])

    def prepare(self, video: np.ndarray, fps: float | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(patches, grid, sampled frame indices) of one clip, as the authors' ``prepare_batch`` makes them."""
        assert self._judge is not None
        num_frames = self.settings["num_frames"]
        if num_frames is None and fps is None:
            raise ValueError("VideoReward samples frames by fps: the item has no fps")
        indices = sample_frames(len(video), fps or 1.0, self.settings["fps"], num_frames)
        height, width = smart_resize(*video.shape[1:3], VIDEO_MIN_PIXELS, self.settings["max_pixels"])
        frames = resize_frames(video[indices], height, width)
        return (*video_patches(frames, self._judge.image_processor), indices)

    @torch.no_grad()
    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[ScoreOutcome]:
        assert self._judge is not None and self._head is not None, "load() must be called before score()"
        outcomes: list[ScoreOutcome | None] = [None] * len(images)
        rows, prepared, captions = [], [], []
        for row, (video, prompt, meta) in enumerate(zip(images, prompts, metadata, strict=True)):
            if any(token in prompt for token in SPECIAL_TOKENS):
                outcomes[row] = ScoreOutcome.failure(ErrorCode.BAD_INPUT, "the prompt contains a VideoReward token")
                continue
            try:
                prepared.append(self.prepare(video, meta.get("fps")))
            except ValueError as exc:
                outcomes[row] = ScoreOutcome.failure(ErrorCode.BAD_INPUT, str(exc))
                continue
            rows.append(row)
            captions.append(prompt)
        if rows:
            raw = self.forward([(p, g) for p, g, _ in prepared], captions)
            for row, values, (_, _, indices) in zip(rows, raw.tolist(), prepared, strict=True):
                rewards = normalise(values, self.settings["inference_config"])
                details = {**rewards, "raw": dict(zip(HEADS, values, strict=True)), "frames": indices}
                outcomes[row] = ScoreOutcome(score=rewards[self.settings["score"]], details=details)
        return outcomes  # type: ignore[return-value]

    def encode(self, videos: list[tuple[torch.Tensor, torch.Tensor]], captions: list[str]) -> dict[str, torch.Tensor]:
        """Model inputs for prepared clips and their captions: left-padded ids of the chat text with each video's
        placeholder expanded to its tokens, the attention mask, the patches and their grids."""
        assert self._judge is not None
        judge, merge = self._judge, self._judge.image_processor.merge_size
        texts = []
        for (_, grid), caption in zip(videos, captions, strict=True):
            video_tokens = "<|video_pad|>" * (int(grid.prod()) // merge**2)
            texts.append(chat_text(question(caption), 1).replace("<|image_pad|>", video_tokens))
        encoded = judge.tokenizer(texts, return_tensors="pt", padding=True)
        inputs = {
            **encoded,
            "pixel_values_videos": torch.cat([patches for patches, _ in videos]),
            "video_grid_thw": torch.stack([grid for _, grid in videos]),
        }
        return {key: value.to(judge.model.device) for key, value in inputs.items()}

    @torch.no_grad()
    def forward(self, videos: list[tuple[torch.Tensor, torch.Tensor]], captions: list[str]) -> torch.Tensor:
        """Raw (VQ, MQ, TA) ``[B, 3]`` (float32) for prepared clips and their captions."""
        assert self._judge is not None and self._head is not None
        inputs = self.encode(videos, captions)
        positions = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # sequential from each row's start
        hidden_BLD = self._judge.model.model(**inputs, position_ids=positions).last_hidden_state
        return self.heads(hidden_BLD, inputs["input_ids"])

    def heads(self, hidden_BLD: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The authors' readout: ``rm_head`` at the three reward tokens (in their order in the text), row i of the
        head at the i-th token (the [B, 3, 3] diagonal) -> float32 ``[B, 3]``."""
        assert self._head is not None
        at_tokens = torch.isin(input_ids, torch.tensor(self._token_ids, device=input_ids.device))
        assert bool((at_tokens.sum(-1) == len(HEADS)).all()), "three reward tokens per row"
        logits_B33 = (hidden_BLD[at_tokens] @ self._head.T).view(len(input_ids), len(HEADS), len(HEADS))
        return logits_B33.diagonal(dim1=1, dim2=2).float().cpu()
