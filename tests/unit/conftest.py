"""Session fixtures of tiny random models (built by tests/fixtures_models.py) for the scorer tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures_models import build_conformance_model_dir, build_tiny_qwen_vl


@pytest.fixture(scope="session")
def tiny_qwenvl_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<model_dir>/qwenvl``: a tiny random Qwen2.5-VL."""
    model_dir = tmp_path_factory.mktemp("qwenvl-models")
    build_tiny_qwen_vl(model_dir / "qwenvl", variant="qwen2_5_vl")
    return model_dir


@pytest.fixture(scope="session")
def conformance_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_conformance_model_dir(tmp_path_factory.mktemp("conformance-models"))
