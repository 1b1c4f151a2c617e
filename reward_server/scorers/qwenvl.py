"""``qwenvl`` and ``qwenvl_api``: a Qwen2-VL / Qwen2.5-VL judge that rates an image from 1 to 5.

One question template per task, chosen per item by ``metadata["judge_task"]`` (default: the scorer's
``task``): ``aesthetics``, ``alignment`` (with the prompt), ``text`` (the target text, taken as the
``ocr`` scorer takes it) and ``edit`` (instruction following: the prompt is the instruction and
``metadata["reference_image"]`` the original, a decoded uint8 array or a wire image
``{"format", "data"[, "shape"]}``).

Two readouts, both mapped linearly from 1..5 onto the score range [0, 1]:
    ``probs`` (default): the question asks for a single digit; the score is the expected value of the
        first answer token's distribution over the tokens "1".."5", renormalised over those five. If less
        than ``min_answer_mass`` (default 0.5) of the probability is on them the model did not answer with
        a digit: a PARSE error, never a 0. Expected values give a smooth reward, where a sampled digit
        would quantise it to five levels.
    ``generate``: the question asks for a short reasoning and ``<Score>x</Score>``; greedy decoding, the
        last tag is parsed; no tag (or x outside 1..5) is a PARSE error.

Backends (one registry name each), with ``<model_dir>`` the server's ``--model-dir``:
    ``qwenvl``: transformers in-process, from ``<model_dir>/qwenvl/`` (a ``save_pretrained`` directory:
        config.json, safetensors, tokenizer files, preprocessor_config.json). Images are preprocessed by
        transformers' PIL image processor (``Qwen2VLImageProcessorPil``: the default, torchvision-based
        processor and the ``AutoProcessor`` bundle need torchvision); the chat text is built here in
        Qwen's chat format. Optional ``<model_dir>/qwenvl.json``: ``{"task", "readout", "max_new_tokens"}``.
    ``qwenvl_api``: an OpenAI-compatible chat-completions server (vLLM, SGLang) serving such a model,
        described by ``<model_dir>/qwenvl_api.json``: ``{"base_url": "http://host:port/v1", "model":
        NAME}`` plus optional ``"api_key_env"`` (the name of an environment variable holding the key),
        ``"task"``, ``"readout"``, ``"max_new_tokens"`` (256), ``"timeout_s"`` (120), ``"max_concurrency"`` (16). Images are sent as
        lossless PNG data URIs. The ``probs`` readout asks for ``top_logprobs`` (20) of the first token;
        a server that returns none is read from its one-digit answer text instead.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from reward_server.scorers import ScoreOutcome
from reward_server.scorers.fingerprint import sha256_files
from reward_server.scorers.ocr import target_text
from shared.imagecodec import DecodeError, decode_image
from shared.protocol import ErrorCode

DIGITS = ("1", "2", "3", "4", "5")
TASKS: dict[str, str] = {
    "aesthetics": (
        "How aesthetically pleasing is this image (composition, lighting, colour, detail)? "
        "Rate it from 1 (very poor) to 5 (excellent)."
    ),
    "alignment": (
        'How well does this image match the description "{prompt}"? '
        "Rate it from 1 (not at all) to 5 (perfectly, in every detail)."
    ),
    "text": (
        'The image should show the text "{text}". How correctly is exactly that text rendered '
        "(spelling, completeness, legibility)? Rate it from 1 (missing or wrong) to 5 (exactly right)."
    ),
    "edit": (
        'The first image is an original and the second an edit of it for the instruction "{prompt}". '
        "How well does the edit follow the instruction while keeping everything else unchanged? "
        "Rate it from 1 (not at all) to 5 (perfectly)."
    ),
}
ANSWER_FORMATS: dict[str, str] = {
    "probs": " Answer with a single digit from 1 to 5.",
    "generate": " Explain briefly, then give your rating as <Score>x</Score> with x from 1 to 5.",
}
SYSTEM_PROMPT = "You are a helpful assistant."
_SCORE_TAG = re.compile(r"<Score>\s*([0-9]+(?:\.[0-9]+)?)\s*</Score>", re.IGNORECASE)
_OPTION_KEYS = {"task", "readout", "max_new_tokens"}
_API_KEYS = _OPTION_KEYS | {"base_url", "model", "api_key_env", "timeout_s", "max_concurrency"}


@dataclass(frozen=True)
class JudgeQuery:
    """What the judge is shown: RGB uint8 images in order, then the question text."""

    images: list[np.ndarray]
    question: str


@dataclass(frozen=True)
class JudgeAnswer:
    """The judge's answer text and, where known, the log-probabilities of "1".."5" as first token."""

    text: str
    digit_logprobs: dict[int, float] | None


