"""What a reward server does with requests that cost far more than they look: bodies of many small values,
images decoded by many requests at once, uploads that stall or stop, huge image headers and prompts. Real
uvicorn servers on 127.0.0.1 (``servers.serve``); tests/integration/serving/ has the rest."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
import threading
import time
import zlib
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
from fastapi.responses import Response
from prometheus_client.parser import text_string_to_metric_families
from servers import replica_answering, serve, spawn_reward_server, wait_for

from reward_server.app import create_app
from reward_server.scorers import build_scorers
from reward_server.scorers.base import MAX_MESSAGE
from reward_server.scorers.digit import parse_target_digit
from reward_server.service import PixelBudget
from reward_server.settings import ServerSettings
from shared.imagecodec import ImageTooLargeError, encode_image, open_image
from shared.protocol import MSGPACK_MEDIA_TYPE
from shared.wire import TooManyValuesError, compress_body, supported_encodings, unpack_msgpack
from trainer.rewards import HttpRewardClient

TILE = encode_image(np.zeros((16, 16, 1), np.uint8))


def _body(metadata: Any, binary: bool) -> bytes:
    item = {"id": "a", "prompt": "digit 1", "image": TILE, "metadata": {"x": metadata}}
    return msgpack.packb({"items": [item]}) if binary else json.dumps({"items": [item]}).encode()


def _bomb(binary: bool, values: int) -> bytes:
    """A body whose metadata holds ``values`` zeros or nils: 1-2 bytes each, some 50 once parsed."""
    if binary:
        return _body(None, True)[:-1] + b"\xdd" + struct.pack(">I", values) + b"\xc0" * values
    return _body(None, False).replace(b"null", b"[" + b"0," * (values - 1) + b"0]")


@pytest.mark.skipif("zstd" not in supported_encodings(), reason="needs zstandard (pyproject's dev extra)")
@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
def test_a_body_of_more_values_than_the_limit_is_a_413_before_it_is_parsed(binary: bool) -> None:
    app = create_app(build_scorers(["brightness"]), ServerSettings(max_values=1000))
    headers = {"Content-Type": MSGPACK_MEDIA_TYPE if binary else "application/json"}
    with serve(app) as url, httpx.Client(base_url=url, trust_env=False, timeout=30) as client:
        assert client.get("/info").json()["limits"]["max_values"] == 1000
        assert client.post("/score", content=_body([0] * 500, binary), headers=headers).status_code == 200
        for metadata in ([0] * 2000, [[0] * 600, [0] * 600], {str(i): None for i in range(2000)}):
            response = client.post("/score", content=_body(metadata, binary), headers=headers)
            assert response.status_code == 413, response.text
            assert "more than 1000" in response.json()["detail"]
        # Fifty million values in a few kB: refused before they are built (seconds and GBs otherwise).
        started = time.monotonic()
        response = client.post(
            "/score",
            content=compress_body(_bomb(binary, 50_000_000), "zstd"),
            headers={**headers, "Content-Encoding": "zstd"},
        )
        assert response.status_code == 413, response.text
        assert time.monotonic() - started < 5.0
        assert client.get("/livez").status_code == 200


def test_msgpack_values_are_counted_over_every_container() -> None:
    assert unpack_msgpack(msgpack.packb([[1, 2], {"a": [3]}]), max_values=6) == [[1, 2], {"a": [3]}]
    with pytest.raises(TooManyValuesError):  # 2 + 2 + 1 + 1 entries
        unpack_msgpack(msgpack.packb([[1, 2], {"a": [3]}]), max_values=5)
    with pytest.raises(TooManyValuesError):  # one array header over the limit: refused before allocating
        unpack_msgpack(b"\xdd" + struct.pack(">I", 2**31), max_values=10)


def test_pixel_budget_lets_requests_in_in_arrival_order_and_gives_back_what_a_cancelled_one_held() -> None:
    async def scenario() -> list[str]:
        budget, order = PixelBudget(limit=100), []

        async def request(name: str, pixels: int, hold: asyncio.Event) -> None:
            async with budget.hold(pixels):
                order.append(name)
                await hold.wait()

        events = {name: asyncio.Event() for name in "abcd"}
        a = asyncio.create_task(request("a", 80, events["a"]))
        await asyncio.sleep(0)
        b = asyncio.create_task(request("b", 60, events["b"]))  # does not fit beside a: waits
        c = asyncio.create_task(request("c", 10, events["c"]))  # fits, but comes after b: waits too
        d = asyncio.create_task(request("d", 500, events["d"]))  # more than the limit: runs alone
        await asyncio.sleep(0.01)
        assert order == ["a"] and budget.held == 80
        b.cancel()  # gives up its place: c goes in beside a
        await asyncio.sleep(0.01)
        assert order == ["a", "c"] and budget.held == 90
        events["a"].set(), events["c"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "c", "d"] and budget.held == 500
        events["d"].set()
        await asyncio.gather(a, c, d)
        assert budget.held == 0
        return order

    asyncio.run(scenario())


class _GatedScorer:
    """Scores 0.5 once ``gate`` opens; counts the items it was given."""

    description = "test scorer"
    score_range = (0.0, 1.0)
    version = "gated-v1"

    def __init__(self) -> None:
        self.name, self.gate, self.items = "gated", threading.Event(), 0

    def load(self) -> None:
        pass

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        self.items += len(images)
        self.gate.wait(timeout=30)
        return [0.5] * len(images)


def test_a_request_that_does_not_fit_the_pixel_budget_is_decoded_only_when_earlier_ones_answer() -> None:
    scorer = _GatedScorer()
    settings = ServerSettings(max_pixels_per_request=1024, max_pixels_in_flight=1024, batch_wait_ms=0)
    app = create_app({"gated": scorer}, settings)
    body = {"items": [{"id": str(i), "prompt": "", "image": TILE} for i in range(3)]}  # 768 pixels
    with serve(app) as url:
        results: list[int] = []
        threads = [
            threading.Thread(
                target=lambda: results.append(
                    httpx.post(f"{url}/score", json=body, trust_env=False, timeout=30).status_code
                )
            )
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while scorer.items < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert scorer.items == 3 and app.state.service.pixels.held == 768  # the second one waits, undecoded
        scorer.gate.set()
        for thread in threads:
            thread.join(timeout=30)
    assert results == [200, 200] and scorer.items == 6 and app.state.service.pixels.held == 0


def _requests_by_status(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    return {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "rewardflow_requests_total" and sample.labels.get("path") == "/score"
    }


def test_a_stalled_upload_is_a_408_and_a_client_gone_mid_body_is_no_server_error() -> None:
    app = create_app(build_scorers(["brightness"]), ServerSettings(body_timeout_s=0.5))
    head = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    with serve(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + b'{"items": ')  # 10 of the 100 bytes, then nothing
            started = time.monotonic()
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"no part of the body arrived for 0.5 s after 10 bytes" in answer
            assert time.monotonic() - started < 5.0
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + b'{"items": ')
        deadline = time.monotonic() + 10
        while "400" not in _requests_by_status(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        counts = _requests_by_status(url)
        assert counts.get("400") == 1 and "500" not in counts, counts


def test_a_body_trickled_under_the_minimum_rate_is_a_408_and_bodies_in_flight_are_bounded() -> None:
    """A byte now and then pushed the stall timer back each time: such a client held its connection and its part of
    the body for good, and many of them any amount of memory (4 MB each in the audit, 256 MB allowed)."""
    settings = ServerSettings(
        body_timeout_s=1.0, min_body_rate=1000, max_body_bytes=100_000, max_body_bytes_in_flight=150_000
    )
    app = create_app(build_scorers(["brightness"]), settings)
    head = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    with serve(app) as url:
        address = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(head)
            started = time.monotonic()
            for _ in range(40):  # 10 bytes every 0.2 s: 50 bytes/s, never a 1 s stall
                sock.sendall(b" " * 10)
                time.sleep(0.2)
                sock.setblocking(False)
                try:
                    answer = sock.recv(65536)
                    break
                except BlockingIOError:
                    continue
                finally:
                    sock.setblocking(True)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
            assert b"under the 1000 bytes/s this server needs (--min-body-rate)" in answer
            assert 1.0 < time.monotonic() - started < 3.0
        with (
            socket.create_connection(address, timeout=10) as holding,
            socket.create_connection(address, timeout=10) as second,
        ):
            holding.sendall(head + b" " * 90_000)  # 90 of its 100 kB, held
            time.sleep(0.3)
            second.sendall(head + b" " * 90_000)
            answer = second.recv(65536)
            assert answer.startswith(b"HTTP/1.1 429"), answer[:300]
            assert b"receiving 90000 bytes of request bodies already, and 150000 at most" in answer
            holding.sendall(b" " * 10_000)  # its whole body: read, and refused as no JSON
            assert holding.recv(65536).startswith(b"HTTP/1.1 422")
        answer = httpx.post(
            f"{url}/score", content=b" " * 90_000, trust_env=False, headers={"Content-Type": "application/json"}
        )
        assert answer.status_code == 422  # the budget was let go


def _png_header(width: int, height: int) -> bytes:
    """A PNG declaring ``width`` x ``height`` RGB pixels in its header, with next to no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_every_oversized_image_header_is_the_same_422() -> None:
    with pytest.raises(ImageTooLargeError, match="is 5000x5000, larger than the maximum side 4096"):
        open_image("png", _png_header(5000, 5000), max_side=4096)
    with pytest.raises(ImageTooLargeError, match=r"\(400000000 pixels\) exceeds .*; the maximum side is 4096"):
        open_image("png", _png_header(20000, 20000), max_side=4096)  # over twice PIL's decompression-bomb limit


