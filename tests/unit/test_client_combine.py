"""Reward combination and the in-process client (same contract as the HTTP client, no server)."""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from reward_server.inprocess import InProcessRewardClient
from shared.rewards import COMBINE_MODES, RewardResult, combine, failed_share, standardise
from trainer.rewards import HttpRewardClient


@pytest.fixture(scope="module")
def client() -> InProcessRewardClient:
    with InProcessRewardClient.from_names({"brightness": 2.0, "jpeg_compressibility": -0.5, "digit": 0.0}) as c:
        yield c


def _images(count: int, channels: int = 1) -> np.ndarray:
    return np.random.default_rng(count).integers(0, 256, (count, 16, 16, channels), dtype=np.uint8)


def test_combine_is_a_weighted_sum() -> None:
    components = {"a": np.array([1.0, 2.0, 3.0]), "b": np.array([10.0, 0.0, -10.0])}
    np.testing.assert_allclose(combine(components, {"a": 2.0, "b": -0.5}), [-3.0, 4.0, 11.0])


def test_combine_propagates_nan_but_ignores_zero_weights() -> None:
    components = {
        "a": np.array([1.0, np.nan]),
        "b": np.array([np.nan, 1.0]),
        "log_only": np.array([np.nan, 5.0]),
    }
    combined = combine(components, {"a": 1.0, "b": 1.0, "log_only": 0.0})
    assert np.isnan(combined).all()
    np.testing.assert_allclose(combine(components, {"a": 1.0, "log_only": 0.0}), [1.0, np.nan])


def test_in_process_client_matches_closed_forms(client: InProcessRewardClient) -> None:
    images = _images(5, channels=3)
    result = client.score(images, ["digit 1"] * 5)
    brightness = images.reshape(5, -1).mean(axis=1) / 255
    np.testing.assert_allclose(result.components["brightness"], brightness)
    assert (result.components["jpeg_compressibility"] < 0).all()
    np.testing.assert_allclose(result.combined, 2.0 * brightness - 0.5 * result.components["jpeg_compressibility"])
    assert set(result.components) == {"brightness", "jpeg_compressibility", "digit"}
    assert all(array.dtype == np.float64 and array.shape == (5,) for array in result.components.values())


def test_failed_items_are_nan_with_an_error(client: InProcessRewardClient) -> None:
    result = client.score(_images(3), ["digit 4", "no target", "seven"])
    digit = result.components["digit"]
    assert np.isnan(digit[1]) and not np.isnan(digit[[0, 2]]).any()
    assert result.errors["digit"][1].startswith("PARSE:")
    assert result.num_failed == 0  # digit has weight 0: logged, not combined

    strict = InProcessRewardClient(client.scorers, {"digit": 1.0, "brightness": 1.0})
    result = strict.score(_images(3), ["digit 4", "no target", "seven"])
    assert np.isnan(result.combined[1]) and result.num_failed == 1
    strict.close()


def test_submit_returns_a_future_and_copies_inputs(client: InProcessRewardClient) -> None:
    images = np.full((2, 16, 16, 1), 255, np.uint8)
    future = client.submit(images, ["1", "2"], [{"digit": 1}, {"digit": 2}])
    images[:] = 0  # the caller reuses its buffer at once
    assert isinstance(future, concurrent.futures.Future)
    result = future.result(timeout=30)
    assert isinstance(result, RewardResult)
    np.testing.assert_allclose(result.components["brightness"], [1.0, 1.0])


def test_score_async(client: InProcessRewardClient) -> None:
    result = asyncio.run(client.score_async(_images(2), ["1", "2"]))
    assert result.combined.shape == (2,)


