"""A reward server's settings refuse values it could not serve with, naming the setting."""

from __future__ import annotations

import math

import pytest

from reward_server.settings import ServerSettings


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_items": 0}, "max_items must be >= 1, got 0"),
        ({"max_batch_size": -1}, "max_batch_size must be >= 1"),
        ({"max_pixels_per_request": 0}, "max_pixels_per_request must be >= 1, got 0"),
        ({"max_items": 64, "max_queue_items": 32}, "max_queue_items (32) must be >= max_items (64)"),
        ({"batch_wait_ms": -1.0}, "batch_wait_ms must be >= 0 and finite, got -1.0"),
        ({"batch_wait_ms": math.nan}, "batch_wait_ms must be >= 0 and finite, got nan"),
        ({"drain_grace_s": math.inf}, "drain_grace_s must be >= 0 and finite, got inf"),
        ({"body_timeout_s": 0.0}, "body_timeout_s must be > 0 and finite, got 0.0"),
        ({"head_timeout_s": math.inf}, "head_timeout_s must be > 0 and finite, got inf"),
        ({"token": ""}, "token must be None or a non-empty string"),
        ({"max_head_bytes": 0}, "max_head_bytes must be >= 1, got 0"),
        ({"min_body_rate": 0}, "min_body_rate must be >= 1, got 0"),
        (
            {"max_body_bytes": 10, "max_body_bytes_in_flight": 9},
            "max_body_bytes_in_flight (9) must be >= max_body_bytes (10)",
        ),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError) as info:
        ServerSettings(**kwargs)
    assert message in str(info.value)


def test_the_defaults_and_the_edges_are_accepted():
    assert ServerSettings(max_body_bytes=10).max_body_bytes_in_flight == 40
    ServerSettings(max_items=1, max_batch_size=1, max_queue_items=1, batch_wait_ms=0.0, drain_grace_s=0.0, token="t")
