"""``ocr`` and ``ocr_paddle``: how exactly an image renders its target text, read by PP-OCR models.

Score: ``1 - levenshtein(read, target) / max(len(read), len(target))`` on normalised strings, in [0, 1].
Normalisation follows the Flow-GRPO OCR reward: lower case, spaces removed (we remove every whitespace
character, not only ``" "``), so line breaks and word spacing chosen by the detector do not count.
Departures from Flow-GRPO, on purpose: it divides by ``len(target)`` and scores 1 whenever the target is
a substring of what was read; we divide by the longer string, so extra text in the image costs reward too
(a policy cannot win by filling the image with text). Nothing read scores 0 (a real score: no text);
an item without a target is a PARSE error, never a 0.

Target text: ``metadata["text"]`` or ``metadata["target_text"]``, else the first double-quoted span of
the prompt (``a sign displaying "Spring Collection 2024"`` -> ``Spring Collection 2024``), as in the
Flow-GRPO OCR prompts. A mask (``metadata["mask"]``, the decoded uint8 ``[H, W, C]`` array the server puts
there) restricts reading to the mask's bounding box.

Backends (one registry name each):
    ``ocr``: RapidOCR on onnxruntime with the PP-OCR detection and recognition models shipped inside the
        ``rapidocr`` wheel (nothing downloaded). Detection resizes with limit type "max" and side 960: the
        default ("min", 736) upsamples small images, which splits words into several boxes.
    ``ocr_paddle``: PaddleOCR 3.x (``paddleocr`` and ``paddlepaddle``, the ``ocr-paddle`` extra,
        imported in ``load``) with the models in ``<model_dir>/ocr_paddle/det`` and
        ``<model_dir>/ocr_paddle/rec``: PaddleOCR inference model directories (``inference.yml`` naming
        the model, plus ``inference.json`` or ``inference.pdmodel`` and ``inference.pdiparams``), e.g.
        PP-OCRv5_server_det and PP-OCRv5_server_rec. PaddleOCR pins its own numpy and OpenCV, so it
        usually needs an environment without the trainer's packages; the server needs no torch.
        Tested with paddleocr 3.7 and paddlepaddle 3.3 (``make paddle-env``, then
        tests/integration/test_ocr_paddle.py) on PP-OCRv6 small det/rec converted from the rapidocr
        wheel's ONNX files by tests/paddle/build_models.py, whose ``inference.yml`` files show the layout.
Neither backend uses text-line orientation classification (Flow-GRPO reads with ``cls=False``).
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from reward_server.scorers import ScoreOutcome
from reward_server.scorers.fingerprint import sha256_files
from shared.protocol import ErrorCode

DET_LIMIT_TYPE = "max"
DET_LIMIT_SIDE = 960
_QUOTED = re.compile(r'"([^"]+)"')
_WHITESPACE = re.compile(r"\s+")


def target_text(prompt: str, metadata: dict[str, Any]) -> str | None:
    """The text an item should show: ``metadata["text"]``, ``metadata["target_text"]``, else the prompt's
    first double-quoted span; None if there is none (or it is blank)."""
    for key in ("text", "target_text"):
        value = metadata.get(key)
        if isinstance(value, str) and value.strip():
            return value
    match = _QUOTED.search(prompt)
    return match.group(1) if match and match.group(1).strip() else None


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


def crop_to_mask(image: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The part of ``image`` inside the bounding box of ``mask``'s bright pixels.

    A pixel belongs to the mask when its brightest channel exceeds half the mask's maximum, so 0/1 and
    0/255 masks both work. Raises ValueError for a mask of another size or with no pixel set.
    """
    if mask.shape[:2] != image.shape[:2]:
        raise ValueError(
            f"mask is {mask.shape[1]}x{mask.shape[0]} but the image is {image.shape[1]}x{image.shape[0]}"
        )
    flat = mask.max(axis=2) if mask.ndim == 3 else mask
    rows, cols = np.nonzero(flat > flat.max() / 2)
    if rows.size == 0:
        raise ValueError("mask has no pixel set")
    return image[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]


