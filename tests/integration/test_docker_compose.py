"""The reward images for real, built offline (a debootstrap base image and a host-side wheelhouse):
``docker compose up`` brings the CPU group up healthy, the token required, and ``ocr`` reads rendered text
through the port published on 127.0.0.1; the model image, with tiny random models mounted read-only at
/models, scores as the same scorers do on the host. Skips, saying why, where no Docker engine can run (CI
installs one with `make docker-deps` and starts it as root).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from docker_engine import compose_project, prepared, start_engine
from fixtures_models import CONFORMANCE_METADATA, build_conformance_model_dir
from text_images import render

from shared.imagecodec import encode_image, encode_video
from trainer.rewards import LocalRewardPool

VIDEO_SCORERS = {"temporal_consistency"}  # they score video items only

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("docker")
    with prepared():  # CI's background preparation first, if it is still running
        why = start_engine(work / "dockerd.log")
    if why is not None:  # also in CI: a sandbox without the privileges dockerd needs says so and goes on
        pytest.skip(f"no Docker engine: {why}")
    return work


def _runner(command: list[str], env: dict[str, str], project: Path) -> Callable[..., str]:
    def run(*args: str, timeout: float = 600) -> str:
        done = subprocess.run(
            [*command, *args], cwd=project, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        assert done.returncode == 0, f"{' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout

    return run


def _wait_healthy(container: str, logs: Callable[[], str], timeout: float = 240) -> None:
    deadline, status = time.monotonic() + timeout, ""
    while status != "healthy" and time.monotonic() < deadline:
        time.sleep(2)
        state = subprocess.run(
            ["docker", "inspect", "--format", "{{json .State}}", container], capture_output=True, text=True, check=True
        ).stdout
        status = json.loads(state).get("Health", {}).get("Status", "")
        assert status != "unhealthy", logs()
    assert status == "healthy", f"not healthy within {timeout} s: {logs()}"


@pytest.fixture(scope="module")
def cpu_group(engine: Path) -> Iterator[tuple[str, str]]:
    """The CPU group brought up by compose from a copy of the repository; (its URL, its token)."""
    compose, env, project = compose_project(engine / "cpu")
    token = secrets.token_hex(8)
    env.update(REWARD_CPU_PORT="", REWARD_SERVER_TOKEN=token, REWARD_CPU_SCORERS="ocr,digit")
    run = _runner([*compose, "--project-name", f"rftest{secrets.token_hex(3)}"], env, project)
    try:
        run("up", "-d", "--build", "reward-cpu", timeout=900)
        (container,) = run("ps", "-q", "reward-cpu").split()
        _wait_healthy(container, lambda: run("logs", "reward-cpu"))
        host, port = run("port", "reward-cpu", "8000").strip().rsplit(":", 1)
        assert host == "127.0.0.1", host  # published on the loopback only
        yield f"http://{host}:{port}", token
    finally:
        run("down", "--timeout", "5", timeout=300)


def test_compose_serves_ocr_with_a_token(cpu_group: tuple[str, str]) -> None:
    url, token = cpu_group
    item = {"id": "sign", "prompt": 'a sign that says "Fresh Bread"', "image": encode_image(render("Fresh Bread"))}
    body = {"items": [item], "scorers": ["ocr"]}
    refused = httpx.post(f"{url}/score", json=body, trust_env=False, timeout=60)
    assert refused.status_code == 401, refused.text
    scored = httpx.post(
        f"{url}/score", json=body, headers={"Authorization": f"Bearer {token}"}, trust_env=False, timeout=120
    )
    assert scored.status_code == 200, scored.text
    (result,) = scored.json()["results"]
    ocr = result["scores"]["ocr"]
    assert ocr["ok"] and ocr["score"] == 1.0 and ocr["details"]["recognized"] == "Fresh Bread", ocr
    info = httpx.get(f"{url}/info", headers={"Authorization": f"Bearer {token}"}, trust_env=False).json()
    assert {scorer["name"] for scorer in info["scorers"]} == {"ocr", "digit"}, info


def test_model_image_scores_mounted_tiny_models_as_the_host_does(engine: Path) -> None:
    """compose builds the GPU groups' image (here on the CPU torch wheel); it serves the default scorers of
    both model services from tiny random models mounted read-only, with the same scores as a host server."""
    compose, env, project = compose_project(engine / "models")
    run = _runner([*compose, "--profile", "gpu"], env, project)
    run("build", "reward-models", timeout=1200)
    services = yaml.safe_load(run("config"))["services"]
    command = services["reward-models"]["command"]
    scorers = command[command.index("--scorers") + 1].split(",")
    scorers += services["reward-qwenvl"]["command"][-1].split(",")
    command[command.index("--scorers") + 1] = ",".join(scorers)
    models = build_conformance_model_dir(engine / "models" / "weights")
    subprocess.run(["chmod", "-R", "a+rX", str(models)], check=True)  # the image runs as an unprivileged user

    rng = np.random.default_rng(0)
    items = [
        {
            "id": f"i{n}",
            "prompt": "a photo of a bowl",
            "image": encode_image(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)),
            "metadata": {**CONFORMANCE_METADATA.get("geneval", {})},
        }
        for n in range(2)
    ]
    clip = rng.integers(0, 256, (3, 64, 64, 3), dtype=np.uint8)
    items.append({**items[0], "id": "video", "image": None, "video": encode_video(clip, 16)})
    with LocalRewardPool(
        scorers,
        replicas=1,
        log_dir=engine / "host-server",
        extra_args=["--model-dir", str(models)],
        ready_timeout_s=300,
    ) as pool:
        host = httpx.post(f"{pool.urls[0]}/score", json={"items": items}, trust_env=False, timeout=300)
    assert host.status_code == 200, host.text

    container = subprocess.run(
        [
            "docker",
            "run",
            "-d",
            "--rm",
            "-p",
            "127.0.0.1::8000",
            "-v",
            f"{models}:/models:ro",
            "rewardflow-reward-models:latest",
            *command,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        _wait_healthy(
            container,
            lambda: subprocess.run(["docker", "logs", container], capture_output=True, text=True).stderr[-3000:],
        )
        port = (
            subprocess.run(["docker", "port", container, "8000"], capture_output=True, text=True, check=True)
            .stdout.split()[0]
            .rsplit(":", 1)[1]
        )
        served = httpx.post(f"http://127.0.0.1:{port}/score", json={"items": items}, trust_env=False, timeout=300)
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True, check=False)
    assert served.status_code == 200, served.text
    for got, expected in zip(served.json()["results"], host.json()["results"], strict=True):
        assert set(got["scores"]) == set(scorers)
        for name in scorers:
            a, b = got["scores"][name], expected["scores"][name]
            if name in VIDEO_SCORERS and got["id"] != "video":  # an image to a video scorer: BAD_INPUT on both
                assert a["error"]["code"] == b["error"]["code"] == "BAD_INPUT", (name, a, b)
                continue
            assert a["ok"] and b["ok"], (name, a, b)
            assert a["score"] == pytest.approx(b["score"], abs=1e-5), (name, a["score"], b["score"])