class JudgeBackend(Protocol):
    version: str

    def answer(self, queries: list[JudgeQuery], readout: str) -> list[JudgeAnswer | ScoreOutcome]:
        """One answer per query (greedy), or a per-query failure."""
        ...


def build_query(
    task: str, image: np.ndarray, prompt: str, metadata: dict[str, Any], readout: str
) -> JudgeQuery | ScoreOutcome:
    """The question for one item, or the failure that prevents asking it."""
    if task not in TASKS:
        return ScoreOutcome.failure(
            ErrorCode.BAD_INPUT, f"unknown judge_task {task!r}; one of {sorted(TASKS)}"
        )
    images = [_rgb(image)]
    fields = {"prompt": prompt, "text": ""}
    if task == "text":
        text = target_text(prompt, metadata)
        if text is None:
            return ScoreOutcome.failure(
                ErrorCode.PARSE,
                "no target text: set metadata 'text' or 'target_text', or quote it in the prompt",
            )
        fields["text"] = text
    if task == "edit":
        reference = metadata.get("reference_image")
        if reference is None:
            return ScoreOutcome.failure(ErrorCode.PARSE, "the edit task needs metadata['reference_image']")
        try:
            images.insert(0, _rgb(_as_array(reference)))
        except (DecodeError, TypeError, ValueError) as exc:
            return ScoreOutcome.failure(ErrorCode.DECODE, f"reference_image: {exc}")
    return JudgeQuery(images, TASKS[task].format(**fields) + ANSWER_FORMATS[readout])


def read_answer(answer: JudgeAnswer, readout: str, min_answer_mass: float) -> ScoreOutcome:
    """Turn an answer into a score in [0, 1] (1..5 mapped linearly), or a PARSE failure."""
    if readout == "generate":
        matches = _SCORE_TAG.findall(answer.text)
        value = float(matches[-1]) if matches else None
        if value is None or not 1.0 <= value <= 5.0:
            return ScoreOutcome.failure(
                ErrorCode.PARSE,
                f"no <Score>1..5</Score> in the answer {answer.text[:200]!r}",
                {"answer": answer.text},
            )
        return ScoreOutcome(score=(value - 1.0) / 4.0, details={"rating": value, "answer": answer.text})
    if answer.digit_logprobs is None:  # an API server without logprobs: read the one-digit answer
        text = answer.text.strip()
        if text not in DIGITS:
            return ScoreOutcome.failure(ErrorCode.PARSE, f"answer {text[:200]!r} is not a digit 1-5")
        return ScoreOutcome(score=(int(text) - 1) / 4.0, details={"rating": float(text), "readout": "text"})
    probs = {digit: math.exp(logprob) for digit, logprob in answer.digit_logprobs.items()}
    mass = sum(probs.values())
    if mass < min_answer_mass:
        return ScoreOutcome.failure(
            ErrorCode.PARSE,
            f"only {mass:.3f} of the first answer token's probability is on '1'..'5' (< {min_answer_mass}); "
            f"the most likely answer is {answer.text[:50]!r}",
            {"answer_mass": mass, "answer": answer.text},
        )
    expected = sum(digit * p for digit, p in probs.items()) / mass
    return ScoreOutcome(
        score=(expected - 1.0) / 4.0,
        details={
            "rating": expected,
            "answer_mass": mass,
            "probs": {str(digit): probs.get(digit, 0.0) / mass for digit in range(1, 6)},
        },
    )


