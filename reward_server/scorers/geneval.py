"""``geneval``: GenEval's object checks (counts, colours, positions) from each prompt's metadata, no mmdet.

Each item's metadata is a GenEval row (``tag``, ``include``, ``exclude``, as in our GenEval jsonl files).
A Mask2Former instance-segmentation model (transformers) finds the objects; CLIP zero-shot classification
of each masked, box-cropped object (grey #999 outside the mask) over GenEval's ten colours decides colours;
:mod:`geneval_rules` applies GenEval's thresholds and rules. Three scores from the same detections:
    ``geneval``: 1.0 when every check passes, else 0.0: GenEval's "correct" (djghosh13/geneval).
    ``geneval_partial`` (ours): the fraction of GenEval's checks passed (one per count, colour, position
        and exclusion), so in [0, 1] and 1 exactly when GenEval says correct: a dense reward that agrees
        with the benchmark's verdict. Flow-GRPO's reward does not: it wants exact counts (a second dog in
        "a photo of a dog" costs the whole count term, GenEval accepts it), ignores exclusions and can go
        below 0.
    ``geneval_flow_grpo``: Flow-GRPO's training reward (its reward server's ``evaluate_reward``,
        :func:`geneval_rules.flow_grpo_reward`) on images as its server sees them: JPEG at quality 75 (its
        client's encoding), and the detector given the RGB pixels in BGR order (its server hands mmdet an
        RGB array, which mmdet reads as BGR); colours are read from the RGB image, as its server does.
Details carry GenEval's checks and both of its scores; ``geneval_flow_grpo`` adds its reward's terms.

Expected layout under the server's ``--model-dir``::

    geneval/detector/   a Mask2FormerForUniversalSegmentation save with its preprocessor_config.json
                        (e.g. facebook/mask2former-swin-small-coco-instance); labels from config.id2label
    geneval/clip/       a transformers CLIPModel with tokenizer and preprocessor files (GenEval uses
                        OpenAI ViT-L/14: openai/clip-vit-large-patch14)

Where results can differ from GenEval's own numbers (mmdet Mask2Former Swin-S, lsj 50e, COCO):
- weights: the transformers COCO checkpoints are the Mask2Former authors' Detectron2 models, not mmdet's
  retraining, so confidences and masks differ; expect scores a few points apart, mostly in counting
  (threshold 0.9) and position. Use the Swin-S instance checkpoint to stay closest.
- preprocessing: the image processor's resize (shortest edge 800, longest 1333 by default) and padding
  replace mmdet's test pipeline; masks are mapped back by cropping the padding and bilinear resizing.
- post-processing is mmdet's instance rule, re-implemented: top 100 (query, class) pairs by class
  probability, mask logits > 0, score = class probability x mean mask probability, box = mask extent.
- CLIP: transformers' CLIP and CLIPImageProcessor (bicubic resize, centre crop) in place of open_clip;
  the same OpenAI weights, so colour votes should agree up to numerical noise.
Departures (docs/departures.md, Scorers): the detector's weights and preprocessing and CLIP's library, above.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from reward_server.scorers import geneval_rules as rules
from reward_server.scorers.base import ModelFilesMissing, ScoreOutcome
from reward_server.scorers.fingerprint import sha256_files, weight_files
from shared.protocol import ErrorCode

TOP_K = 100  # (query, class) pairs kept before thresholds, as mmdet's max_per_image
BACKGROUND = (153, 153, 153)  # GenEval's "#999" fill outside an object's mask for colour crops
WARMUP_ROW = {"tag": "single_object", "include": [{"class": "bowl", "count": 1}]}
FLOW_GRPO_JPEG_QUALITY = 75  # PIL's default, which Flow-GRPO's GenEval client leaves unset
MODES = {
    "strict": (
        "geneval",
        "GenEval object checks (Mask2Former + CLIP colours, no mmdet): 1 when every "
        "count/colour/position check of the prompt's metadata passes, else 0",
    ),
    "partial": ("geneval_partial", "GenEval object checks: the fraction of the checks passed"),
    "flow_grpo": (
        "geneval_flow_grpo",
        "Flow-GRPO's GenEval reward: mean of its count/colour/position terms (exact counts, exclusions ignored)",
    ),
}


class GenEvalScorer:
    """GenEval checks with a transformers Mask2Former and CLIP read from ``<model_dir>/geneval``."""

    def __init__(self, model_dir: Path | None = None, *, mode: str = "strict", device: str | None = None) -> None:
        """Args:
        model_dir: the server's ``--model-dir``; weights are read from ``<model_dir>/geneval``.
        mode: "strict" (``geneval``), "partial" (``geneval_partial``) or "flow_grpo" (``geneval_flow_grpo``).
        device: torch device; default CUDA when available, else CPU.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, not {mode!r}")
        self.name, self.description = MODES[mode]
        # Flow-GRPO's count term 1 - |count - n| / count reaches 1 - (MAX_OBJECTS - 1) at count 1.
        self.score_range = (2.0 - rules.MAX_OBJECTS, 1.0) if mode == "flow_grpo" else (0.0, 1.0)
        self._mode = mode
        self._root = None if model_dir is None else Path(model_dir) / "geneval"
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._detector: Any = None
        self._det_processor: Any = None
        self._label_names: dict[int, str] = {}  # detector label id -> GenEval class
        self._clip: Any = None
        self._tokenizer: Any = None
        self._clip_processor: Any = None
        self._color_embeds: dict[str, torch.Tensor] = {}  # class -> [colours, D], cached per class
        self._version = "unloaded"

    @property
    def version(self) -> str:
        return self._version

    def load(self) -> None:
        from transformers import (
            AutoImageProcessor,
            AutoTokenizer,
            CLIPModel,
            Mask2FormerForUniversalSegmentation,
        )
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        if self._root is None:
            raise ModelFilesMissing(
                "geneval needs --model-dir with geneval/detector (Mask2Former) and geneval/clip (CLIP)"
            )
        detector_dir, clip_dir = self._root / "detector", self._root / "clip"
        for folder, needed in (
            (detector_dir, ("config.json", "preprocessor_config.json")),
            (clip_dir, ("config.json", "preprocessor_config.json", "tokenizer_config.json")),
        ):
            for name in needed:
                if not (folder / name).is_file():
                    raise FileNotFoundError(
                        f"no {name} in {folder}: save the model and its processor there "
                        "(see reward_server/scorers/geneval.py for the layout)"
                    )
        detector, info = Mask2FormerForUniversalSegmentation.from_pretrained(detector_dir, output_loading_info=True)
        clip, clip_info = CLIPModel.from_pretrained(clip_dir, output_loading_info=True)
        for folder, loading in ((detector_dir, info), (clip_dir, clip_info)):
            unloaded = list(loading["missing_keys"]) + [str(entry) for entry in loading["mismatched_keys"]]
            if unloaded:  # transformers would run with these weights random: refuse instead
                raise ValueError(f"{folder} lacks or mis-shapes weights: {unloaded[:5]}")
        labels = {int(i): rules.canonical_label(str(name)) for i, name in detector.config.id2label.items()}
        self._label_names = {i: name for i, name in labels.items() if name is not None}
        if not self._label_names:
            raise ValueError(f"{detector_dir}: config.id2label names none of GenEval's objects; use a COCO checkpoint")
        self._detector = detector.eval().to(self._device)
        self._det_processor = AutoImageProcessor.from_pretrained(detector_dir)
        self._clip = clip.eval().to(self._device)
        self._tokenizer = AutoTokenizer.from_pretrained(clip_dir)
        self._clip_processor = CLIPImageProcessorPil.from_pretrained(clip_dir)
        self._color_embeds = {}
        digest = sha256_files(weight_files(detector_dir) + weight_files(clip_dir))[:12]
        self._version = (
            f"geneval+mask2former-{detector.config.backbone_config.model_type}"
            f"+clip-{clip.config.vision_config.hidden_size}+{digest}"
        )
        self.score([np.zeros((64, 64, 3), np.uint8)], [""], [WARMUP_ROW])

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[ScoreOutcome]:
        assert self._detector is not None, "load() must be called before score()"
        outcomes: list[ScoreOutcome | None] = [None] * len(images)
        wanted: dict[int, set[str]] = {}
        for index, meta in enumerate(metadata):
            try:
                _, include, exclude = rules.parse_spec(meta)
            except ValueError as exc:
                outcomes[index] = ScoreOutcome.failure(ErrorCode.PARSE, str(exc))
                continue
            unseen = sorted({c["class"] for c in include + exclude} - set(self._label_names.values()))
            if unseen:
                outcomes[index] = ScoreOutcome.failure(ErrorCode.BAD_INPUT, f"the detector has no label for {unseen}")
                continue
            wanted[index] = {c["class"] for c in include + exclude}
        rgb = [np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image for image in images]
        seen = rgb
        if self._mode == "flow_grpo":
            rgb = [jpeg_roundtrip(image) for image in rgb]
            seen = [np.ascontiguousarray(image[:, :, ::-1]) for image in rgb]
        for index, candidates in zip(
            wanted, self._detect([seen[i] for i in wanted], list(wanted.values())), strict=True
        ):
            outcomes[index] = self._verdict(metadata[index], candidates, rgb[index])
        return outcomes  # type: ignore[return-value]

    def _verdict(
        self, meta: dict[str, Any], candidates: dict[str, list[rules.Detection]], image: np.ndarray
    ) -> ScoreOutcome:
        """One item's score and details from its candidate detections; CLIP reads each colour once."""
        detected = rules.select_detections(candidates, meta["tag"])
        votes: dict[tuple, list[str]] = {}

        def colors(name: str, found: list[rules.Detection]) -> list[str]:
            key = (name, *map(id, found))
            if key not in votes:
                votes[key] = self._classify_colors(image, name, found)
            return votes[key]

        checks = rules.evaluate(meta, detected, colors)
        strict, partial = rules.strict_and_partial(checks)
        details = {
            "strict": strict,
            "partial": partial,
            "tag": meta["tag"],
            "checks": checks,
            "detected": {
                name: [[*map(float, d.box), round(d.score, 4)] for d in found] for name, found in detected.items()
            },
        }
        if self._mode != "flow_grpo":
            return ScoreOutcome(score=strict if self._mode == "strict" else partial, details=details)
        reward, exact, terms = rules.flow_grpo_reward(meta, detected, colors)
        return ScoreOutcome(score=reward, details={**details, "flow_grpo": {"exact": exact, "terms": terms}})

    @torch.no_grad()
    def _detect(self, images: list[np.ndarray], wanted: list[set[str]]) -> list[dict[str, list[rules.Detection]]]:
        """Mask2Former instances per image, for the classes in ``wanted`` only (see :func:`instances`)."""
        if not images:
            return []
        inputs = self._det_processor(images=images, return_tensors="pt")
        pixel_mask = inputs["pixel_mask"]
        out = self._detector(
            pixel_values=inputs["pixel_values"].to(self._device), pixel_mask=pixel_mask.to(self._device)
        )
        padded_size = tuple(inputs["pixel_values"].shape[-2:])
        return [
            instances(
                out.class_queries_logits[b],
                out.masks_queries_logits[b],
                padded_size,
                (int(pixel_mask[b, :, 0].sum()), int(pixel_mask[b, 0, :].sum())),
                image.shape[:2],
                {i: name for i, name in self._label_names.items() if name in wanted[b]},
            )
            for b, image in enumerate(images)
        ]

    @torch.no_grad()
    def _classify_colors(self, image: np.ndarray, name: str, found: list[rules.Detection]) -> list[str]:
        """The colour CLIP picks for each detection: its mask over grey, cropped to its box, against the
        averaged embeddings of GenEval's three colour prompts for this class."""
        if name not in self._color_embeds:
            texts = [t.format(color=c, obj=name) for c in rules.COLORS for t in rules.COLOR_TEMPLATES]
            tokens = self._tokenizer(texts, padding=True, truncation=True, return_tensors="pt").to(self._device)
            text = self._clip.text_model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
            embeds = F.normalize(self._clip.text_projection(text.pooler_output).float(), dim=-1)
            embeds = embeds.reshape(len(rules.COLORS), len(rules.COLOR_TEMPLATES), -1).mean(1)
            self._color_embeds[name] = F.normalize(embeds, dim=-1)
        crops = [crop_object(image, d) for d in found]
        pixels = self._clip_processor(images=crops, return_tensors="pt")["pixel_values"].to(self._device)
        vision = self._clip.vision_model(pixel_values=pixels)
        image_embeds = F.normalize(self._clip.visual_projection(vision.pooler_output).float(), dim=-1)
        return [rules.COLORS[i] for i in (image_embeds @ self._color_embeds[name].T).argmax(-1).tolist()]


