"""The reward server's endpoints over real HTTP on 127.0.0.1: health and info, scoring, the JSON and msgpack
bodies and the answers to malformed ones, and the limits on what one request may hold."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
from fixtures_reward_server import SCORERS, StubScorer, digit_images, score_item
from servers import serve

from reward_server.app import create_app
from reward_server.scorers import build_scorers
from reward_server.settings import ServerSettings
from shared.imagecodec import encode_image
from shared.protocol import MSGPACK_MEDIA_TYPE
from shared.wire import compress_body, pack_msgpack, supported_encodings
from trainer.rewards import HttpRewardClient, LocalRewardPool
from trainer.rewards.wire import DEFAULT_WIRE_FORMAT, WIRE_FORMATS


def test_health_and_info(http: httpx.Client, pool: LocalRewardPool) -> None:
    assert http.get("/livez").json()["status"] == "alive"
    assert http.get("/readyz").status_code == 200
    info = http.get("/info").json()
    assert info["ready"] is True and info["instance"].startswith("local-0-")
    assert [scorer["name"] for scorer in info["scorers"]] == SCORERS
    digit = info["scorers"][0]
    assert digit["version"].startswith("digits-logreg-v1+") and (digit["score_min"], digit["score_max"]) == (
        0,
        1,
    )
    assert info["limits"] == {
        "max_items": 16,
        "max_image_side": 64,
        "max_body_bytes": 300000,
        "max_pixels_per_request": ServerSettings().max_pixels_per_request,
        "max_values": ServerSettings().max_values,
        "max_frames": ServerSettings().max_frames,
    }
    assert "rewardflow_ready 1" in http.get("/metrics").text


@pytest.mark.parametrize("wire_format", ["png", "raw"])
def test_score_digits_and_closed_forms(http: httpx.Client, wire_format: str) -> None:
    images, labels = digit_images(4)
    rgb = np.full((32, 32, 3), 51, np.uint8)
    items = [
        score_item(f"d{i}", image, f"a handwritten {label}", wire_format)
        for i, (image, label) in enumerate(zip(images, labels, strict=True))
    ]
    items.append(score_item("flat", rgb, "digit 0", wire_format, metadata={"note": "rgb"}))
    response = http.post("/score", json={"request_id": "req-1", "items": items})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["request_id"] == "req-1" and set(body["models"]) == set(SCORERS)
    assert [result["id"] for result in body["results"]] == [item["id"] for item in items]
    for result, label in zip(body["results"][:4], labels, strict=True):
        digit = result["scores"]["digit"]
        assert digit["ok"] and digit["score"] > 0.5 and digit["details"]["predicted"] == label
    flat = body["results"][4]["scores"]
    assert flat["brightness"]["score"] == pytest.approx(0.2)
    assert flat["jpeg_compressibility"]["score"] < 0
    assert set(body["timing"]["scorers"]) == set(SCORERS)
    assert body["timing"]["scorers"]["digit"]["batch_size"] == 5


def test_score_a_subset_of_scorers_and_per_item_failures(http: httpx.Client) -> None:
    items = [
        score_item("ok", np.zeros((16, 16, 1), np.uint8), "digit 8"),
        score_item("no-target", np.zeros((16, 16, 1), np.uint8), "a cat"),
        {"id": "corrupt", "prompt": "digit 1", "image": {"format": "png", "data": "aGVsbG8="}},
        score_item("bad-size", np.zeros((12, 12, 1), np.uint8), "digit 1"),
    ]
    response = http.post("/score", json={"scorers": ["digit", "brightness"], "items": items})
    assert response.status_code == 200
    results = {result["id"]: result["scores"] for result in response.json()["results"]}
    assert set(results["ok"]) == {"digit", "brightness"}
    assert results["ok"]["digit"]["ok"]
    assert results["no-target"]["digit"] == {
        "ok": False,
        "score": None,
        "details": {},
        "error": {
            "code": "PARSE",
            "message": "no digit 0-9 or digit word in prompt 'a cat' nor metadata['digit']",
        },
    }
    assert results["no-target"]["brightness"]["ok"]
    assert results["corrupt"]["digit"]["error"]["code"] == "DECODE"
    assert results["corrupt"]["brightness"]["error"]["code"] == "DECODE"
    assert results["bad-size"]["digit"]["error"]["code"] == "BAD_INPUT"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "Invalid JSON"),
        (b'{"items": []}', "items: List should have at least 1 item"),
        (
            b'{"items": [{"id": "a", "prompt": "", "image": {"format": "gif", "data": "AA"}}]}',
            "items.0.image.format",
        ),
        (
            b'{"items": [{"id": "a", "prompt": "", "image": {"format": "raw", "data": "AA"}}]}',
            "requires shape",
        ),
        (b'{"itemz": []}', "itemz: Extra inputs are not permitted"),
        (
            b'{"scorers": ["aesthetic"], "items": '
            b'[{"id": "a", "prompt": "", "image": {"format": "png", "data": "AA"}}]}',
            "unknown scorer(s) ['aesthetic']",
        ),
    ],
)
def test_malformed_requests_are_422_with_a_message(http: httpx.Client, body: bytes, message: str) -> None:
    response = http.post("/score", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    assert message in response.json()["detail"]


def test_limits(http: httpx.Client) -> None:
    image = np.zeros((16, 16, 1), np.uint8)
    too_many = http.post("/score", json={"items": [score_item(str(i), image) for i in range(17)]})
    assert too_many.status_code == 413 and "17 items exceed the limit of 16" in too_many.json()["detail"]

    huge = http.post("/score", json={"items": [score_item("a", image, prompt="x" * 300_001)]})
    assert huge.status_code == 413 and "300000 bytes" in huge.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the server counts while reading
        yield b'{"items": [{"id": "a", "prompt": "'
        for _ in range(31):
            yield b"x" * 10_000
        yield b'"}]}'

    streamed = http.post("/score", content=chunks())
    assert streamed.status_code == 413

    wide = http.post(
        "/score", json={"items": [score_item("ok", image), score_item("wide", np.zeros((8, 65, 1), np.uint8))]}
    )
    assert wide.status_code == 422
    assert "items.1 (id 'wide'): image is 8x65, larger than the maximum side 64" in wide.json()["detail"]


def _post_msgpack(
    client: httpx.Client, body: dict, encoding: str | None = None, content_type: str = MSGPACK_MEDIA_TYPE
) -> httpx.Response:
    payload = pack_msgpack(body)
    headers = {"Content-Type": content_type}
    if encoding is not None:
        payload = compress_body(payload, encoding)
        headers["Content-Encoding"] = encoding
    return client.post("/score", content=payload, headers=headers)


@pytest.mark.parametrize("encoding", [None, *supported_encodings()])
@pytest.mark.parametrize("content_type", [MSGPACK_MEDIA_TYPE, "application/x-msgpack"])
def test_msgpack_body_scores_like_json(http: httpx.Client, encoding: str | None, content_type: str) -> None:
    images, labels = digit_images(3)
    rgb = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)

    def items(binary: bool) -> list[dict]:
        digits = [
            {"id": f"d{i}", "prompt": f"digit {label}", "image": encode_image(image, "raw", binary=binary)}
            for i, (image, label) in enumerate(zip(images, labels, strict=True))
        ]
        png = {"id": "png", "prompt": "digit 1", "image": encode_image(rgb, "png", binary=binary)}
        masked = {
            "id": "masked",
            "prompt": "digit 2",
            "image": encode_image(rgb, "raw", binary=binary),
            "mask": encode_image(rgb[:, :, :1], "png", binary=binary),
            "metadata": {"note": [1, 2.5, None]},
        }
        return [*digits, png, masked]

    binary = _post_msgpack(http, {"request_id": "bin", "items": items(True)}, encoding, content_type)
    text = http.post("/score", json={"request_id": "bin", "items": items(False)})
    assert binary.status_code == 200, binary.text
    assert [r["scores"] for r in binary.json()["results"]] == [r["scores"] for r in text.json()["results"]]
    assert binary.json()["results"][-1]["scores"]["brightness"]["score"] == pytest.approx(rgb.mean() / 255)


@pytest.mark.parametrize(
    ("payload", "headers", "status", "message"),
    [
        (b"\xc1", {}, 422, "invalid msgpack"),
        (msgpack.packb({"items": [], "t": msgpack.Timestamp(1)}), {}, 422, "Timestamp is not accepted"),
        (msgpack.packb({"itemz": []}), {}, 422, "itemz: Extra inputs are not permitted"),
        (
            msgpack.packb({"items": [{"id": "a", "prompt": "", "image": {"format": "raw", "data": b"x"}}]}),
            {},
            422,
            "requires shape",
        ),
        (b"anything", {"Content-Encoding": "br"}, 415, "unsupported Content-Encoding 'br'"),
        (b"not zstd", {"Content-Encoding": "zstd"}, 422, "corrupt zstd body"),
        (compress_body(bytes(400_000), "zstd"), {"Content-Encoding": "zstd"}, 413, "300000 bytes"),
        (compress_body(bytes(400_000), "lz4"), {"Content-Encoding": "lz4"}, 413, "300000 bytes"),
    ],
)
def test_bad_binary_bodies(
    http: httpx.Client, payload: bytes, headers: dict[str, str], status: int, message: str
) -> None:
    response = http.post("/score", content=payload, headers={"Content-Type": MSGPACK_MEDIA_TYPE, **headers})
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]
    if status == 415:
        assert response.headers["accept-encoding"].startswith("identity")


def test_a_body_of_another_media_type_is_a_415_naming_the_two_it_takes(http: httpx.Client) -> None:
    """A text/plain body was read as JSON; curl's -d sends application/x-www-form-urlencoded."""
    image = encode_image(np.zeros((8, 8, 1), np.uint8), "png")
    body = json.dumps({"items": [{"id": "a", "prompt": "", "image": image}]})
    for media_type in ("text/plain", "application/x-www-form-urlencoded"):
        response = http.post("/score", content=body, headers={"Content-Type": media_type})
        assert response.status_code == 415, response.text
        assert response.json()["detail"] == (
            f"unsupported Content-Type {media_type!r}: send application/json (curl: "
            "-H 'Content-Type: application/json') or application/msgpack"
        )
    for headers in ({}, {"Content-Type": "application/json; charset=utf-8"}):  # no type at all: JSON
        response = http.post("/score", content=body, headers=headers)
        assert response.status_code == 200, response.text


