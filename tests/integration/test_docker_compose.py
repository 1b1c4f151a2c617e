"""``docker compose up`` serves the CPU scorer group for real: built offline (a debootstrap base image and a
host-side wheelhouse), healthy on /readyz, the token required, and ``ocr`` reading rendered text through
the port published on 127.0.0.1. Skips, saying why, where no Docker engine can run (fails in CI instead).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from docker_engine import cpu_project, start_engine
from text_images import render

from shared.imagecodec import encode_image

pytestmark = pytest.mark.slow
SERVICE = "reward-cpu"


@pytest.fixture(scope="module")
def cpu_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The CPU group brought up by compose from a copy of the repository; (its URL, its token)."""
    work = tmp_path_factory.mktemp("compose")
    why = start_engine(work / "dockerd.log")
    if why is not None:
        if os.environ.get("RF_REQUIRE_SYSTEM_DEPS"):
            raise RuntimeError(f"Docker is required here (RF_REQUIRE_SYSTEM_DEPS is set): {why}")
        pytest.skip(why)
    compose, env, project = cpu_project(work)
    token = secrets.token_hex(8)
    env.update(REWARD_CPU_PORT="", REWARD_SERVER_TOKEN=token, REWARD_CPU_SCORERS="ocr,digit")
    command = [*compose, "--project-name", f"rftest{secrets.token_hex(3)}"]

    def run(*args: str, timeout: float = 600) -> str:
        done = subprocess.run([*command, *args], cwd=project, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        assert done.returncode == 0, f"{' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout

    try:
        run("up", "-d", "--build", SERVICE, timeout=900)
        (container,) = run("ps", "-q", SERVICE).split()
        deadline, status = time.monotonic() + 180, ""
        while status != "healthy" and time.monotonic() < deadline:
            time.sleep(2)
            state = subprocess.run(["docker", "inspect", "--format", "{{json .State}}", container],
                                   capture_output=True, text=True, check=True).stdout
            status = json.loads(state).get("Health", {}).get("Status", "")
            assert status != "unhealthy", run("logs", SERVICE)
        assert status == "healthy", f"not healthy within 180 s: {run('logs', SERVICE)}"
        host, port = run("port", SERVICE, "8000").strip().rsplit(":", 1)
        assert host == "127.0.0.1", host  # published on the loopback only
        yield f"http://{host}:{port}", token
    finally:
        subprocess.run([*command, "down", "--timeout", "5"], cwd=project, env=env, capture_output=True,
                       timeout=300, check=False)


def test_compose_serves_ocr_with_a_token(cpu_group: tuple[str, str]) -> None:
    url, token = cpu_group
    item = {"id": "sign", "prompt": 'a sign that says "Fresh Bread"', "image": encode_image(render("Fresh Bread"))}
    body = {"items": [item], "scorers": ["ocr"]}
    refused = httpx.post(f"{url}/score", json=body, trust_env=False, timeout=60)
    assert refused.status_code == 401, refused.text
    scored = httpx.post(f"{url}/score", json=body, headers={"Authorization": f"Bearer {token}"},
                        trust_env=False, timeout=120)
    assert scored.status_code == 200, scored.text
    (result,) = scored.json()["results"]
    ocr = result["scores"]["ocr"]
    assert ocr["ok"] and ocr["score"] == 1.0 and ocr["details"]["recognized"] == "Fresh Bread", ocr
    info = httpx.get(f"{url}/info", headers={"Authorization": f"Bearer {token}"}, trust_env=False).json()
    assert {scorer["name"] for scorer in info["scorers"]} == {"ocr", "digit"}, info
