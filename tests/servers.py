"""Real servers for tests: uvicorn on a free loopback port, in a thread, stopped on exit."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from fastapi import FastAPI


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, status: int = 200, timeout_s: float = 30.0) -> None:
    """Poll ``url`` until it answers ``status`` (connection errors count as not yet)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(url).status_code == status:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer {status} within {timeout_s} s")


@contextmanager
def serve(app: FastAPI, *, wait_ready: bool = True) -> Iterator[str]:
    """Run ``app`` under uvicorn on a free loopback port in a thread; yield its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(f"{url}/readyz" if wait_ready else f"{url}/livez")
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
