"""The checks every video family's test module shares: the clip size refused as the adapter loads (frames that are
not the VAE's temporal k + 1, sides that are not multiples of its compression times the transformer's patch, and
``model.resolution``), each in one line naming the nearest valid values. The cases derive from the family's
``TinySpec.video_compression``, so Wan, HunyuanVideo 1.5 and LTX-2 get the same ones."""

from __future__ import annotations

import re

import pytest
from tiny_models import tiny, tiny_config

from trainer.models import build_adapter


def video_size_cases(name: str) -> list:
    """(field, value, message pattern) of each size adapter ``name`` must refuse: frames at 2k and 2 for a temporal
    compression k, a height half a multiple above the tiny model's, a width half a multiple, a resolution."""
    spec = tiny(name)
    assert spec.video_compression is not None, f"{name}'s TinySpec declares no video_compression"
    t, s = spec.video_compression
    h = spec.config["height"]
    unset = r"unset it and set model\.height and model\.width"
    frames = r"model\.frames={} must be {}k \+ 1 \(.*\): the nearest are {} and {}$"
    return [
        pytest.param("frames", 2 * t, frames.format(2 * t, t, t + 1, 2 * t + 1), id="frames-2k"),
        pytest.param("frames", 2, frames.format(2, t, 1, t + 1), id="frames-2"),
        pytest.param(
            "height",
            h + s // 2,
            rf"model\.height={h + s // 2} must be a multiple of {s}: the nearest are {h} and {h + s}$",
            id="height",
        ),
        pytest.param(
            "width", s // 2, rf"model\.width={s // 2} must be a multiple of {s}: the nearest are {s}$", id="width"
        ),
        pytest.param(
            "resolution", 32, rf"^model\.resolution=32 does not apply to {re.escape(name)}: {unset}$", id="resolution"
        ),
    ]


def video_size_test(name: str):
    """The size-check test of adapter ``name`` over ``video_size_cases``, for its family's test module to bind to
    a ``test_`` name; it takes that module's ``root`` fixture (where the tiny model is built once)."""

    @pytest.mark.parametrize(("field", "value", "message"), video_size_cases(name))
    def test(field, value, message, root):
        with pytest.raises(ValueError, match=message) as error:
            build_adapter(tiny_config(name, root, **{field: value}), "cpu")
        assert "\n" not in str(error.value)

    test.__doc__ = f"{name} refuses a clip size its VAE and patches do not divide, in one line naming the fix."
    return test
