"""A deadline and a size cap for each request's head (request line and headers). uvicorn closes a keep-alive
connection that stays idle, but waits without end for a head that never comes or comes a byte at a time (each such
client holds a connection and a file descriptor), and httptools takes a head of any size: 120 MB of small headers
held 1.9 GB, one long header value stalled the event loop for seconds. ``python -m reward_server`` serves with the
protocol made here."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging

logger = logging.getLogger("reward_server")

TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


def head_deadline_protocol(
    timeout_s: float, http: str = "auto", max_head_bytes: int = 64 * 1024
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol ``http`` (``auto``: httptools where installed, else h11, as uvicorn picks) that
    closes a connection whose request head has not fully arrived ``timeout_s`` after the connection opened, or
    after the first byte of a later request on it; with httptools, a head still coming past ``max_head_bytes``
    (counted from the read after the one it began in) gets a 431. h11 caps a head itself (16 KiB: a 400)."""
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class HeadDeadlineProtocol(_HeadLimits, Base):
        _timeout_s = timeout_s
        _max_head_bytes = max_head_bytes

    return HeadDeadlineProtocol


class _HeadLimits:
    """The deadline and the size cap, laid over one of uvicorn's HTTP protocols (the class after it in the MRO);
    ``head_deadline_protocol`` sets the two limits."""

    _timeout_s: float
    _max_head_bytes: int
    _timer: asyncio.TimerHandle | None = None
    _waiting_since: object = None  # the request cycle before the head being waited for (None: the first)
    _in_head = False  # httptools: between a request's first byte and its last header
    _head_bytes = 0  # of that head, in the reads after the one it began in
    _refused = False  # answered 431: what more comes is dropped until the close

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of the next request
        in_head = self._in_head
        super().data_received(data)
        if self._timer is not None and self.cycle is not self._waiting_since:
            self._disarm()  # a whole head arrived: uvicorn began a new request cycle
        if in_head and self._in_head:  # all of this read is head: a body starts after a whole one
            self._head_bytes += len(data)
            if self._head_bytes > self._max_head_bytes and not self.transport.is_closing():
                self._head_too_large()

    def on_message_begin(self) -> None:  # httptools' parser calls these; h11 has none
        self._in_head, self._head_bytes = True, 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._waiting_since = self.cycle
        self._timer = self.loop.call_later(self._timeout_s, self._head_too_slow)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_too_slow(self) -> None:
        self._timer = None
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        logger.warning("closed the connection of %s: no whole request head within %g s", client, self._timeout_s)
        self.transport.close()

    def _head_too_large(self) -> None:
        self._disarm()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        logger.warning(
            "closed the connection of %s: a request head of more than %d bytes", client, self._max_head_bytes
        )
        detail = json.dumps(
            {"detail": f"the request line and headers exceed {self._max_head_bytes} bytes (--max-head-bytes)"}
        ).encode()
        self.transport.write(TOO_LARGE % (len(detail), detail))
        # Closed while the client still sends, the socket would reset and the answer could be lost: the
        # client gets it and an end of stream now, and what more it sends is dropped for a second.
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(1.0, self.transport.close)