def instances(
    class_logits_QC: torch.Tensor,
    mask_logits_Qhw: torch.Tensor,
    padded_size: tuple[int, int],
    valid_size: tuple[int, int],
    image_size: tuple[int, int],
    labels: dict[int, str],
) -> dict[str, list[rules.Detection]]:
    """One image's instances by mmdet's Mask2Former rule, for the label ids in ``labels`` only.

    The top :data:`TOP_K` (query, class) pairs by class probability (the last class, "no object", left
    out); each query's mask logits are upsampled to the padded input, cropped to the image's unpadded
    ``valid_size`` and resized to ``image_size``; mask = logits > 0; score = class probability x mean mask
    probability over the mask; box = the mask's extent. Pairs whose class probability is at most the lower
    of GenEval's thresholds are skipped early (their score cannot pass), as are empty masks (score 0).
    """
    probs_QC = class_logits_QC.float().softmax(-1)[:, :-1]
    num_classes = probs_QC.shape[-1]
    top_scores, top_indices = probs_QC.flatten().topk(min(TOP_K, probs_QC.numel()))
    floor = min(rules.THRESHOLD, rules.COUNTING_THRESHOLD)
    keep = [
        k
        for k, (score, index) in enumerate(zip(top_scores.tolist(), top_indices.tolist(), strict=True))
        if score > floor and index % num_classes in labels
    ]
    found: dict[str, list[rules.Detection]] = {}
    if not keep:
        return found
    logits = F.interpolate(
        mask_logits_Qhw[top_indices[keep] // num_classes][None].float(),
        size=padded_size,
        mode="bilinear",
        align_corners=False,
    )[..., : valid_size[0], : valid_size[1]]
    logits = F.interpolate(logits, size=tuple(image_size), mode="bilinear", align_corners=False)[0]
    binary = logits > 0
    mask_scores = (logits.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
    for k, mask, mask_score in zip(keep, binary.cpu().numpy(), mask_scores.tolist(), strict=True):
        box = _mask_box(mask)
        if box is not None:
            found.setdefault(labels[int(top_indices[k]) % num_classes], []).append(
                rules.Detection(box=box, score=float(top_scores[k]) * mask_score, mask=mask)
            )
    return found


def jpeg_roundtrip(image: np.ndarray) -> np.ndarray:
    """``image`` after Flow-GRPO's GenEval client (PIL JPEG, quality 75) and its server's decoding (PIL)."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=FLOW_GRPO_JPEG_QUALITY)
    buffer.seek(0)
    return np.asarray(Image.open(buffer).convert("RGB"))


def crop_object(image: np.ndarray, detection: rules.Detection) -> np.ndarray:
    """The object's pixels (grey outside its mask, if any) inside its box, rounded to whole pixels."""
    height, width = image.shape[:2]
    composite = (
        image if detection.mask is None else np.where(detection.mask[..., None], image, np.array(BACKGROUND, np.uint8))
    )
    x1, y1, x2, y2 = (round(v) for v in detection.box)
    x1, y1 = min(max(x1, 0), width - 1), min(max(y1, 0), height - 1)
    x2, y2 = min(max(x2, x1 + 1), width), min(max(y2, y1 + 1), height)
    return np.ascontiguousarray(composite[y1:y2, x1:x2])


def _mask_box(mask: np.ndarray) -> tuple[float, float, float, float] | None:
    """(x1, y1, x2, y2) of a boolean mask's extent, x2 and y2 one past the last pixel (mmdet's mask2bbox)."""
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    if rows.size == 0:
        return None
    return float(cols[0]), float(rows[0]), float(cols[-1] + 1), float(rows[-1] + 1)
