"""Wire codecs of the reward protocol: msgpack bodies and their compression (schemas: :mod:`shared.protocol`).

A msgpack body holds only plain values (maps with string keys, arrays, strings, numbers, booleans, nil,
``bin``): extension types, timestamps included, are refused and nothing is ever unpickled. A body may be
compressed with ``Content-Encoding: zstd`` or ``lz4`` (LZ4 frame) when the package is installed; the
server lists what it accepts in ``/info`` (``encodings``). This module must not import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np


class BodyError(ValueError):
    """A request body cannot be decoded (bad msgpack, corrupt compressed data, unsupported encoding)."""


class BodyTooLargeError(BodyError):
    """A compressed body decompresses to more than the allowed size."""


class TooManyValuesError(BodyTooLargeError):
    """A body holds more values than allowed: parsed, it would take far more memory than its bytes."""


_BIN32 = b"\xc6"
_PLAIN_LEAVES = (str, int, float, bool, bytes, type(None))  # what unpack_msgpack lets through


def pack_msgpack(obj: Any) -> bytes:
    """msgpack-encode ``obj``: dicts, lists and tuples, plain leaves, and buffers as ``bin``.

    Buffer leaves (``bytes``, ``bytearray``, ``memoryview``, C-contiguous ``np.ndarray``) become ``bin``
    values holding their raw bytes, copied once, straight into the joined body: a uint8 image array is
    sent as its pixels without an intermediate copy.

    Raises:
        ValueError: for a value msgpack cannot represent (e.g. a numpy scalar in metadata).
    """
    packer = msgpack.Packer(autoreset=True)
    segments: list[Any] = []
    stack: list[Any] = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            segments.append(packer.pack_map_header(len(value)))
            for key, item in reversed(list(value.items())):
                stack.append(item)
                stack.append(_Key(key))
        elif isinstance(value, (list, tuple)):
            segments.append(packer.pack_array_header(len(value)))
            stack.extend(reversed(value))
        elif isinstance(value, (bytes, bytearray, memoryview, np.ndarray)):
            view = memoryview(value)
            if not view.c_contiguous:
                raise ValueError("buffers in a msgpack body must be C-contiguous")
            segments.append(_BIN32 + view.nbytes.to_bytes(4, "big"))
            segments.append(view.cast("B") if view.ndim != 1 or view.format != "B" else view)
        else:
            if isinstance(value, _Key):
                value = value.key
                if not isinstance(value, str):
                    raise ValueError(f"map keys must be strings, got {type(value).__name__}")
            try:
                segments.append(packer.pack(value))
            except (TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"cannot encode {type(value).__name__} in msgpack: {exc}") from exc
    return b"".join(segments)


class _Key:
    """Marks a map key on :func:`pack_msgpack`'s stack (keys must be strings)."""

    __slots__ = ("key",)

    def __init__(self, key: Any) -> None:
        self.key = key


def _refuse_ext(code: int, data: bytes) -> Any:
    raise BodyError(f"msgpack extension type {code} is not accepted")


def unpack_msgpack(body: bytes, max_values: int | None = None) -> Any:
    """Decode a msgpack body into plain Python values, with at most ``max_values`` array and map entries in all.

    A value is one byte of msgpack (nil, small ints) but some 50 as a Python object: the bound keeps a body's
    memory once parsed near its size. It is checked per array or map header before anything is allocated
    (msgpack's own limits), then summed over the containers as they complete.

    Raises:
        TooManyValuesError: more than ``max_values`` entries.
        BodyError: invalid msgpack, trailing data, invalid UTF-8, non-string map keys, or any extension
            type (timestamps included).
    """
    limit = len(body) if max_values is None else max_values
    counted = 0

    def count(container: Any) -> Any:
        nonlocal counted
        counted += len(container)
        if counted > limit:
            raise TooManyValuesError(f"the body holds more than {limit} values (array and map entries)")
        return container

    try:
        value = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            timestamp=0,
            use_list=True,
            max_array_len=limit,
            max_map_len=limit,
            list_hook=count,
            object_hook=count,
        )
    except BodyError:
        raise
    except Exception as exc:  # msgpack raises ValueError subclasses, UnicodeDecodeError, TypeError
        if isinstance(exc, ValueError) and "exceeds max_" in str(exc):  # max_array_len or max_map_len
            raise TooManyValuesError(f"the body holds more than {limit} values: {exc}") from None
        why = str(exc) or ("nested deeper than msgpack's limit" if isinstance(exc, msgpack.StackError) else "no detail")
        raise BodyError(f"invalid msgpack body: {type(exc).__name__}: {why}") from None
    stack = [value]
    while stack:  # timestamps bypass ext_hook: refuse every non-plain value here
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif not isinstance(item, _PLAIN_LEAVES):
            raise BodyError(f"msgpack value of type {type(item).__name__} is not accepted")
    return value