def chat_text(question: str, num_images: int) -> str:
    """Qwen2-VL / Qwen2.5-VL chat format: one user turn with the images first, then the assistant turn."""
    vision = "<|vision_start|><|image_pad|><|vision_end|>" * num_images
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{vision}{question}<|im_end|>\n<|im_start|>assistant\n"
    )


class LocalQwenVL:
    """A Qwen2-VL or Qwen2.5-VL loaded with transformers from a local directory."""

    def __init__(self, path: Path, device: str | None = None, max_new_tokens: int = 256) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a transformers model directory (no config.json)")
        config = AutoConfig.from_pretrained(path)
        if config.model_type not in ("qwen2_vl", "qwen2_5_vl"):
            raise ValueError(f"{path} holds a {config.model_type!r} model; expected qwen2_vl or qwen2_5_vl")
        self._torch = torch
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if self._device.type == "cuda" else torch.float32
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval().to(self._device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        has_processor = (path / "preprocessor_config.json").is_file()
        self.image_processor = (
            Qwen2VLImageProcessorPil.from_pretrained(path) if has_processor else Qwen2VLImageProcessorPil()
        )
        self.image_token_id = config.image_token_id
        self.digit_token_ids = []
        for digit in DIGITS:
            ids = self.tokenizer.encode(digit, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(
                    f"the tokenizer splits {digit!r} into {ids}: the probs readout needs one token"
                )
            self.digit_token_ids.append(ids[0])
        self.max_new_tokens = max_new_tokens
        weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
        self.version = f"{config.model_type}+{sha256_files(weights)[:12]}"

    def encode(self, queries: list[JudgeQuery]) -> dict[str, Any]:
        """Model inputs for a batch: left-padded ids with each image's placeholder expanded to its tokens."""
        flat = [image for query in queries for image in query.images]
        vision = self.image_processor(images=flat, return_tensors="pt")
        counts = iter((vision["image_grid_thw"].prod(dim=-1) // self.image_processor.merge_size**2).tolist())
        texts = []
        for query in queries:
            parts = chat_text(query.question, len(query.images)).split("<|image_pad|>")
            texts.append(parts[0] + "".join("<|image_pad|>" * next(counts) + part for part in parts[1:]))
        encoded = self.tokenizer(texts, return_tensors="pt", padding=True)
        inputs = {
            **encoded,
            **vision,
            "mm_token_type_ids": (encoded["input_ids"] == self.image_token_id).int(),
        }
        return {key: value.to(self._device) for key, value in inputs.items()}

    def answer(self, queries: list[JudgeQuery], readout: str) -> list[JudgeAnswer | ScoreOutcome]:
        torch = self._torch
        inputs = self.encode(queries)
        with torch.no_grad():
            if readout == "probs":
                logits_BV = self.model(**inputs).logits[:, -1].float()
                logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
                greedy = self.tokenizer.batch_decode(logits_BV.argmax(dim=-1, keepdim=True))
                digits_B5 = logprobs_BV[:, self.digit_token_ids].cpu().tolist()
                return [
                    JudgeAnswer(text, dict(zip(range(1, 6), row, strict=True)))
                    for text, row in zip(greedy, digits_B5, strict=True)
                ]
            generated = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False)
        new_tokens = generated[:, inputs["input_ids"].shape[1] :]
        return [
            JudgeAnswer(text, None)
            for text in self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        ]


class OpenAIQwenVL:
    """A judge behind an OpenAI-compatible chat-completions endpoint (vLLM, SGLang)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_concurrency: int = 16,
        max_new_tokens: int = 256,
    ) -> None:
        import httpx

        self._httpx = httpx
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # trust_env=False: proxy variables must never reroute calls to a local inference server.
        self._client = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, trust_env=False
        )
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="qwenvl-api")
        self.model = model
        self.max_new_tokens = max_new_tokens
        response = self._client.get("/models")  # fails load() early if the server or model is missing
        response.raise_for_status()
        served = {entry["id"]: entry for entry in response.json().get("data", [])}
        if model not in served:
            raise ValueError(f"{base_url} serves {sorted(served)}, not {model!r}")
        self.version = f"api:{model}+{served[model].get('root') or base_url}"

    def answer(self, queries: list[JudgeQuery], readout: str) -> list[JudgeAnswer | ScoreOutcome]:
        return list(self._pool.map(lambda query: self._ask(query, readout), queries))

    def _ask(self, query: JudgeQuery, readout: str) -> JudgeAnswer | ScoreOutcome:
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": _png_data_uri(image)}} for image in query.images
        ]
        content.append({"type": "text", "text": query.question})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}],
            "temperature": 0.0,
            "max_tokens": 1 if readout == "probs" else self.max_new_tokens,
        }
        if readout == "probs":
            body.update(logprobs=True, top_logprobs=20)
        try:
            response = self._client.post("/chat/completions", json=body)
        except self._httpx.TimeoutException as exc:
            return ScoreOutcome.failure(ErrorCode.TIMEOUT, f"judge server timed out: {exc}")
        except self._httpx.HTTPError as exc:
            return ScoreOutcome.failure(ErrorCode.INTERNAL, f"judge server unreachable: {exc}")
        if response.status_code != 200:
            return ScoreOutcome.failure(
                ErrorCode.INTERNAL, f"judge server answered {response.status_code}: {response.text[:300]}"
            )
        try:
            choice = response.json()["choices"][0]
            text = choice["message"]["content"] or ""
            first = ((choice.get("logprobs") or {}).get("content") or [None])[0]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return ScoreOutcome.failure(ErrorCode.INTERNAL, f"malformed chat completion: {exc!r}")
        if readout != "probs" or first is None:
            return JudgeAnswer(text, None)
        merged: dict[int, float] = {}  # "4" and " 4" are one answer: add their probabilities
        for entry in first.get("top_logprobs", []):
            token = entry["token"].strip()
            if token in DIGITS:
                digit = int(token)
                merged[digit] = float(np.logaddexp(merged.get(digit, -math.inf), entry["logprob"]))
        return JudgeAnswer(text, merged)


class QwenVLScorer:
    """A VLM judge's 1..5 rating of each image, as a score in [0, 1]."""

    score_range = (0.0, 1.0)

    def __init__(
        self,
        backend: str = "local",
        model_dir: Path | None = None,
        *,
        task: str = "alignment",
        readout: str = "probs",
        min_answer_mass: float = 0.5,
        max_new_tokens: int = 256,
        device: str | None = None,
    ) -> None:
        """Args:
        backend: ``"local"`` (registry name ``qwenvl``) or ``"api"`` (``qwenvl_api``).
        model_dir: the server's ``--model-dir`` (layout in the module docstring).
        task: default question template; overridden per item by ``metadata["judge_task"]`` and by
            ``"task"`` in the options file.
        readout: ``"probs"`` or ``"generate"``; overridden by ``"readout"`` in the options file.
        min_answer_mass: probs readout: the least probability on "1".."5" that counts as an answer.
        max_new_tokens: generate readout: the answer's length limit; overridden by the options file.
        device: local backend's torch device (default CUDA when available, else CPU).
        """
        if backend not in ("local", "api"):
            raise ValueError(f"unknown qwenvl backend {backend!r}; use 'local' or 'api'")
        self.name = "qwenvl" if backend == "local" else "qwenvl_api"
        self.description = f"Qwen-VL judge ({backend}): expected 1-5 rating mapped to [0, 1], per-item task"
        self._backend_kind = backend
        self._model_dir = None if model_dir is None else Path(model_dir)
        self.task, self.readout = task, readout
        self.min_answer_mass = min_answer_mass
        self.max_new_tokens = max_new_tokens
        self._device = device
        self._backend: JudgeBackend | None = None
        self._check_options()

    @property
    def version(self) -> str:
        if self._backend is None:
            return "unloaded"
        return f"{self._backend.version}+{self.readout}"

    def load(self) -> None:
        if self._model_dir is None:
            raise ValueError(f"{self.name} needs --model-dir (see reward_server/scorers/qwenvl.py)")
        options_path = self._model_dir / f"{self.name}.json"
        if self._backend_kind == "api" and not options_path.is_file():
            raise FileNotFoundError(f"{options_path} is missing: it names the judge server (base_url, model)")
        options = json.loads(options_path.read_text()) if options_path.is_file() else {}
        allowed = _API_KEYS if self._backend_kind == "api" else _OPTION_KEYS
        unknown = set(options) - allowed
        if unknown:
            raise ValueError(f"{options_path}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        self.task, self.readout = options.get("task", self.task), options.get("readout", self.readout)
        self.max_new_tokens = int(options.get("max_new_tokens", self.max_new_tokens))
        self._check_options()
        if self._backend_kind == "local":
            self._backend = LocalQwenVL(
                self._model_dir / "qwenvl", device=self._device, max_new_tokens=self.max_new_tokens
            )
        else:
            key_env = options.get("api_key_env")
            self._backend = OpenAIQwenVL(
                options["base_url"],
                options["model"],
                api_key=os.environ.get(key_env) if key_env else None,
                timeout_s=float(options.get("timeout_s", 120.0)),
                max_concurrency=int(options.get("max_concurrency", 16)),
                max_new_tokens=self.max_new_tokens,
            )
        self._backend.answer(
            [JudgeQuery([np.zeros((28, 28, 3), np.uint8)], TASKS["aesthetics"])], self.readout
        )

    def score(
        self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[ScoreOutcome]:
        assert self._backend is not None, "load() must be called before score()"
        outcomes: list[ScoreOutcome | None] = [None] * len(images)
        tasks = [meta.get("judge_task", self.task) for meta in metadata]
        rows, queries = [], []
        for row, (image, prompt, meta) in enumerate(zip(images, prompts, metadata, strict=True)):
            query = build_query(tasks[row], image, prompt, meta, self.readout)
            if isinstance(query, ScoreOutcome):
                outcomes[row] = query
            else:
                rows.append(row)
                queries.append(query)
        if queries:
            for row, answer in zip(rows, self._backend.answer(queries, self.readout), strict=True):
                outcome = (
                    answer
                    if isinstance(answer, ScoreOutcome)
                    else read_answer(answer, self.readout, self.min_answer_mass)
                )
                outcomes[row] = ScoreOutcome(
                    outcome.score, {"task": tasks[row], **outcome.details}, outcome.error, outcome.message
                )
        return outcomes  # type: ignore[return-value]

    def _check_options(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; one of {sorted(TASKS)}")
        if self.readout not in ANSWER_FORMATS:
            raise ValueError(f"unknown readout {self.readout!r}; one of {sorted(ANSWER_FORMATS)}")


def _rgb(image: np.ndarray) -> np.ndarray:
    if image.ndim != 3 or image.shape[2] not in (1, 3) or image.dtype != np.uint8:
        raise ValueError(f"expected a uint8 [H, W, 1 or 3] image, got {image.dtype} {image.shape}")
    return np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image


def _as_array(reference: Any) -> np.ndarray:
    """A reference image given as an array, or as a wire image ``{"format", "data"[, "shape"]}``."""
    if isinstance(reference, np.ndarray):
        return reference
    if isinstance(reference, dict) and {"format", "data"} <= set(reference):
        return decode_image(reference["format"], reference["data"], reference.get("shape"))
    raise TypeError("expected an array or {'format', 'data'[, 'shape']}")


def _png_data_uri(image: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")