def test_msgpack_limits_match_json(http: httpx.Client) -> None:
    image = encode_image(np.zeros((16, 16, 1), np.uint8), "raw", binary=True)
    too_many = _post_msgpack(http, {"items": [{"id": str(i), "prompt": "", "image": image} for i in range(17)]})
    assert too_many.status_code == 413
    wide = encode_image(np.zeros((8, 65, 1), np.uint8), "raw", binary=True)
    response = _post_msgpack(http, {"items": [{"id": "wide", "prompt": "", "image": wide}]})
    assert response.status_code == 422 and "larger than the maximum side 64" in response.json()["detail"]


def test_info_lists_media_types_and_encodings(http: httpx.Client) -> None:
    info = http.get("/info").json()
    assert info["media_types"] == ["application/json", MSGPACK_MEDIA_TYPE]
    assert info["encodings"] == supported_encodings()


@pytest.mark.parametrize("wire_format", WIRE_FORMATS)
def test_wire_formats_give_identical_scores(pool: LocalRewardPool, wire_format: str) -> None:
    """Parity: every wire format delivers the same pixels, so every scorer gives the same scores."""
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    prompts = [f"digit {i}" for i in range(6)]
    weights = {"digit": 1.0, "brightness": 0.5, "jpeg_compressibility": 0.1}
    with HttpRewardClient(pool.urls, weights, batch_size=4, wire_format="png") as reference_client:
        reference = reference_client.score(images, prompts)
    with HttpRewardClient(pool.urls, weights, batch_size=4, wire_format=wire_format) as client:
        result = client.score(images, prompts)
    for name in weights:
        np.testing.assert_array_equal(result.components[name], reference.components[name])
    np.testing.assert_array_equal(result.combined, reference.combined)