def test_a_failure_message_quoting_a_huge_prompt_is_cut() -> None:
    scorer = build_scorers(["digit"])["digit"]
    scorer.load()
    outcome = scorer.score([np.zeros((16, 16, 1), np.uint8)], ["x" * 1_000_000], [{}])[0]
    assert not outcome.ok and len(outcome.message) < MAX_MESSAGE + 50
    assert outcome.message.endswith("... (1000061 characters in all)")  # the message quotes the whole prompt


def test_an_integral_float_names_a_digit_in_metadata() -> None:
    assert parse_target_digit("", {"digit": 7.0}) == 7
    assert parse_target_digit("", {"digit": 7.5}) is None


def test_a_replica_whose_answer_cannot_be_decoded_is_failed_over() -> None:
    broken = replica_answering(  # a 200 whose gzip body httpx cannot decode
        lambda: Response(b"not gzip", headers={"Content-Encoding": "gzip"}, media_type="application/json")
    )
    good = create_app(build_scorers(["brightness"]), ServerSettings(instance_id="good"))
    with serve(broken) as broken_url, serve(good) as good_url:
        with HttpRewardClient(
            [broken_url, good_url], {"brightness": 1.0}, backoff_s=0.01, verify_replicas=False
        ) as client:
            result = client.score(np.zeros((1, 4, 4, 1), np.uint8), [""])
            states = client.replica_states()
    assert result.instances == ["good"] and result.combined.tolist() == [0.0]
    assert states[broken_url]["consecutive_failures"] == 1