@pytest.mark.parametrize(
    ("images", "prompts", "metadata", "message"),
    [
        (np.zeros((2, 16, 16, 1), np.float32), ["a", "b"], None, "uint8"),
        (np.zeros((2, 16, 16), np.uint8), ["a", "b"], None, r"\[B, H, W, C\]"),
        (np.zeros((2, 16, 16, 4), np.uint8), ["a", "b"], None, "C = 1 or 3"),
        (np.zeros((2, 16, 16, 1), np.uint8), ["a"], None, "2 images but 1 prompts"),
        (np.zeros((2, 16, 16, 1), np.uint8), ["a", "b"], [{}], "2 images but 1 metadata"),
    ],
)
def test_inputs_are_validated(client: InProcessRewardClient, images, prompts, metadata, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        client.submit(images, prompts, metadata)


def test_weights_must_name_given_scorers(client: InProcessRewardClient) -> None:
    with pytest.raises(ValueError, match="not given"):
        InProcessRewardClient(client.scorers, {"aesthetic": 1.0})
    with pytest.raises(ValueError, match="at least one"):
        InProcessRewardClient(client.scorers, {})
    with pytest.raises(ValueError, match="finite"):
        InProcessRewardClient(client.scorers, {"brightness": float("nan")})


def test_all_zero_weights_are_refused(client: InProcessRewardClient) -> None:
    """Zero weights everywhere would give every item a combined reward of 0, failed items included."""
    with pytest.raises(
        ValueError,
        match=r"reward.weights=\{'brightness': 0.0, 'digit': -0.0\} gives no scorer a "
        r"weight .*non-zero weight",
    ):
        InProcessRewardClient(client.scorers, {"brightness": 0.0, "digit": -0.0})
    with pytest.raises(ValueError, match=r"reward.weights=\{'brightness': 0.0\} gives no scorer a weight"):
        HttpRewardClient(["http://127.0.0.1:1"], {"brightness": 0.0})


def test_standardise_ignores_nan_and_uses_the_population_std() -> None:
    values = np.array([1.0, np.nan, 3.0, 5.0])
    z = standardise(values)
    finite = values[~np.isnan(values)]
    expected = (finite - finite.mean()) / (finite.std(ddof=0) + 1e-8)
    np.testing.assert_allclose(z[~np.isnan(values)], expected)
    assert np.isnan(z[1])
    np.testing.assert_array_equal(standardise(np.array([2.0, 2.0])), [0.0, 0.0])  # no spread: all 0
    assert np.isnan(standardise(np.array([np.nan, np.nan]))).all()


def test_combine_modes() -> None:
    components = {"a": np.array([1.0, 2.0, 3.0, np.nan]), "b": np.array([100.0, 300.0, 200.0, 5.0])}
    weights = {"a": 1.0, "b": 0.5}
    raw = components["a"] + 0.5 * components["b"]
    np.testing.assert_allclose(combine(components, weights, "sum"), raw)
    np.testing.assert_allclose(combine(components, weights, "sum-then-normalise"), standardise(raw))
    # Each component standardised over its own finite entries (b's NaN-free 4 values), then weighted.
    expected = standardise(components["a"]) + 0.5 * standardise(components["b"])
    np.testing.assert_allclose(combine(components, weights, "normalise-then-sum"), expected)
    for mode in COMBINE_MODES:
        assert np.isnan(combine(components, weights, mode)[3])  # a missing component: NaN in every mode
    with pytest.raises(ValueError, match="mode must be one of"):
        combine(components, weights, "mean")


def test_normalise_then_sum_weighs_components_on_different_scales_equally() -> None:
    rng = np.random.default_rng(0)
    components = {"small": rng.normal(0, 0.01, 64), "large": rng.normal(0, 100, 64)}
    combined = combine(components, {"small": 1.0, "large": 1.0}, "normalise-then-sum")
    assert (
        abs(np.corrcoef(combined, components["small"])[0, 1] - np.corrcoef(combined, components["large"])[0, 1]) < 0.2
    )
    summed = combine(components, {"small": 1.0, "large": 1.0}, "sum-then-normalise")
    assert np.corrcoef(summed, components["large"])[0, 1] > 0.999  # the large scale drowns the small one


def test_in_process_client_combine_mode(client: InProcessRewardClient) -> None:
    normalised = InProcessRewardClient(client.scorers, {"brightness": 1.0}, combine_mode="sum-then-normalise")
    result = normalised.score(_images(6), ["1"] * 6)
    np.testing.assert_allclose(result.combined, standardise(result.components["brightness"]))
    assert abs(result.combined.mean()) < 1e-9
    normalised.close()
    with pytest.raises(ValueError, match="combine_mode"):
        InProcessRewardClient(client.scorers, {"brightness": 1.0}, combine_mode="max")


def test_merge_standardises_over_the_whole_batch_and_offsets_errors(client: InProcessRewardClient) -> None:
    """The loop scores a batch in chunks and merges them: a normalising mode standardises over the batch, not
    per chunk, and a chunk's error indices are shifted to the item's place in the batch."""
    normalised = InProcessRewardClient(
        client.scorers, {"brightness": 1.0, "digit": 0.0}, combine_mode="sum-then-normalise"
    )
    images = _images(6)
    parts = [normalised.score(images[:4], ["digit 1"] * 4), normalised.score(images[4:], ["digit 2", "no target"])]
    merged = normalised.merge(parts)
    whole = normalised.score(images, ["digit 1"] * 4 + ["digit 2", "no target"])
    np.testing.assert_allclose(merged.combined, whole.combined)
    np.testing.assert_allclose(merged.combined, standardise(whole.components["brightness"]))
    assert set(merged.errors["digit"]) == set(whole.errors["digit"]) == {5}
    assert merged.instances == ["in-process", "in-process"]
    normalised.close()


def test_failed_share_counts_nan_entries() -> None:
    assert failed_share(np.array([1.0, np.nan, 2.0, np.nan, 0.0])) == 0.4
    assert failed_share(torch.tensor([0.5, float("nan"), 1.0], dtype=torch.float32)) == pytest.approx(1 / 3)
    assert failed_share(np.zeros(4)) == 0.0


def test_the_trainer_names_no_reward_server_and_shared_rewards_needs_only_numpy() -> None:
    """The reward boundary: the trainer reaches servers through the client contract and an installed console
    script, never by importing (or naming) the server package; shared.rewards is usable by both sides."""
    root = Path(__file__).resolve().parents[2]
    naming = [
        str(path.relative_to(root)) for path in (root / "trainer").rglob("*.py") if "reward_server" in path.read_text()
    ]
    assert naming == []
    tree = ast.parse((root / "shared" / "rewards.py").read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported - set(sys.stdlib_module_names) == {"numpy"}
