"""How a request to the reward pool can fail: the errors a caller sees, and the retryable failure of one
attempt that the client handles itself."""

from __future__ import annotations


class RewardClientError(RuntimeError):
    """Base class of reward client failures."""


class RewardUnavailableError(RewardClientError):
    """No replica could score a chunk within the allowed retries or the step budget."""


class RewardRequestError(RewardClientError):
    """A replica rejected a request as invalid (a 4xx other than 408/429); retrying cannot help."""


class AttemptFailed(Exception):
    """One attempt at one replica failed in a retryable way."""

    def __init__(self, message: str, *, retry_after_s: float | None = None, down: bool = False) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.down = down  # the replica is certainly not serving (refused connection, 503): open at once


def is_retryable(status: int) -> bool:
    """Whether an HTTP status may succeed on another attempt (timeouts, overload, server errors)."""
    return status in (408, 429) or 500 <= status < 600