def test_a_port_out_of_range_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    """--port 99999 used to log 'running on ...:99999' while the OS bound 99999 - 65536 = 34463."""
    from reward_server.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["--scorers", "digit", "--port", "99999"])
    assert exited.value.code == 2 and "argument --port: 99999 is not a TCP port (0-65535)" in capsys.readouterr().err


def _closed_after(sock: socket.socket, dribble: bytes, limit_s: float) -> float | None:
    """Seconds until the server closes ``sock`` while a byte of ``dribble`` goes every 0.1 s (None: open at
    ``limit_s``)."""
    start = time.monotonic()
    sock.settimeout(0.1)
    for i in range(int(limit_s / 0.1)):
        try:
            if i < len(dribble):
                sock.send(dribble[i : i + 1])
            if sock.recv(1) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:  # reset
            return time.monotonic() - start
    return None


def _response(sock: socket.socket) -> bytes:
    """One whole HTTP response from ``sock`` (head and Content-Length body: h11 sends them apart)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(1000)
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += sock.recv(1000)
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_connection_whose_request_head_does_not_come_is_closed_and_keep_alive_ones_stay(tmp_path, http) -> None:
    """A client that sent nothing, or its head a byte at a time, held its connection (and a file descriptor)
    for good: uvicorn times out idle keep-alive connections only. Both of uvicorn's HTTP implementations."""
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        process, url = spawn_reward_server(
            ["--scorers", "brightness", "--head-timeout-s", "1", "--http", http], stdout=out, stderr=subprocess.STDOUT
        )
    request = b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        wait_for(f"{url}/readyz")
        address = ("127.0.0.1", int(url.rpartition(":")[2]))
        with socket.create_connection(address) as silent:
            assert 0.8 < _closed_after(silent, b"", 4) < 2.5
        with socket.create_connection(address) as slow:
            assert 0.8 < _closed_after(slow, request[:-2] + b"X-Pad: " + b"a" * 100, 4) < 2.5
        with socket.create_connection(address) as kept:  # whole heads in time, 1.5 s apart on one connection
            for _ in range(2):
                kept.sendall(request)
                assert _response(kept).startswith(b"HTTP/1.1 200")
                time.sleep(1.5)  # idle past the head timeout, within uvicorn's keep-alive (5 s)
    finally:
        process.terminate()
        process.wait(timeout=30)
    text = log.read_text()
    assert text.count("no whole request head within 1 s") == 2, text