def check_json_values(body: bytes, max_values: int) -> None:
    """Refuse a JSON body that may hold more than ``max_values`` values before it is parsed.

    Each value inside an array or object follows a ``[``, ``{`` or ``,``: their count bounds the values from
    above (commas in strings count too), at the speed of a byte scan.

    Raises:
        TooManyValuesError: the bound exceeds ``max_values``.
    """
    bound = body.count(b",") + body.count(b"[") + body.count(b"{")
    if bound > max_values:
        raise TooManyValuesError(
            f"the body may hold {bound} JSON values (counting commas and opening brackets), more than {max_values}"
        )


def _zstd_codec() -> tuple[Callable[[bytes], bytes], Callable[[bytes, int], bytes]] | None:
    try:
        import zstandard
    except ImportError:
        return None

    def compress(body: bytes) -> bytes:
        return zstandard.ZstdCompressor(level=1).compress(body)

    def decompress(body: bytes, max_bytes: int) -> bytes:
        # One frame, as compress() writes it. Its declared size (if any) is checked before and after:
        # a frame cut short is an error here; without a declared size the body parser catches it.
        try:
            declared = zstandard.frame_content_size(body)
        except zstandard.ZstdError as exc:
            raise BodyError(f"corrupt zstd body: {exc}") from None
        if declared > max_bytes:
            raise BodyTooLargeError(f"zstd body declares {declared} bytes, more than {max_bytes} bytes")
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        chunks, size = [], 0
        try:
            while chunk := reader.read(1 << 22):
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLargeError(f"zstd body decompresses to more than {max_bytes} bytes")
                chunks.append(chunk)
        except zstandard.ZstdError as exc:
            raise BodyError(f"corrupt zstd body: {exc}") from None
        if declared >= 0 and size != declared:
            raise BodyError(f"corrupt zstd body: {size} bytes decompressed, the frame declares {declared}")
        if declared < 0:  # no size to check against: is the frame whole? (at most the size just read, again)
            whole = zstandard.ZstdDecompressor().decompressobj()
            whole.decompress(body)
            if not whole.eof:
                raise BodyError("corrupt zstd body: the frame is cut short")
        return b"".join(chunks)

    return compress, decompress


def _lz4_codec() -> tuple[Callable[[bytes], bytes], Callable[[bytes, int], bytes]] | None:
    try:
        import lz4.frame
    except ImportError:
        return None

    def compress(body: bytes) -> bytes:
        return lz4.frame.compress(body, compression_level=0, store_size=True)

    def decompress(body: bytes, max_bytes: int) -> bytes:
        decompressor = lz4.frame.LZ4FrameDecompressor()
        try:
            data = decompressor.decompress(body, max_length=max_bytes + 1)
        except RuntimeError as exc:
            raise BodyError(f"corrupt lz4 body: {exc}") from None
        if len(data) > max_bytes:
            raise BodyTooLargeError(f"lz4 body decompresses to more than {max_bytes} bytes")
        if not decompressor.eof or decompressor.unused_data:
            raise BodyError("corrupt lz4 body: truncated frame or trailing data")
        return data

    return compress, decompress


# Content-Encoding name -> (compress, bounded decompress); only the codecs whose package is installed.
_CODECS = {name: codec for name, codec in (("zstd", _zstd_codec()), ("lz4", _lz4_codec())) if codec is not None}


def supported_encodings() -> list[str]:
    """Content-Encoding values (besides identity) this process can compress and decompress."""
    return sorted(_CODECS)


def compress_body(body: bytes, encoding: str) -> bytes:
    """Compress a request body: ``zstd`` (level 1) or ``lz4`` (LZ4 frame, fastest level).

    Raises:
        ValueError: the encoding is unknown or its package is not installed.
    """
    if encoding not in _CODECS:
        raise ValueError(f"encoding {encoding!r} is not available here; available: {supported_encodings()}")
    return _CODECS[encoding][0](body)


def decompress_body(body: bytes, encoding: str, max_bytes: int) -> bytes:
    """Decompress a request body, refusing to produce more than ``max_bytes``.

    Raises:
        BodyTooLargeError: the result would exceed ``max_bytes`` (decompression stops there).
        BodyError: unsupported encoding or corrupt data.
    """
    if encoding not in _CODECS:
        raise BodyError(f"unsupported Content-Encoding {encoding!r}; supported: {supported_encodings()}")
    return _CODECS[encoding][1](body, max_bytes)
