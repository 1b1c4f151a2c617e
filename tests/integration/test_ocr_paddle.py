"""``ocr_paddle`` for real: ``python -m reward_server --scorers ocr_paddle`` running PaddleOCR 3.x, over HTTP.

PaddleOCR cannot share ``.venv`` (it pins its own numpy and OpenCV), so the server runs under
``.venv-paddle``, which ``make paddle-env`` builds together with the models: PP-OCRv6 small detection and
recognition from the rapidocr wheel, converted to Paddle inference models by tests/paddle/build_models.py
(no PaddleOCR model can be downloaded here). This also shows that the server's ``ocr_paddle`` path needs
no torch: ``.venv-paddle`` has none.

Skipped without ``.venv-paddle``; with RF_REQUIRE_SYSTEM_DEPS set (as in CI) its absence is an error.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image, ImageDraw
from text_images import font, render

from reward_server.scorers.fingerprint import sha256_files
from shared.imagecodec import encode_image
from shared.protocol import InfoResponse, ScoreResponse, ScorerResult
from trainer.rewards import LocalRewardPool

REPO = Path(__file__).resolve().parents[2]
PADDLE_PYTHON = REPO / ".venv-paddle/bin/python"
BUILD_MODELS = REPO / "tests/paddle/build_models.py"
MODEL_DIR = REPO / ".cache/rewardflow/paddleocr-models"  # build_models.py's default
SCORER = "ocr_paddle"

if not PADDLE_PYTHON.exists() and os.environ.get("RF_REQUIRE_SYSTEM_DEPS"):
    raise RuntimeError(f"{PADDLE_PYTHON} is required here (RF_REQUIRE_SYSTEM_DEPS is set): run `make paddle-env`")
pytestmark = pytest.mark.skipif(not PADDLE_PYTHON.exists(), reason=f"{PADDLE_PYTHON} is missing: run `make paddle-env`")


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # Converts the models if `make paddle-env` has not (or its result is stale); a no-op otherwise.
    build = subprocess.run(
        [str(PADDLE_PYTHON), str(BUILD_MODELS), str(MODEL_DIR)], capture_output=True, text=True, check=False
    )
    assert build.returncode == 0, build.stdout + build.stderr
    with LocalRewardPool(
        [SCORER],
        replicas=1,
        python=str(PADDLE_PYTHON),
        log_dir=tmp_path_factory.mktemp("ocr-paddle"),
        extra_args=["--model-dir", str(MODEL_DIR)],
        ready_timeout_s=180,
    ) as pool:
        yield pool.urls[0]


def _score(url: str, items: list[dict]) -> tuple[ScoreResponse, list[ScorerResult]]:
    response = httpx.post(f"{url}/score", json={"items": items}, trust_env=False, timeout=120)
    assert response.status_code == 200, response.text
    body = ScoreResponse.model_validate(response.json())
    return body, [result.scores[SCORER] for result in body.results]


def _item(item_id: str, image: np.ndarray, target: str, mask: np.ndarray | None = None) -> dict:
    item = {"id": item_id, "prompt": f'a shop sign that says "{target}"', "image": encode_image(image)}
    return item if mask is None else {**item, "mask": encode_image(mask)}


def test_info_reports_the_paddleocr_fingerprint(server_url: str) -> None:
    info = InfoResponse.model_validate(httpx.get(f"{server_url}/info", trust_env=False).json())
    (scorer,) = info.scorers
    assert scorer.name == SCORER and info.ready and (scorer.score_min, scorer.score_max) == (0.0, 1.0)
    (paddleocr,) = importlib.metadata.distributions(
        name="paddleocr", path=[str(path) for path in PADDLE_PYTHON.parents[1].glob("lib/python*/site-packages")]
    )
    model_files = sorted(path for part in ("det", "rec") for path in (MODEL_DIR / SCORER / part).iterdir())
    assert scorer.version == (
        f"paddleocr-{paddleocr.version}+PP-OCRv6_small_det+PP-OCRv6_small_rec+{sha256_files(model_files)[:12]}"
    )


def test_exact_misspelt_and_blank(server_url: str) -> None:
    target = "Spring Collection 2024"
    body, (exact, misspelt, blank) = _score(
        server_url,
        [
            _item("exact", render(target), target),
            _item("misspelt", render("Sprng Colection 2024"), target),
            _item("blank", np.full((128, 256, 3), 255, np.uint8), target),
        ],
    )
    assert body.models[SCORER].startswith("paddleocr-3.")
    assert exact.ok and exact.score == 1.0, exact.details
    assert exact.details["recognized"] == target and exact.details["confidence"] > 0.9
    # Two characters deleted of the 20 of "springcollection2024" (case and spaces are not counted).
    assert misspelt.details["recognized"] == "Sprng Colection 2024", misspelt.details
    assert misspelt.score == pytest.approx(1 - 2 / 20)
    assert blank.ok and blank.score == 0.0
    assert blank.details["recognized"] == "" and blank.details["confidence"] is None


def test_mask_reads_only_the_target_among_clutter(server_url: str) -> None:
    target = "Fresh Bread"
    image = Image.new("RGB", (512, 384), "white")
    draw = ImageDraw.Draw(image)
    rng = np.random.default_rng(3)
    for _ in range(12):  # scribbles around the text
        x, y = rng.integers(0, 512), rng.integers(0, 384)
        draw.line([(x, y), (x + rng.integers(-80, 80), y + rng.integers(-80, 80))], fill="gray", width=2)
    draw.text((40, 40), "OPEN 24 HOURS", font=font(32), fill="black")
    draw.text((150, 170), target, font=font(40), fill="black")
    draw.text((290, 320), "since 1998", font=font(28), fill="black")
    mask = np.zeros((384, 512, 1), np.uint8)
    mask[150:240, 120:430] = 255
    _, (masked, unmasked) = _score(
        server_url, [_item("masked", np.asarray(image), target, mask), _item("whole", np.asarray(image), target)]
    )
    assert masked.ok and masked.score == 1.0 and masked.details["recognized"] == target, masked.details
    assert unmasked.details["recognized"] == "OPEN 24 HOURS Fresh Bread since 1998", unmasked.details
    assert unmasked.score == pytest.approx(1 - 20 / 30)  # "open24hoursfreshbreadsince1998": 20 extra characters
