"""Shared test setup: few threads (the machine is shared), and fixtures for tiny real models."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("RF_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random tiny SD3 model saved with save_pretrained, loaded back by tests through the adapter."""
    from trainer.models.tiny import build_tiny_sd3

    return str(build_tiny_sd3(tmp_path_factory.mktemp("models") / "tiny-sd3"))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, saying why, where CUDA is missing (they are deselected by default)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