@dataclass(frozen=True)
class TextLine:
    """One line of text read from an image, with the recogniser's confidence in [0, 1]."""

    text: str
    confidence: float


class OcrBackend(Protocol):
    """Reads the text lines of an RGB uint8 ``[H, W, 3]`` image, top to bottom."""

    version: str

    def read(self, image_rgb: np.ndarray) -> list[TextLine]: ...


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
        cfg = self._engine.cfg
        models = sorted(Path(cfg.Global.model_root_dir).glob("*.onnx"))
        self.version = (
            f"rapidocr-{importlib.metadata.version('rapidocr')}"
            f"+{cfg.Det.ocr_version.value}-{cfg.Det.model_type.value}"
            f"+{sha256_files(models)[:12]}"
        )

    def read(self, image_rgb: np.ndarray) -> list[TextLine]:
        result = self._engine(np.ascontiguousarray(image_rgb[:, :, ::-1]))  # RapidOCR takes arrays as BGR
        texts = getattr(result, "txts", None) or ()
        scores = getattr(result, "scores", None) or ()
        return [TextLine(text, float(score)) for text, score in zip(texts, scores, strict=True)]


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
            f"paddleocr-{importlib.metadata.version('paddleocr')}+{det_name}+{rec_name}"
            f"+{sha256_files(files)[:12]}"
        )

    def read(self, image_rgb: np.ndarray) -> list[TextLine]:
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
    """Text-rendering accuracy: 1 - normalised edit distance between the text read and the target."""

    score_range = (0.0, 1.0)

    def __init__(self, backend: str = "rapidocr", model_dir: Path | None = None) -> None:
        """Args:
        backend: ``"rapidocr"`` (registry name ``ocr``) or ``"paddleocr"`` (registry name ``ocr_paddle``).
        model_dir: the server's ``--model-dir``; PaddleOCR reads ``<model_dir>/ocr_paddle/{det,rec}``.
        """
        if backend not in ("rapidocr", "paddleocr"):
            raise ValueError(f"unknown OCR backend {backend!r}; use 'rapidocr' or 'paddleocr'")
        self._backend_name = backend
        self._model_dir = model_dir
        self.name = "ocr" if backend == "rapidocr" else "ocr_paddle"
        self.description = (
            f"1 - normalised edit distance between the target text and what PP-OCR ({backend}) reads"
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
                raise ValueError("ocr_paddle needs --model-dir with ocr_paddle/det and ocr_paddle/rec")
            root = Path(self._model_dir) / "ocr_paddle"
            self._backend = PaddleOcrBackend(root / "det", root / "rec")
        self._backend.read(np.full((32, 32, 3), 255, np.uint8))  # warm-up: first inference allocates

    def score(
        self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[ScoreOutcome]:
        assert self._backend is not None, "load() must be called before score()"
        return [
            self._score_one(image, prompt, meta)
            for image, prompt, meta in zip(images, prompts, metadata, strict=True)
        ]

    def _score_one(self, image: np.ndarray, prompt: str, meta: dict[str, Any]) -> ScoreOutcome:
        assert self._backend is not None
        target = target_text(prompt, meta)
        if target is None:
            return ScoreOutcome.failure(
                ErrorCode.PARSE,
                "no target text: set metadata 'text' or 'target_text', or quote it in the prompt",
            )
        if "mask" in meta:
            try:
                image = crop_to_mask(image, np.asarray(meta["mask"]))
            except ValueError as exc:
                return ScoreOutcome.failure(ErrorCode.BAD_INPUT, f"mask: {exc}")
        rgb = np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image
        lines = self._backend.read(rgb)
        read = " ".join(line.text for line in lines)
        confidence = float(np.mean([line.confidence for line in lines])) if lines else None
        return ScoreOutcome(
            score=text_similarity(read, target),
            details={
                "target": target,
                "recognized": read,
                "confidence": confidence,
                "line_confidences": [line.confidence for line in lines],
            },
        )
