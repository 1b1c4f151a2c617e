"""A vLLM-like OpenAI-compatible chat server on 127.0.0.1 whose answers a real local Qwen-VL judge computes: the
API backends' tests run against it (``/v1/models`` and ``/v1/chat/completions``, logprobs optional)."""

from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch
from PIL import Image

from reward_server.scorers.judge import JudgeQuery
from reward_server.scorers.qwenvl import LocalQwenVL


class ChatServer(ThreadingHTTPServer):
    """``/v1/models`` and ``/v1/chat/completions`` as vLLM answers them, computed by a LocalQwenVL."""

    daemon_threads = True

    def __init__(self, judge: LocalQwenVL, *, logprobs: bool = True, fail_on: str | None = None) -> None:
        super().__init__(("127.0.0.1", 0), ChatHandler)
        self.judge, self.logprobs, self.fail_on = judge, logprobs, fail_on
        self.lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        (user,) = [m for m in body["messages"] if m["role"] == "user"]
        images = [from_data_uri(part["image_url"]["url"]) for part in user["content"] if part["type"] == "image_url"]
        (question,) = [part["text"] for part in user["content"] if part["type"] == "text"]
        query = JudgeQuery(images, question)
        with self.lock, torch.no_grad():
            if body["max_tokens"] > 1:
                (answer,) = self.judge.answer([query], "generate")
                return {"choices": [{"message": {"role": "assistant", "content": answer.text}, "logprobs": None}]}
            logits = self.judge.model(**self.judge.encode([query])).logits[0, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logprobs, body.get("top_logprobs", 1))
        tokens = [self.judge.tokenizer.decode([index]) for index in top.indices.tolist()]
        content = {
            "token": tokens[0],
            "logprob": float(top.values[0]),
            "top_logprobs": [
                {"token": token, "logprob": float(value)} for token, value in zip(tokens, top.values, strict=True)
            ],
        }
        logprob_field = {"content": [content]} if self.logprobs and body.get("logprobs") else None
        return {"choices": [{"message": {"role": "assistant", "content": tokens[0]}, "logprobs": logprob_field}]}


class ChatHandler(BaseHTTPRequestHandler):
    server: ChatServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path != "/v1/models":
            return self._send(404, {"error": "not found"})
        self._send(200, {"data": [{"id": "tiny-qwen", "root": "/models/tiny-qwen"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        if self.path != "/v1/chat/completions" or body["model"] != "tiny-qwen":
            return self._send(404, {"error": "unknown model or path"})
        if self.server.fail_on and self.server.fail_on in json.dumps(body["messages"]):
            return self._send(500, {"error": "engine died"})
        self._send(200, self.server.complete(body))

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


def from_data_uri(uri: str) -> np.ndarray:
    header, data = uri.split(",", 1)
    assert header == "data:image/png;base64"
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))


@contextmanager
def serve_chat(judge: LocalQwenVL, **options: Any) -> Iterator[ChatServer]:
    """A :class:`ChatServer` for ``judge`` on a free loopback port, in a thread, stopped on exit."""
    server = ChatServer(judge, **options)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
