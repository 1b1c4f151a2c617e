"""``geneval`` through a real reward server (``python -m reward_server`` on loopback) on tiny random models:
``/info`` lists it with its fingerprint and range, ``POST /score`` returns strict and partial scores."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from fixtures_geneval import build_tiny_geneval
from servers import reward_server_process

from shared.imagecodec import encode_image

ROWS = [
    {
        "tag": "colors",
        "include": [{"class": "cup", "count": 1, "color": "purple"}],
        "prompt": "a photo of a purple cup",
    },
    {
        "tag": "counting",
        "include": [{"class": "wine glass", "count": 2}],
        "exclude": [{"class": "wine glass", "count": 3}],
        "prompt": "a photo of two wine glasses",
    },
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = build_tiny_geneval(tmp_path_factory.mktemp("geneval-server-models"), favour="cup")
    with reward_server_process("geneval,geneval_partial", model_dir, timeout_s=120) as url:
        yield url


def test_post_score_with_geneval(server: str) -> None:
    rng = np.random.default_rng(0)
    items = [
        {
            "id": f"item-{i}",
            "prompt": row["prompt"],
            "image": encode_image(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), "png"),
            "metadata": {k: v for k, v in row.items() if k != "prompt"},
        }
        for i, row in enumerate(ROWS)
    ]
    items.append({"id": "no-spec", "prompt": "a cup", "image": items[0]["image"]})
    with httpx.Client(base_url=server, trust_env=False, timeout=60) as client:
        info = client.get("/info").json()
        response = client.post("/score", json={"request_id": "geneval-1", "items": items})
    assert response.status_code == 200, response.text
    listed = {entry["name"]: entry for entry in info["scorers"]}
    assert {"geneval", "geneval_partial"} <= set(listed)
    assert listed["geneval"]["version"].startswith("geneval+mask2former-swin+clip-32+")
    assert (listed["geneval"]["score_min"], listed["geneval"]["score_max"]) == (0.0, 1.0)
    body = response.json()
    results = {result["id"]: result for result in body["results"]}
    for i, row in enumerate(ROWS):
        strict, partial = results[f"item-{i}"]["scores"]["geneval"], results[f"item-{i}"]["scores"]["geneval_partial"]
        assert strict["ok"] and partial["ok"], (strict, partial)
        assert strict["score"] in (0.0, 1.0) and 0.0 <= partial["score"] <= 1.0
        assert strict["details"]["partial"] == partial["score"] and strict["details"]["tag"] == row["tag"]
        assert [check["check"] for check in strict["details"]["checks"]][0] == "count"
    assert results["item-0"]["scores"]["geneval"]["details"]["detected"]["cup"]  # the rigged detector sees cups
    missing = results["no-spec"]["scores"]["geneval"]
    assert not missing["ok"] and missing["score"] is None and missing["error"]["code"] == "PARSE"