def test_default_wire_format_is_msgpack(pool: LocalRewardPool) -> None:
    with HttpRewardClient(pool.urls, {"brightness": 1.0}) as client:
        assert client.wire_format == DEFAULT_WIRE_FORMAT == "msgpack"
        client.score(np.zeros((1, 16, 16, 1), np.uint8), [""])
    metrics = (
        httpx.get(f"{pool.urls[0]}/metrics", trust_env=False).text
        + httpx.get(f"{pool.urls[1]}/metrics", trust_env=False).text
    )
    assert 'rewardflow_request_body_bytes_count{media_type="application/msgpack"}' in metrics


def test_a_huge_deadline_is_a_422_naming_the_field(http: httpx.Client, pool: LocalRewardPool) -> None:
    image = encode_image(np.zeros((16, 16, 1), np.uint8))
    for deadline in ("9" * 400, str(24 * 3600 * 1000 + 1)):
        body = f'{{"deadline_ms": {deadline}, "items": [{{"id": "a", "prompt": "", "image": {json.dumps(image)}}}]}}'
        response = http.post("/score", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 422, response.text
        assert "deadline_ms: Input should be less than or equal to 86400000" in response.json()["detail"]
    with HttpRewardClient(pool.urls, {"brightness": 1.0}, timeout_s=10.0**6) as client:  # a day at most
        assert client.score(np.zeros((1, 16, 16, 1), np.uint8), [""]).combined.tolist() == [0.0]


@pytest.mark.parametrize("binary", [False, True])
def test_too_many_items_are_a_413_before_the_items_are_validated(http: httpx.Client, binary: bool) -> None:
    items = [{"id": "a", "not": "an item"}] * 17  # invalid and with repeated ids: only the count matters
    response = _post_msgpack(http, {"items": items}) if binary else http.post("/score", json={"items": items})
    assert response.status_code == 413
    assert response.json()["detail"] == "17 items exceed the limit of 16 (max_items)"


def test_pixels_per_request_are_bounded_before_decoding() -> None:
    small = create_app(build_scorers(["brightness"]), ServerSettings(max_pixels_per_request=1000))
    default = create_app(build_scorers(["brightness"]), ServerSettings())
    tile = encode_image(np.zeros((20, 20, 1), np.uint8))  # 400 pixels
    huge = encode_image(np.zeros((4096, 4096, 3), np.uint8))  # 16.8 Mpixels in a 50 kB PNG

    def item(item_id: str, **extra: Any) -> dict:
        return {"id": item_id, "prompt": "", "image": tile, **extra}

    with serve(small) as small_url, serve(default) as default_url:
        with httpx.Client(base_url=small_url, trust_env=False, timeout=30) as client:
            assert client.get("/info").json()["limits"]["max_pixels_per_request"] == 1000
            assert client.post("/score", json={"items": [item("a"), item("b")]}).status_code == 200
            for body in (  # 1200 pixels each: masks and metadata images count
                {"items": [item("a"), item("b"), item("c")]},
                {"items": [item("a", mask=tile), item("b")]},
                {"items": [item("a", metadata_images={"reference_image": tile}), item("b")]},
            ):
                response = client.post("/score", json=body)
                assert response.status_code == 413, response.text
                detail = response.json()["detail"]
                assert "hold 1200 pixels" in detail and "limit of 1000 (max_pixels_per_request)" in detail
                assert "--max-pixels-per-request" in detail
        body = {"items": [{"id": str(i), "prompt": "", "image": huge} for i in range(10)]}
        started = time.monotonic()
        response = httpx.post(f"{default_url}/score", json=body, trust_env=False, timeout=30)
        assert response.status_code == 413 and "hold 167772160 pixels" in response.json()["detail"]
        assert time.monotonic() - started < 2.0  # refused from the headers: nothing decoded


class _RecordingScorer(StubScorer):
    """Keeps the metadata of every item it scores."""

    def __init__(self) -> None:
        super().__init__(name="recording")
        self.metadata: list[dict[str, Any]] = []

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        self.metadata.extend(metadata)
        return [0.5] * len(images)


@pytest.mark.parametrize("wire_format", WIRE_FORMATS)
def test_arrays_in_metadata_reach_the_scorer_as_arrays(wire_format: str) -> None:
    scorer = _RecordingScorer()
    reference = np.random.default_rng(2).integers(0, 256, (12, 10, 3), dtype=np.uint8)
    with serve(create_app({"recording": scorer}, ServerSettings())) as url:
        with HttpRewardClient([url], {"recording": 1.0}, wire_format=wire_format) as client:
            metadata = [
                {"judge_task": "edit", "reference_image": reference},
                {"reference_image": reference[:, :, 0], "mask": np.ones((4, 4, 1), np.uint8)},
            ]
            result = client.score(np.zeros((2, 4, 4, 1), np.uint8), ["", ""], metadata)
            with pytest.raises(
                ValueError,
                match=r"metadata\[0\]\['reference_image'\]: arrays in metadata are sent as images, "
                r"and images must be uint8, got float32",
            ):
                client.submit(
                    np.zeros((1, 4, 4, 1), np.uint8), [""], [{"reference_image": reference.astype(np.float32)}]
                )
    assert result.combined.tolist() == [0.5, 0.5]
    first, second = scorer.metadata
    assert first["judge_task"] == "edit" and first.keys() == {"judge_task", "reference_image"}
    np.testing.assert_array_equal(first["reference_image"], reference)
    np.testing.assert_array_equal(second["reference_image"], reference[:, :, :1])
    assert second["mask"].shape == (4, 4, 1)
