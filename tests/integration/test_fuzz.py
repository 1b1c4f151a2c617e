"""Schema-driven fuzzing of a real server (uvicorn on 127.0.0.1) with schemathesis: never a 5xx.

Every operation of the server's OpenAPI schema gets a bounded number of generated requests (valid and
invalid bodies, both JSON and msgpack, headers, methods); the server must answer each without a server
error and must still be healthy and scoring afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

schemathesis = pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from servers import serve  # noqa: E402

from reward_server.app import create_app  # noqa: E402
from reward_server.scorers import build_scorers  # noqa: E402
from reward_server.settings import ServerSettings  # noqa: E402
from shared.imagecodec import encode_image  # noqa: E402
from shared.protocol import MSGPACK_MEDIA_TYPE  # noqa: E402
from shared.wire import pack_msgpack  # noqa: E402

EXAMPLES_PER_OPERATION = 40  # x 5 operations: about 200 requests, a few seconds

APP = create_app(
    build_scorers(["brightness", "jpeg_compressibility"]),
    ServerSettings(max_items=8, max_image_side=256, max_body_bytes=1 << 20, instance_id="fuzz"),
)
schema = schemathesis.openapi.from_dict(APP.openapi())


@schemathesis.serializer(MSGPACK_MEDIA_TYPE)
def _msgpack(ctx: Any, value: Any) -> bytes:
    return pack_msgpack(_fit_msgpack(value))


def _fit_msgpack(value: Any) -> Any:
    """Generated JSON-like values, with integers msgpack cannot hold sent as strings instead."""
    if isinstance(value, dict):
        return {key: _fit_msgpack(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_fit_msgpack(item) for item in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return str(value)
    return value


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serve(APP) as url:
        yield url


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as http:
        http.trust_env = False  # never through a proxy
        yield http


def _fuzz(operation: Any, base_url: str, session: requests.Session) -> None:
    """``EXAMPLES_PER_OPERATION`` generated requests to one operation, each answered without a server error."""

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    def run(case: Any) -> None:
        response = case.call(base_url=base_url, session=session, timeout=30)
        assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text}"

    run()


def test_fuzzing_finds_no_server_error_and_leaves_it_alive_and_scoring(
    base_url: str, session: requests.Session
) -> None:
    """One test, so that the server checked afterwards is the one fuzzed (pytest-xdist may split a module's tests
    over workers, each with its own server)."""
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 5, operations
    for operation in operations:
        _fuzz(operation, base_url, session)
    image = np.full((8, 8, 3), 51, np.uint8)
    body = {"items": [{"id": "a", "prompt": "", "image": encode_image(image)}], "scorers": ["brightness"]}
    with httpx.Client(base_url=base_url, trust_env=False) as client:
        assert client.get("/readyz").status_code == 200
        response = client.post("/score", json=body)
        assert response.status_code == 200
        assert response.json()["results"][0]["scores"]["brightness"]["score"] == pytest.approx(0.2)
        metrics = client.get("/metrics").text
    assert 'rewardflow_requests_total{path="/score",status="5' not in metrics
    msgpack_bodies = next(
        line for line in metrics.splitlines()
        if line.startswith('rewardflow_request_body_bytes_count{media_type="application/msgpack"}')
    )  # fmt: skip
    assert float(msgpack_bodies.split()[-1]) > 0, "the fuzzer sent no msgpack bodies"
