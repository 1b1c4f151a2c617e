"""``qwenvl`` and ``qwenvl_api``: a Qwen2-VL / Qwen2.5-VL judge that rates an image from 1 to 5.

What the judge is asked and how its answer is read (tasks, the ``probs`` and ``generate`` readouts) is
in :mod:`reward_server.scorers.judge`; this module holds the backends and the scorer.

Backends (one registry name each), with ``<model_dir>`` the server's ``--model-dir``:
    ``qwenvl``: transformers in-process, from ``<model_dir>/qwenvl/`` (a ``save_pretrained`` directory:
        config.json, safetensors, tokenizer files, preprocessor_config.json). Images are preprocessed by
        transformers' PIL image processor (``Qwen2VLImageProcessorPil``: the default, torchvision-based
        processor and the ``AutoProcessor`` bundle need torchvision); the chat text is built here in
        Qwen's chat format. Optional ``<model_dir>/qwenvl.json``: ``{"task", "readout", "max_new_tokens"}``.
    ``qwenvl_api``: an OpenAI-compatible chat-completions server (vLLM, SGLang) serving such a model,
        described by ``<model_dir>/qwenvl_api.json``: ``{"base_url": "http://host:port/v1", "model":
        NAME}`` plus optional ``"api_key_env"`` (the name of an environment variable holding the key),
        ``"task"``, ``"readout"``, ``"max_new_tokens"`` (256), ``"timeout_s"`` (120),
        ``"max_concurrency"`` (16). Images are sent as lossless PNG data URIs. The ``probs`` readout asks
        for ``top_logprobs`` (20) of the first token; a server that returns none is read from its
        one-digit answer text instead.
Departures from Flow-GRPO's Qwen2.5-VL judge (docs/departures.md, Scorers): our default task and readout
(``"task": "flow_grpo", "readout": "generate", "max_new_tokens": 2048`` give theirs), and images go through
the model's image processor rather than qwen_vl_utils.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from reward_server.scorers.base import ModelFilesMissing, ScoreOutcome
from reward_server.scorers.fingerprint import sha256_files
from reward_server.scorers.judge import (
    ANSWER_FORMATS,
    DIGITS,
    OWN_FORMAT_TASKS,
    SYSTEM_PROMPT,
    TASKS,
    JudgeAnswer,
    JudgeQuery,
    build_query,
    read_answer,
)
from shared.protocol import ErrorCode

_OPTION_KEYS = {"task", "readout", "max_new_tokens"}
_SERVER_KEYS = {"base_url", "model", "api_key_env", "timeout_s", "max_concurrency"}


class JudgeBackend(Protocol):
    version: str

    def answer(self, queries: list[JudgeQuery], readout: str) -> list[JudgeAnswer | ScoreOutcome]:
        """One answer per query (greedy), or a per-query failure."""
        ...


def chat_text(question: str, num_images: int, system: str | None = SYSTEM_PROMPT) -> str:
    """Qwen2-VL / Qwen2.5-VL chat format: one user turn with the images first, then the assistant turn
    (without a system message, Qwen's chat template puts in its default, :data:`SYSTEM_PROMPT`)."""
    vision = "<|vision_start|><|image_pad|><|vision_end|>" * num_images
    return (
        f"<|im_start|>system\n{system or SYSTEM_PROMPT}<|im_end|>\n"
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
                raise ValueError(f"the tokenizer splits {digit!r} into {ids}: the probs readout needs one token")
            self.digit_token_ids.append(ids[0])
        self.max_new_tokens = max_new_tokens
        weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
        self.version = f"{config.model_type}+{sha256_files(weights)[:12]}"

    def encode(self, queries: list[JudgeQuery], **image_options: Any) -> dict[str, Any]:
        """Model inputs for a batch: left-padded ids with each image's placeholder expanded to its tokens
        (``image_options`` go to the image processor, e.g. ``do_resize=False``)."""
        flat = [image for query in queries for image in query.images]
        vision = self.image_processor(images=flat, return_tensors="pt", **image_options)
        counts = iter((vision["image_grid_thw"].prod(dim=-1) // self.image_processor.merge_size**2).tolist())
        texts = []
        for query in queries:
            parts = chat_text(query.question, len(query.images), query.system).split("<|image_pad|>")
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
        return [JudgeAnswer(text, None) for text in self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


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
        self._client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, trust_env=False)
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
        body = chat_request(query, self.model, readout, self.max_new_tokens)
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
            raise ModelFilesMissing(f"{self.name} needs --model-dir (see reward_server/scorers/qwenvl.py)")
        options = read_options(self._model_dir, self.name, api=self._backend_kind == "api", keys=_OPTION_KEYS)
        self.task, self.readout = options.get("task", self.task), options.get("readout", self.readout)
        self.max_new_tokens = int(options.get("max_new_tokens", self.max_new_tokens))
        self._check_options()
        self._backend = open_backend(
            self._model_dir / "qwenvl",
            options,
            api=self._backend_kind == "api",
            device=self._device,
            max_new_tokens=self.max_new_tokens,
        )
        self._backend.answer([JudgeQuery([np.zeros((28, 28, 3), np.uint8)], TASKS["aesthetics"])], self.readout)

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[ScoreOutcome]:
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
                    else read_answer(answer, self.readout, self.min_answer_mass, tasks[row])
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
        if self.task in OWN_FORMAT_TASKS and self.readout != "generate":
            raise ValueError(f'task {self.task!r} needs readout \'generate\' (set "readout": "generate")')


def read_options(model_dir: Path, name: str, *, api: bool, keys: set[str]) -> dict[str, Any]:
    """``<model_dir>/<name>.json`` (required for an API backend: it names the server), checked against
    ``keys`` plus, for an API backend, the server keys."""
    path = model_dir / f"{name}.json"
    if api and not path.is_file():
        raise FileNotFoundError(f"{path} is missing: it names the judge server (base_url, model)")
    options = json.loads(path.read_text()) if path.is_file() else {}
    allowed = keys | _SERVER_KEYS if api else keys
    unknown = set(options) - allowed
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    return options


def converted_judge(
    name: str, model_dir: Path | None, files: tuple[str, ...], tokens: tuple[str, ...], device: str | None
) -> tuple[Path, LocalQwenVL, list[int]]:
    """``<model_dir>/<name>/``: a Qwen2-VL reward model laid out by ``convert_<name>`` (its ``files`` there and its
    special ``tokens`` in the tokenizer), loaded; returns the folder, the judge and the tokens' ids."""
    convert = f"python -m reward_server.scorers.convert_{name}"
    if model_dir is None:
        raise ModelFilesMissing(f"{name} needs --model-dir with {name}/ (see {convert})")
    root = model_dir / name
    for needed in files:
        if not (root / needed).is_file():
            raise FileNotFoundError(f"no {needed} in {root}: convert the released checkpoint there with {convert}")
    judge = LocalQwenVL(root, device=device)
    ids = judge.tokenizer.convert_tokens_to_ids(list(tokens))
    if judge.tokenizer.convert_ids_to_tokens(ids) != list(tokens):
        raise ValueError(f"the tokenizer in {root} lacks {list(tokens)}: convert with {convert}")
    return root, judge, ids


def open_backend(
    local_path: Path, options: dict[str, Any], *, api: bool, device: str | None, max_new_tokens: int
) -> JudgeBackend:
    """The judge in ``local_path`` (transformers), or the server that ``options`` name (chat completions)."""
    if not api:
        return LocalQwenVL(local_path, device=device, max_new_tokens=max_new_tokens)
    key_env = options.get("api_key_env")
    return OpenAIQwenVL(
        options["base_url"],
        options["model"],
        api_key=os.environ.get(key_env) if key_env else None,
        timeout_s=float(options.get("timeout_s", 120.0)),
        max_concurrency=int(options.get("max_concurrency", 16)),
        max_new_tokens=max_new_tokens,
    )


def chat_request(query: JudgeQuery, model: str, readout: str, max_new_tokens: int) -> dict[str, Any]:
    """The chat-completions body for one query: greedy, images (PNG data URIs) before the question, the
    first token's top 20 log-probabilities for the ``probs`` readout."""
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": _png_data_uri(image)}} for image in query.images
    ]
    content.append({"type": "text", "text": query.question})
    system = [{"role": "system", "content": query.system}] if query.system is not None else []
    body: dict[str, Any] = {
        "model": model,
        "messages": [*system, {"role": "user", "content": content}],
        "temperature": 0.0,
        "max_tokens": 1 if readout == "probs" else max_new_tokens,
    }
    if readout == "probs":
        body.update(logprobs=True, top_logprobs=20)
    return body


def _png_data_uri(image: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
