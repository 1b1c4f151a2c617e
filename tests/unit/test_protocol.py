"""Wire schemas, image codec and binary bodies: round trips, decode errors and size limits."""

from __future__ import annotations

import base64
import io
import time

import msgpack
import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from shared.imagecodec import (
    DecodeError,
    ImageTooLargeError,
    as_hwc_uint8,
    decode_image,
    encode_batch,
    encode_image,
)
from shared.protocol import (
    BinaryScoreRequest,
    ErrorCode,
    InfoResponse,
    ScoreRequest,
    ScoreResponse,
    ScorerResult,
    TooManyItemsError,
)
from shared.wire import (
    BodyError,
    BodyTooLargeError,
    compress_body,
    decompress_body,
    pack_msgpack,
    supported_encodings,
    unpack_msgpack,
)

RNG = np.random.default_rng(0)
GRAY = RNG.integers(0, 256, (24, 16, 1), dtype=np.uint8)
RGB = RNG.integers(0, 256, (16, 24, 3), dtype=np.uint8)


def _png_bytes(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("wire_format", ["png", "raw"])
@pytest.mark.parametrize("array", [GRAY, RGB], ids=["gray", "rgb"])
def test_lossless_round_trip(wire_format: str, array: np.ndarray) -> None:
    encoded = encode_image(array, wire_format)
    assert encoded["format"] == wire_format
    decoded = decode_image(encoded["format"], encoded["data"], encoded.get("shape"))
    assert decoded.dtype == np.uint8
    np.testing.assert_array_equal(decoded, array)


def test_two_dimensional_input_is_grayscale() -> None:
    encoded = encode_image(GRAY[:, :, 0], "png")
    assert decode_image("png", encoded["data"]).shape == (24, 16, 1)
    assert encode_image(GRAY[:, :, 0], "raw")["shape"] == [24, 16, 1]


@pytest.mark.parametrize("wire_format", ["jpeg", "webp"])
def test_lossy_formats_decode_close(wire_format: str) -> None:
    smooth = np.tile(np.linspace(0, 255, 32, dtype=np.uint8)[None, :, None], (32, 1, 3))
    decoded = decode_image(wire_format, encode_image(smooth, wire_format)["data"])
    assert decoded.shape == smooth.shape
    assert np.abs(decoded.astype(int) - smooth).mean() < 3


def test_encode_batch_accepts_a_bhwc_array() -> None:
    batch = RNG.integers(0, 256, (3, 8, 8, 3), dtype=np.uint8)
    encoded = encode_batch(batch, "raw")
    assert len(encoded) == 3
    for item, image in zip(encoded, batch, strict=True):
        np.testing.assert_array_equal(decode_image("raw", item["data"], item["shape"]), image)


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros((4, 4, 3), np.float32), "uint8"),
        (np.zeros((4, 4, 2), np.uint8), "shape"),
        (np.zeros((2, 4, 4, 3), np.uint8), "shape"),
        (np.zeros((0, 4, 3), np.uint8), "shape"),
    ],
)
def test_encode_rejects_bad_arrays(array: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encode_image(array)


def test_encode_rejects_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown image format"):
        encode_image(GRAY, "gif")


def test_alpha_palette_and_16_bit_images_are_converted() -> None:
    rgba = Image.fromarray(RNG.integers(0, 256, (8, 8, 4), dtype=np.uint8), mode="RGBA")
    np.testing.assert_array_equal(decode_image("png", _png_bytes(rgba)), np.asarray(rgba)[:, :, :3])
    assert decode_image("png", _png_bytes(rgba.convert("P"))).shape == (8, 8, 3)
    sixteen = Image.fromarray(np.full((8, 8), 100, dtype=np.uint16))
    assert decode_image("png", _png_bytes(sixteen)).shape == (8, 8, 1)


def test_16_bit_images_are_scaled_to_8_bits_not_clipped() -> None:
    gradient = np.array([[0, 255, 256, 4096], [32768, 65280, 65535, 1000]], dtype=np.uint16)
    decoded = decode_image("png", _png_bytes(Image.fromarray(gradient)))
    assert decoded[:, :, 0].tolist() == [[0, 0, 1, 16], [128, 255, 255, 3]]


def test_multi_picture_jpegs_decode_to_their_first_frame() -> None:
    """Phone cameras write MPO: a JPEG followed by more frames. It is a jpeg on the wire, not a mismatch."""
    first, second = (Image.fromarray(np.full((8, 8, 3), value, dtype=np.uint8)) for value in (40, 200))
    buffer = io.BytesIO()
    first.save(buffer, format="MPO", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(buffer.getvalue())).format == "MPO"
    decoded = decode_image("jpeg", buffer.getvalue())
    assert decoded.shape == (8, 8, 3) and abs(float(decoded.mean()) - 40) < 2
    with pytest.raises(DecodeError, match="declared format 'png' but the data is MPO"):
        decode_image("png", buffer.getvalue())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("png", "not base64!!"), "not valid base64"),
        (("png", base64.b64encode(b"garbage").decode()), "not a readable png"),
        (("jpeg", encode_image(GRAY, "png")["data"]), "declared format 'jpeg' but the data is PNG"),
        (("png", encode_image(GRAY, "png")["data"][:60]), "png"),
        (("raw", encode_image(GRAY, "raw")["data"], [24, 16, 3]), "needs 1152"),
        (("raw", encode_image(GRAY, "raw")["data"], None), "shape"),
        (("raw", encode_image(GRAY, "raw")["data"], [24, 16, 2]), "shape"),
        (("bmp", "AAAA"), "unknown image format"),
    ],
)
def test_decode_errors_are_clear(args: tuple, message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        decode_image(*args)


@pytest.mark.parametrize("wire_format", ["png", "raw"])
def test_max_side_is_checked(wire_format: str) -> None:
    encoded = encode_image(GRAY, wire_format)
    assert decode_image(wire_format, encoded["data"], encoded.get("shape"), max_side=24).shape == GRAY.shape
    with pytest.raises(ImageTooLargeError, match="24x16, larger than the maximum side 23"):
        decode_image(wire_format, encoded["data"], encoded.get("shape"), max_side=23)
    assert issubclass(ImageTooLargeError, DecodeError)


def test_as_hwc_uint8_makes_contiguous() -> None:
    view = RGB[:, ::2]
    assert not view.flags.c_contiguous
    assert as_hwc_uint8(view).flags.c_contiguous


def _request(**overrides: object) -> dict:
    body = {
        "request_id": "r1",
        "items": [{"id": "a", "prompt": "digit 3", "image": encode_image(GRAY, "png"), "metadata": {"digit": 3}}],
    }
    body.update(overrides)
    return body


def test_score_request_parses_and_defaults() -> None:
    request = ScoreRequest.model_validate(_request())
    assert request.scorers is None and request.deadline_ms is None
    assert request.items[0].metadata == {"digit": 3}
    assert ScoreRequest.model_validate({"items": _request()["items"]}).request_id  # generated


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "red"}, "Extra inputs are not permitted"),
        ({"items": []}, "at least 1 item"),
        ({"deadline_ms": 0}, "greater than 0"),
        ({"scorers": ["digit", "digit"]}, "scorers must be unique"),
        ({"items": [_request()["items"][0]] * 2}, "item ids must be unique"),
        (
            {"items": [{"id": "a", "prompt": "", "image": {"format": "gif", "data": "AA"}}]},
            "'png', 'jpeg', 'webp'",
        ),
        ({"items": [{"id": "a", "prompt": "", "image": {"format": "raw", "data": "AA"}}]}, "requires shape"),
        (
            {"items": [{"id": "a", "prompt": "", "image": {"format": "raw", "data": "AA", "shape": [1, 1, 4]}}]},
            "1 \\(grayscale\\) or 3",
        ),
        (
            {"items": [{"id": "a", "prompt": "", "image": {"format": "png", "data": "AA", "shape": [1, 1, 1]}}]},
            "only allowed with format 'raw'",
        ),
        (
            {"items": [{"id": "a", "prompt": "", "image": encode_image(GRAY), "metadata": {"mask": 1}}]},
            "reserved",
        ),
        (
            {
                "items": [
                    {
                        "id": "a",
                        "prompt": "",
                        "image": encode_image(GRAY),
                        "metadata_images": {"mask": encode_image(GRAY)},
                    }
                ]
            },
            "reserved",
        ),
        (
            {
                "items": [
                    {
                        "id": "a",
                        "prompt": "",
                        "image": encode_image(GRAY),
                        "metadata": {"reference_image": 1},
                        "metadata_images": {"reference_image": encode_image(GRAY)},
                    }
                ]
            },
            "in both metadata and metadata_images",
        ),
    ],
)
def test_score_request_rejects(change: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ScoreRequest.model_validate(_request(**change))


def test_deadline_is_bounded_so_a_huge_integer_is_a_validation_error() -> None:
    assert ScoreRequest.model_validate(_request(deadline_ms=24 * 3600 * 1000)).deadline_ms == 86_400_000
    for body in (_request(deadline_ms=24 * 3600 * 1000 + 1), _request(deadline_ms=10**400)):
        with pytest.raises(ValidationError, match="deadline_ms"):
            ScoreRequest.model_validate(body)
    with pytest.raises(ValidationError, match="deadline_ms"):
        ScoreRequest.model_validate_json('{"deadline_ms": ' + "9" * 400 + ', "items": []}')


def test_too_many_items_are_refused_before_any_item_is_validated() -> None:
    invalid_items = [{"not": "an item"}] * 40_000  # each would be a validation error
    for model in (ScoreRequest, BinaryScoreRequest):
        with pytest.raises(TooManyItemsError, match="40000 items exceed the limit of 16 \\(max_items\\)"):
            model.model_validate({"items": invalid_items}, context={"max_items": 16})
    with pytest.raises(TooManyItemsError, match="2 items exceed the limit of 1"):
        ScoreRequest.model_validate_json(b'{"items": [{"id": "a"}, {"id": "b"}]}', context={"max_items": 1})


def test_duplicate_ids_are_found_in_linear_time() -> None:
    image = encode_image(np.zeros((1, 1, 1), np.uint8), "raw")
    items = [{"id": str(i), "prompt": "", "image": image} for i in range(40_000)]
    items.append({"id": "7", "prompt": "", "image": image})
    started = time.process_time()
    with pytest.raises(ValidationError, match=r"item ids must be unique; repeated: \['7'\]"):
        ScoreRequest.model_validate({"items": items})
    assert time.process_time() - started < 5.0  # quadratic: ~30 s of CPU


def test_scorer_result_is_a_score_or_an_error() -> None:
    ScorerResult(ok=True, score=0.5)
    ScorerResult(ok=False, error={"code": "PARSE", "message": "no digit"})
    with pytest.raises(ValidationError, match="ok result needs a score"):
        ScorerResult(ok=True, score=None)
    with pytest.raises(ValidationError, match="failed result needs an error and no score"):
        ScorerResult(ok=False, score=0.0, error={"code": "INTERNAL", "message": "x"})
    with pytest.raises(ValidationError, match="finite"):
        ScorerResult(ok=True, score=float("nan"))
    with pytest.raises(ValidationError):
        ScorerResult(ok=False, error={"code": "ZERO", "message": "x"})
    assert {code.value for code in ErrorCode} == {
        "TIMEOUT",
        "DECODE",
        "OOM",
        "PARSE",
        "INTERNAL",
        "BAD_INPUT",
    }


def test_responses_tolerate_new_fields() -> None:
    response = ScoreResponse.model_validate(
        {
            "request_id": "r1",
            "instance": "i",
            "models": {"digit": "v1"},
            "results": [{"id": "a", "scores": {"digit": {"ok": True, "score": 0.9, "new_field": 1}}}],
            "timing": {"total_ms": 1, "decode_ms": 0, "scorers": {}},
            "added_later": True,
        }
    )
    assert response.results[0].scores["digit"].score == 0.9
    info = InfoResponse.model_validate(
        {
            "instance": "i",
            "ready": True,
            "scorers": [{"name": "b", "version": "1", "score_min": 0, "score_max": None, "description": ""}],
            "limits": {"max_items": 1, "max_image_side": 2, "max_body_bytes": 3},
        }
    )
    assert info.protocol_version == "1"


# Binary (msgpack) bodies ---------------------------------------------------------------------------


def _binary_request(**overrides: object) -> dict:
    body = {
        "request_id": "r1",
        "items": [
            {
                "id": "a",
                "prompt": "digit 3",
                "image": encode_image(RGB, "raw", binary=True),
                "mask": encode_image(GRAY, "png", binary=True),
                "metadata": {"digit": 3, "nested": [1, 2.5, None, {"k": "v"}]},
            }
        ],
    }
    body.update(overrides)
    return body


def test_msgpack_round_trip_is_lossless() -> None:
    packed = pack_msgpack(_binary_request())
    plain = msgpack.unpackb(packed)  # standard msgpack, readable by any library
    assert plain["items"][0]["image"] == {"format": "raw", "data": RGB.tobytes(), "shape": [16, 24, 3]}
    request = BinaryScoreRequest.model_validate(unpack_msgpack(packed))
    item = request.items[0]
    assert item.metadata == {"digit": 3, "nested": [1, 2.5, None, {"k": "v"}]}
    np.testing.assert_array_equal(decode_image("raw", item.image.data, item.image.shape), RGB)
    np.testing.assert_array_equal(decode_image("png", item.mask.data), GRAY)


def test_binary_raw_image_is_sent_without_base64() -> None:
    encoded = encode_image(RGB, "raw", binary=True)
    assert encoded["data"] is not None and encoded["shape"] == [16, 24, 3]
    packed = pack_msgpack({"image": encoded})
    assert len(packed) < RGB.nbytes + 64  # raw pixels plus a few header bytes


@pytest.mark.parametrize("encoding", supported_encodings())
def test_compression_round_trip(encoding: str) -> None:
    body = pack_msgpack(_binary_request())
    compressed = compress_body(body, encoding)
    assert decompress_body(compressed, encoding, max_bytes=len(body)) == body
    with pytest.raises(BodyTooLargeError):
        decompress_body(compressed, encoding, max_bytes=len(body) - 1)


@pytest.mark.parametrize("encoding", supported_encodings())
def test_decompression_bombs_stop_at_the_limit(encoding: str) -> None:
    bomb = compress_body(bytes(50_000_000), encoding)
    assert len(bomb) < 1_000_000
    with pytest.raises(BodyTooLargeError, match="more than 1000000 bytes"):
        decompress_body(bomb, encoding, max_bytes=1_000_000)


@pytest.mark.parametrize("encoding", supported_encodings())
def test_corrupt_compressed_bodies_are_body_errors(encoding: str) -> None:
    with pytest.raises(BodyError, match=f"corrupt {encoding}"):
        decompress_body(b"not compressed at all", encoding, max_bytes=1000)
    truncated = compress_body(pack_msgpack(_binary_request()), encoding)[:-10]
    with pytest.raises(BodyError):
        decompress_body(truncated, encoding, max_bytes=10_000_000)


def test_a_zstd_frame_without_its_size_cut_short_is_said_to_be_so() -> None:
    """Without a declared size, zstd's stream reader returned what it had: the body parser then said "Unpack
    failed: incomplete input", of msgpack, not of the cut frame."""
    zstandard = pytest.importorskip("zstandard")
    body = pack_msgpack(_binary_request())
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(body)
    assert decompress_body(frame, "zstd", max_bytes=len(body)) == body
    with pytest.raises(BodyError, match="^corrupt zstd body: the frame is cut short$"):
        decompress_body(frame[:-8], "zstd", max_bytes=len(body))


def test_unknown_encoding() -> None:
    with pytest.raises(BodyError, match="unsupported Content-Encoding 'br'"):
        decompress_body(b"x", "br", max_bytes=10)
    with pytest.raises(ValueError, match="not available"):
        compress_body(b"x", "br")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"\xc1", "invalid msgpack"),
        (msgpack.packb({"a": 1}) + b"\x00", "invalid msgpack"),  # trailing data
        (msgpack.packb({1: "a"}), "invalid msgpack"),  # non-string key
        (msgpack.packb(msgpack.ExtType(5, b"x")), "extension type 5"),
        (msgpack.packb({"t": msgpack.Timestamp(1)}), "Timestamp is not accepted"),
        (b"\x91" * 100_000, "invalid msgpack body: StackError: nested deeper than msgpack's limit"),
        (b"\xa2\xff\xfe", "invalid msgpack"),  # invalid UTF-8
    ],
)
def test_unpack_refuses_anything_but_plain_values(body: bytes, message: str) -> None:
    with pytest.raises(BodyError, match=message):
        unpack_msgpack(body)


