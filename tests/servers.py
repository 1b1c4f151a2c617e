"""Real servers for tests: uvicorn on a free loopback port, in a thread (``serve``) or a process
(``spawn_reward_server``). Each port stays bound from its choice on: no concurrent test can take it."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Response

from trainer.rewards.launcher import bound_socket


def free_port() -> int:
    """A loopback port nothing listens on now (for a URL that must refuse connections)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def replicas_of(pid: int) -> list[int]:
    """Live reward servers started with ``--parent-pid pid`` (a trainer's own replicas)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--parent-pid" in args and args[args.index(b"--parent-pid") + 1 :][:1] == [str(pid).encode()]:
            found.append(int(proc.name))
    return found


def spawn_reward_server(args: list[str], **popen: object) -> tuple[subprocess.Popen, str]:
    """``python -m reward_server *args`` serving on a port bound here (``--fd``); the process and its URL."""
    with bound_socket("127.0.0.1") as sock:
        port = sock.getsockname()[1]
        process = subprocess.Popen(
            [sys.executable, "-m", "reward_server", *args, "--port", str(port), "--fd", str(sock.fileno())],
            pass_fds=(sock.fileno(),),
            **popen,
        )
    return process, f"http://127.0.0.1:{port}"


@contextmanager
def reward_server_process(scorers: str, model_dir: Path, timeout_s: float = 120.0) -> Iterator[str]:
    """``python -m reward_server --scorers <scorers> --model-dir <model_dir>`` ready to score: its URL; a server
    that is not ready within ``timeout_s`` fails with its log's tail (``model_dir/server.log``)."""
    log = model_dir / "server.log"
    with open(log, "wb") as out:
        args = ["--scorers", scorers, "--model-dir", str(model_dir), "--log-level", "warning"]
        process, url = spawn_reward_server(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(f"{url}/readyz", timeout_s=timeout_s)
        yield url
    except TimeoutError:
        raise AssertionError(log.read_text()[-3000:]) from None
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


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


def replica_answering(answer: Callable[[], Response]) -> FastAPI:
    """A replica that is ready and answers every ``POST /score`` with ``answer()``: a broken one, for failover."""
    app = FastAPI()

    @app.get("/readyz")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/score")
    async def score() -> Response:
        return answer()

    return app


@contextmanager
def serve(app: FastAPI, *, wait_ready: bool = True, **config: object) -> Iterator[str]:
    """Run ``app`` under uvicorn on a free loopback port in a thread (``config``: more ``uvicorn.Config``
    settings, e.g. ``loop``, ``http``); yield its base URL."""
    sock = bound_socket("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        wait_for(f"{url}/readyz" if wait_ready else f"{url}/livez")
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