def _endless_head(sock: socket.socket, line: bytes, first: bytes) -> None:
    """Send a request head that never ends (``first``, then ``line`` over and over) until the server closes."""
    try:
        sock.sendall(first)
        for _ in range(2000):  # 16 MB at most
            sock.sendall(line * (8192 // len(line)))
    except OSError:  # closed by the server: what is wanted
        pass


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_request_head_past_its_cap_is_refused_at_once_and_bodies_do_not_count(http) -> None:
    """httptools took a head of any size before any route or token check: 120 MB of 8-byte headers held 1.9 GB
    until the head deadline, and one header value sent on and on stalled the event loop for seconds (a replica
    then looks dead to the trainer's probes). Past 64 KiB a head is refused (h11's own cap, 16 KiB, answers
    400 first); a body after a whole head is no part of it."""
    process, url = spawn_reward_server(
        ["--scorers", "brightness", "--http", http], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    address = ("127.0.0.1", int(url.rpartition(":")[2]))
    try:
        wait_for(f"{url}/readyz")
        for line, first in (
            (b"X-A: b\r\n", b"GET /livez HTTP/1.1\r\nHost: x\r\n"),
            (b"a", b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Big: "),
        ):
            with socket.create_connection(address) as sock:
                sock.settimeout(5)
                started = time.monotonic()
                sender = threading.Thread(target=_endless_head, args=(sock, line, first))
                sender.start()
                answer = b""
                try:
                    while chunk := sock.recv(65536):  # the answer, then the close
                        answer += chunk
                except ConnectionResetError:  # h11's own 400 closes with the head unread: a reset may lose it
                    assert http == "h11"
                sender.join(timeout=10)
                assert not sender.is_alive() and time.monotonic() - started < 3  # not the 10 s head deadline
            if http == "httptools":
                assert answer.startswith(b"HTTP/1.1 431 ") and b"exceed 65536 bytes (--max-head-bytes)" in answer, (
                    answer
                )
            else:
                assert answer == b"" or answer.startswith(b"HTTP/1.1 400 "), answer
        headers = {f"x-pad-{i}": "a" * 1000 for i in range(12)}  # 12 KiB of head: under both caps
        assert httpx.get(f"{url}/livez", headers=headers, trust_env=False).status_code == 200
        big = httpx.post(
            f"{url}/score",
            content=b"x" * 2_000_000,
            trust_env=False,
            timeout=30,
            headers={"Content-Type": "application/json"},
        )
        assert big.status_code == 422, big.text  # read as a body: not JSON, said so
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_head_that_came_while_the_loop_was_busy_is_answered_not_cut_off(loop: str) -> None:
    """A whole head that came while the event loop was held past the connection's deadline is read before the
    deadline acts (asyncio's loop and uvloop both read the sockets before they run the timers that fell due)."""
    pytest.importorskip(loop)
    from fastapi import FastAPI

    from reward_server.connections import head_deadline_protocol

    app = FastAPI()
    app.get("/livez")(lambda: {"status": "alive"})

    @app.get("/hold")
    async def hold() -> dict[str, str]:
        time.sleep(2.0)  # holds the event loop
        return {}

    with serve(app, wait_ready=False, loop=loop, http=head_deadline_protocol(1.0)) as url:
        with socket.create_connection(("127.0.0.1", int(url.rpartition(":")[2]))) as waiting:
            time.sleep(0.3)  # accepted: its deadline runs
            holder = threading.Thread(target=lambda: httpx.get(f"{url}/hold", trust_env=False, timeout=10))
            holder.start()
            time.sleep(0.3)  # the loop is held from here to 2.3 s, past the deadline at 1.3 s
            waiting.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
            waiting.settimeout(10)
            assert _response(waiting).startswith(b"HTTP/1.1 200")
            holder.join()
