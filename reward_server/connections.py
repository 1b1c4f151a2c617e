"""A deadline for each request's head (request line and headers). uvicorn closes a keep-alive connection that
stays idle, but waits without end for a head that never comes or comes a byte at a time: each such client
holds a connection and a file descriptor. ``python -m reward_server`` serves with the protocol made here."""

from __future__ import annotations

import asyncio
import importlib.util
import logging

logger = logging.getLogger("reward_server")


def head_deadline_protocol(timeout_s: float, http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol ``http`` (``auto``: httptools where installed, else h11, as uvicorn picks) that
    closes a connection whose request head has not fully arrived ``timeout_s`` after the connection opened, or
    after the first byte of a later request on it."""
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class HeadDeadlineProtocol(Base):
        _timer: asyncio.TimerHandle | None = None
        _waiting_since: object = None  # the request cycle before the head being waited for (None: the first)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first bytes of the next request
            super().data_received(data)
            if self._timer is not None and self.cycle is not self._waiting_since:
                self._disarm()  # a whole head arrived: uvicorn began a new request cycle

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._waiting_since = self.cycle
            self._timer = self.loop.call_later(timeout_s, self._head_too_slow)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _head_too_slow(self) -> None:
            self._timer = None
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            logger.warning("closed the connection of %s: no whole request head within %g s", client, timeout_s)
            self.transport.close()

    return HeadDeadlineProtocol