def test_pack_refuses_values_msgpack_cannot_hold() -> None:
    with pytest.raises(ValueError, match="float32"):
        pack_msgpack({"metadata": {"x": np.float32(1)}})
    with pytest.raises(ValueError, match="keys must be strings"):
        pack_msgpack({1: "a"})
    with pytest.raises(ValueError, match="C-contiguous"):
        pack_msgpack({"data": RGB[:, ::2]})


def test_binary_request_applies_the_same_rules() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        BinaryScoreRequest.model_validate(_binary_request(colour="red"))
    bad_shape = _binary_request()
    bad_shape["items"][0]["image"] = {"format": "raw", "data": b"\x00" * 8, "shape": [2, 2, 2]}
    with pytest.raises(ValidationError, match="1 \\(grayscale\\) or 3"):
        BinaryScoreRequest.model_validate(bad_shape)
    assert BinaryScoreRequest.model_fields.keys() == ScoreRequest.model_fields.keys()


def test_decode_accepts_bytes_and_base64_alike() -> None:
    for wire_format in ("png", "raw", "webp"):
        text = encode_image(RGB, wire_format)
        binary = encode_image(RGB, wire_format, binary=True)
        np.testing.assert_array_equal(
            decode_image(wire_format, text["data"], text.get("shape")),
            decode_image(wire_format, bytes(binary["data"]), binary.get("shape")),
        )
