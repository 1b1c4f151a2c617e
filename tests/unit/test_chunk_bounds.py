"""Rollout chunks end at whole reward requests, so chunking adds no partly filled server batches."""

import pytest

from trainer.rollout import chunk_bounds, rollout_bounds


@pytest.mark.parametrize(
    ("n", "chunks", "unit", "expected"),
    [
        (160, 8, 8, [0, 24, 40, 64, 80, 104, 120, 144, 160]),  # 20 requests over 8 chunks: 3,2,3,2,3,2,3,2
        (160, 20, 8, list(range(0, 161, 8))),
        (20, 2, 8, [0, 8, 20]),
        (20, 5, 8, [0, 8, 16, 20]),  # only 3 requests: at most 3 chunks
        (17, 3, 8, [0, 8, 17]),  # 5.7 and 11.3 both round to 8: two chunks
        (5, 4, 32, [0, 5]),
        (7, 7, 1, list(range(8))),
        (160, 1, 8, [0, 160]),
    ],
)
def test_bounds(n, chunks, unit, expected):
    assert chunk_bounds(n, chunks, unit) == expected


@pytest.mark.parametrize("n", [1, 7, 33, 160, 161])
@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
@pytest.mark.parametrize("unit", [1, 4, 8, 32])
def test_requests_are_never_split(n, chunks, unit):
    bounds = chunk_bounds(n, chunks, unit)
    assert bounds[0] == 0 and bounds[-1] == n and 1 <= len(bounds) - 1 <= chunks
    assert all(a < b for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    assert all(b % unit == 0 for b in bounds[:-1])
    requests = sum(-(-(b - a) // unit) for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    assert requests == -(-n // unit)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (160, list(range(0, 161, 16))),  # the demo: 10 chunks of 16
        (320, list(range(0, 321, 32))),  # bench/overlap.py: 10 of 32
        (32, [0, 8, 16, 24, 32]),  # never below 8 images a chunk
        (5, [0, 5]),
        (100, [0, 16, 32, 48, 64, 80, 96, 100]),  # 16s: 10 x 8 would not hold 100
    ],
)
def test_default_bounds_take_at_most_ten_chunks_of_at_least_eight(n, expected):
    bounds = rollout_bounds(n, 0, 32)
    assert bounds == expected
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert len(sizes) <= 10 and all(s >= 8 for s in sizes[:-1])


def test_explicit_chunks_cut_at_reward_requests():
    assert rollout_bounds(160, 2, 32) == chunk_bounds(160, 2, 32) == [0, 96, 160]
