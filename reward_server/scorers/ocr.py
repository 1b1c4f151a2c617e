"""``ocr``, ``ocr_flow_grpo`` and ``ocr_paddle``: how exactly an image renders its target text, read by PP-OCR.

Score (``ocr``, ``ocr_paddle``): ``1 - levenshtein(read, target) / max(len(read), len(target))`` on strings
normalised as Flow-GRPO does (lower case, whitespace removed), in [0, 1]. ``ocr_flow_grpo`` is Flow-GRPO's
OCR reward (flow_grpo/ocr.py ``OcrScorer``): ``1 - min(levenshtein, len(target)) / len(target)`` on strings
lower-cased with spaces removed, and 1 when the target is inside what was read; it reads the image as
Flow-GRPO hands it to PaddleOCR (no border, RGB bytes where the engine expects BGR). Ours stays the default
because it cannot be gamed by extra text: Flow-GRPO's gives 1.0 to any image that holds the target among
other words, so a policy may fill the image with text for free, while ours charges every extra character.
Nothing read scores 0; an item without a target is a PARSE error.

Target text: ``metadata["text"]`` or ``metadata["target_text"]``, else the first non-blank double-quoted span
of the prompt, quotes paired in order (1st with 2nd, 3rd with 4th, ...): ``a sign displaying "Spring
Collection 2024"`` -> ``Spring Collection 2024``; ``a "" sign "OPEN"`` -> ``OPEN``. On Flow-GRPO's prompts
(one quoted span each) this is its ``prompt.split('"')[1]``. A mask (``metadata["mask"]``, the decoded uint8
``[H, W, C]`` array the server puts there) restricts reading to the mask's bounding box. The region read gets
a border of its background colour (:func:`add_border`): the detector misses text that touches the edge of
its input.

Backends (one registry name each):
    ``ocr``: RapidOCR on onnxruntime with the PP-OCR detection and recognition models shipped inside the
        ``rapidocr`` wheel (nothing downloaded). Detection resizes with limit type "max" and side 960: the
        default ("min", 736) upsamples small images, which splits words into several boxes. Detection
        runs per image; recognition runs once over the text lines of all images of a batch.
    ``ocr_paddle``: PaddleOCR 3.x (``paddleocr`` and ``paddlepaddle``, the ``ocr-paddle`` extra,
        imported in ``load``) with the models in ``<model_dir>/ocr_paddle/det`` and
        ``<model_dir>/ocr_paddle/rec``: PaddleOCR inference model directories (``inference.yml`` naming
        the model, plus ``inference.json`` or ``inference.pdmodel`` and ``inference.pdiparams``), e.g.
        PP-OCRv5_server_det and PP-OCRv5_server_rec. PaddleOCR pins its own numpy and OpenCV, so it
        usually needs an environment without the trainer's packages (``make paddle-env``; tested by
        tests/integration/test_ocr_paddle.py on models that tests/paddle/build_models.py converts).
Neither backend uses text-line orientation classification (Flow-GRPO reads with ``cls=False``).

Departures from Flow-GRPO (docs/departures.md, Scorers): the default score and reading above; the OCR models
(RapidOCR's PP-OCR ONNX models, not PaddleOCR 2.x's English PP-OCRv4); a prompt without a paired non-blank
quote is a PARSE error, where Flow-GRPO crashes on an empty first span and reads past an unpaired quote.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from reward_server.scorers.base import ModelFilesMissing, ScoreOutcome
from reward_server.scorers.fingerprint import sha256_files
from shared.protocol import ErrorCode

DET_LIMIT_TYPE = "max"
DET_LIMIT_SIDE = 960
MIN_BORDER_PX = 16  # 8 missed some text touching the edges; 12 to 24 read all our rendered cases
BORDER_OF_MASK_HEIGHT = 0.25
_WHITESPACE = re.compile(r"\s+")


def target_text(prompt: str, metadata: dict[str, Any]) -> str | None:
    """The text an item should show: ``metadata["text"]``, ``metadata["target_text"]``, else the first
    non-blank span between paired double quotes of the prompt (1st and 2nd quote, 3rd and 4th, ...);
    None if there is none."""
    for key in ("text", "target_text"):
        value = metadata.get(key)
        if isinstance(value, str) and value.strip():
            return value
    pieces = prompt.split('"')  # odd indices lie inside quotes; a last odd piece has no closing quote
    spans = pieces[1 : len(pieces) - 1 : 2]
    return next((span for span in spans if span.strip()), None)


def normalise_text(text: str) -> str:
    """Lower case without whitespace (Flow-GRPO's normalisation, extended from spaces to all whitespace)."""
    return _WHITESPACE.sub("", text).lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def text_similarity(read: str, target: str) -> float:
    """``1 - levenshtein / max(len)`` of the normalised strings; 1.0 when both are empty."""
    read, target = normalise_text(read), normalise_text(target)
    longest = max(len(read), len(target))
    return 1.0 if longest == 0 else 1.0 - levenshtein(read, target) / longest


def flow_grpo_similarity(read: str, target: str) -> float:
    """Flow-GRPO's OCR reward: ``1 - min(levenshtein, len(target)) / len(target)`` of the strings
    lower-cased with spaces (only) removed, and 1.0 when the target is inside the text read."""
    read, target = read.replace(" ", "").lower(), target.replace(" ", "").lower()
    if target in read:  # the empty target too
        return 1.0
    return 1.0 - min(levenshtein(read, target), len(target)) / len(target)


SIMILARITIES = {"normalised": text_similarity, "flow_grpo": flow_grpo_similarity}


def crop_to_mask(image: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The part of ``image`` inside the bounding box of ``mask``'s bright pixels.

    A pixel belongs to the mask when its brightest channel exceeds half the mask's maximum, so 0/1 and
    0/255 masks both work. Raises ValueError for a mask of another size or with no pixel set.
    """
    if mask.shape[:2] != image.shape[:2]:
        raise ValueError(f"mask is {mask.shape[1]}x{mask.shape[0]} but the image is {image.shape[1]}x{image.shape[0]}")
    flat = mask.max(axis=2) if mask.ndim == 3 else mask
    rows, cols = np.nonzero(flat > flat.max() / 2)
    if rows.size == 0:
        raise ValueError("mask has no pixel set")
    return image[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]


def add_border(image: np.ndarray, width: int) -> np.ndarray:
    """``image`` framed by ``width`` pixels of its background colour (the median of its outermost pixels).

    PP-OCR's detector misses text that touches the edge of its input; the border gives it back a margin.
    """
    ring = np.concatenate([image[0], image[-1], image[:, 0], image[:, -1]])
    height, width_in, channels = image.shape
    framed = np.empty((height + 2 * width, width_in + 2 * width, channels), np.uint8)
    framed[:] = np.median(ring, axis=0).astype(np.uint8)
    framed[width : width + height, width : width + width_in] = image
    return framed


def region_to_read(image: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """The mask's bounding box (or the whole image) with a border, as RGB.

    A mask's box is about as tall as its text, so its border is a quarter of its height (at least
    ``MIN_BORDER_PX``); a whole image's height says nothing about its text's, so it gets ``MIN_BORDER_PX``.
    Raises ValueError for an unusable mask.
    """
    if mask is None:
        region, border = image, MIN_BORDER_PX
    else:
        region = crop_to_mask(image, mask)
        border = max(MIN_BORDER_PX, round(region.shape[0] * BORDER_OF_MASK_HEIGHT))
    framed = add_border(region, border)
    return np.repeat(framed, 3, axis=2) if framed.shape[2] == 1 else framed


def flow_grpo_region(image: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """What Flow-GRPO hands PaddleOCR, as the RGB array our backends read: the mask's box (or the whole image),
    no border, channels reversed, since Flow-GRPO passes its RGB array where PaddleOCR expects BGR and our
    backends turn RGB into BGR. Raises ValueError for an unusable mask."""
    region = image if mask is None else crop_to_mask(image, mask)
    region = np.repeat(region, 3, axis=2) if region.shape[2] == 1 else region
    return np.ascontiguousarray(region[:, :, ::-1])


READINGS = {"bordered": region_to_read, "flow_grpo": flow_grpo_region}


@dataclass(frozen=True)
class TextLine:
    """One line of text read from an image, with the recogniser's confidence in [0, 1]."""

    text: str
    confidence: float


class OcrBackend(Protocol):
    """Reads the text lines of RGB uint8 ``[H, W, 3]`` images, top to bottom, one list per image."""

    version: str

    def read(self, images_rgb: list[np.ndarray]) -> list[list[TextLine]]: ...


class RapidOcrBackend:
    """RapidOCR (onnxruntime) with the PP-OCR models its wheel ships."""

    def __init__(self) -> None:
        from rapidocr import RapidOCR

        self._engine = RapidOCR(
            params={
                "Det.limit_type": DET_LIMIT_TYPE,
                "Det.limit_side_len": DET_LIMIT_SIDE,
                "Global.use_cls": False,
                "Global.log_level": "error",
            }
        )
        # RapidOCR loads its recogniser at the first text it detects: load it now, off the request path.
        self._engine.recognize_txt([np.full((48, 160, 3), 255, np.uint8)])
        cfg = self._engine.cfg
        models = sorted(Path(cfg.Global.model_root_dir).glob("*.onnx"))
        self.version = (
            f"rapidocr-{importlib.metadata.version('rapidocr')}"
            f"+{cfg.Det.ocr_version.value}-{cfg.Det.model_type.value}"
            f"+{sha256_files(models)[:12]}"
        )

    def read(self, images_rgb: list[np.ndarray]) -> list[list[TextLine]]:
        """RapidOCR's own steps (resize, detect and crop each image), then one recognition call over the
        text lines of all images, filtered as ``RapidOCR.__call__`` filters them."""
        from rapidocr.main import RapidOCRError

        engine = self._engine
        crops: list[np.ndarray] = []
        counts = []
        for image_rgb in images_rgb:
            image, record = engine.preprocess_img(np.ascontiguousarray(image_rgb[:, :, ::-1]))  # BGR
            try:
                lines, _ = engine.detect_and_crop(image, record)
            except RapidOCRError:  # nothing detected
                lines = []
            crops.extend(lines)
            counts.append(len(lines))
        if not crops:
            return [[] for _ in images_rgb]
        result = engine.recognize_txt(crops)
        read = [
            TextLine(text, float(score)) if text.strip() and score >= engine.text_score else None
            for text, score in zip(result.txts, result.scores, strict=True)
        ]
        per_image, start = [], 0
        for count in counts:
            per_image.append([line for line in read[start : start + count] if line is not None])
            start += count
        return per_image


class PaddleOcrBackend:
    """PaddleOCR 3.x pipeline from local detection and recognition model directories."""

    def __init__(self, det_dir: Path, rec_dir: Path) -> None:
        for path in (det_dir, rec_dir):
            if not (path / "inference.yml").is_file():
                raise FileNotFoundError(f"{path} is not a PaddleOCR inference model dir (no inference.yml)")
        from paddleocr import PaddleOCR

        det_name, rec_name = _paddle_model_name(det_dir), _paddle_model_name(rec_dir)
        self._pipeline = PaddleOCR(
            text_detection_model_name=det_name,
            text_detection_model_dir=str(det_dir),
            text_recognition_model_name=rec_name,
            text_recognition_model_dir=str(rec_dir),
            use_doc_orientation_classify=False,
            use_doc_unwarping=False,
            use_textline_orientation=False,
            text_det_limit_type=DET_LIMIT_TYPE,
            text_det_limit_side_len=DET_LIMIT_SIDE,
        )
        files = sorted(p for d in (det_dir, rec_dir) for p in d.iterdir() if p.is_file())
        self.version = (
            f"paddleocr-{importlib.metadata.version('paddleocr')}+{det_name}+{rec_name}+{sha256_files(files)[:12]}"
        )

    def read(self, images_rgb: list[np.ndarray]) -> list[list[TextLine]]:
        return [self._read_one(image_rgb) for image_rgb in images_rgb]

    def _read_one(self, image_rgb: np.ndarray) -> list[TextLine]:
        (result,) = self._pipeline.predict(np.ascontiguousarray(image_rgb[:, :, ::-1]))  # BGR, one page
        return paddle_result_lines(result)


def paddle_result_lines(result: Any) -> list[TextLine]:
    """Text lines of one PaddleOCR 3.x ``predict`` result (a mapping with ``rec_texts``, ``rec_scores``)."""
    return [
        TextLine(str(text), float(score))
        for text, score in zip(result["rec_texts"], result["rec_scores"], strict=True)
        if str(text).strip()
    ]


def _paddle_model_name(model_dir: Path) -> str:
    match = re.search(r"^\s*model_name:\s*(\S+)", (model_dir / "inference.yml").read_text(), re.MULTILINE)
    if match is None:
        raise ValueError(f"{model_dir / 'inference.yml'} names no model (no 'model_name:' line)")
    return match.group(1).strip("'\"")


class OcrScorer:
    """Text-rendering accuracy: the similarity of the text read to the target (module docstring)."""

    score_range = (0.0, 1.0)

    def __init__(
        self,
        backend: str = "rapidocr",
        model_dir: Path | None = None,
        *,
        similarity: str = "normalised",
        reading: str = "bordered",
    ) -> None:
        """Args:
        backend: ``"rapidocr"`` (registry name ``ocr``) or ``"paddleocr"`` (registry name ``ocr_paddle``).
        model_dir: the server's ``--model-dir``; PaddleOCR reads ``<model_dir>/ocr_paddle/{det,rec}``.
        similarity: ``"normalised"`` (ours) or ``"flow_grpo"`` (registry name ``ocr_flow_grpo``).
        reading: what the engine reads: ``"bordered"`` (:func:`region_to_read`, ours) or ``"flow_grpo"``
            (:func:`flow_grpo_region`, registry name ``ocr_flow_grpo``).
        """
        if backend not in ("rapidocr", "paddleocr"):
            raise ValueError(f"unknown OCR backend {backend!r}; use 'rapidocr' or 'paddleocr'")
        if similarity not in SIMILARITIES:
            raise ValueError(f"unknown OCR similarity {similarity!r}; use one of {sorted(SIMILARITIES)}")
        if reading not in READINGS:
            raise ValueError(f"unknown OCR reading {reading!r}; use one of {sorted(READINGS)}")
        self._backend_name = backend
        self._model_dir = model_dir
        self._similarity = SIMILARITIES[similarity]
        self._reading = READINGS[reading]
        self.name = ("ocr" if backend == "rapidocr" else "ocr_paddle") + (
            "" if similarity == "normalised" else f"_{similarity}"
        )
        self.description = (
            f"1 - normalised edit distance between the target text and what PP-OCR ({backend}) reads"
            if similarity == "normalised"
            else f"Flow-GRPO's OCR reward (1 - min(edit distance, len(target)) / len(target)), PP-OCR ({backend})"
        )
        self._backend: OcrBackend | None = None

    @property
    def version(self) -> str:
        return "unloaded" if self._backend is None else self._backend.version

    def load(self) -> None:
        if self._backend_name == "rapidocr":
            self._backend = RapidOcrBackend()
        else:
            if self._model_dir is None:
                raise ModelFilesMissing("ocr_paddle needs --model-dir with ocr_paddle/det and ocr_paddle/rec")
            root = Path(self._model_dir) / "ocr_paddle"
            self._backend = PaddleOcrBackend(root / "det", root / "rec")
        self._backend.read([np.full((32, 32, 3), 255, np.uint8)])  # warm-up: first inference allocates

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[ScoreOutcome]:
        assert self._backend is not None, "load() must be called before score()"
        outcomes: list[ScoreOutcome | None] = [None] * len(images)
        rows, targets, regions = [], [], []
        for row, (image, prompt, meta) in enumerate(zip(images, prompts, metadata, strict=True)):
            target = target_text(prompt, meta)
            if target is None:
                outcomes[row] = ScoreOutcome.failure(
                    ErrorCode.PARSE,
                    "no target text: set metadata 'text' or 'target_text', or quote it in the prompt",
                )
                continue
            try:
                mask = np.asarray(meta["mask"]) if "mask" in meta else None
                regions.append(self._reading(image, mask))
            except ValueError as exc:
                outcomes[row] = ScoreOutcome.failure(ErrorCode.BAD_INPUT, f"mask: {exc}")
                continue
            rows.append(row)
            targets.append(target)
        if regions:
            for row, target, lines in zip(rows, targets, self._backend.read(regions), strict=True):
                outcomes[row] = self._outcome(target, lines)
        return outcomes  # type: ignore[return-value]

    def _outcome(self, target: str, lines: list[TextLine]) -> ScoreOutcome:
        read = " ".join(line.text for line in lines)
        confidence = float(np.mean([line.confidence for line in lines])) if lines else None
        return ScoreOutcome(
            score=self._similarity(read, target),
            details={
                "target": target,
                "recognized": read,
                "confidence": confidence,
                "line_confidences": [line.confidence for line in lines],
            },
        )
