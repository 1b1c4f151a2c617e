"""A Docker engine, an offline base image and a wheelhouse for the compose tests (no Docker Hub here).

The engine is the one running, else a ``dockerd`` this process starts (root only), at nice 10: its image builds
(about 160 CPU-seconds from scratch) and containers then yield to the tests CI runs beside them. The base image is
deploy/offline_base.sh's debootstrap of Debian; the wheels are pip-downloaded on the host once and cached,
so images build with ``PIP_NO_INDEX=1``. ``start_engine()`` says why an engine cannot be had here. CI prepares
all of it in the background (``python3 tests/docker_engine.py --install``) under ``PREP_LOCK``, which the compose
tests wait for.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_IMAGE = "rewardflow-base:bookworm"
WHEEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rewardflow" / "docker-wheels"
PREP_LOCK = WHEEL_CACHE.parent / "docker-prep.lock"
"""Held while ``__main__`` prepares; ``prepared()`` waits for it."""
CONTEXT_FILES = ("docker-compose.yml", ".dockerignore", "deploy", "shared", "scoring", "reward_server")


@contextlib.contextmanager
def prepared() -> Iterator[None]:
    """Hold PREP_LOCK: wait for a preparation running in the background, and keep another from starting."""
    PREP_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with PREP_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # unlocked as the file closes


def _run(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


def _engine_up() -> bool:
    return shutil.which("docker") is not None and _run("docker", "info", timeout=20).returncode == 0


def start_engine(log: Path) -> str | None:
    """Make sure an engine answers; None when it does, else why it cannot here."""
    if shutil.which("docker") is None:
        return "no docker client: apt-get install docker.io docker-compose debootstrap (make docker-deps)"
    if _engine_up():
        return None
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        return "no Docker engine runs, and dockerd cannot be started here (needs root and the docker.io package)"
    with log.open("ab") as out:  # at nice 10, with its builds and containers: CI builds the images beside the tests
        subprocess.Popen(
            ["nice", "-n", str(max(0, 10 - os.nice(0))), "dockerd"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _engine_up():
            return None
        time.sleep(1)
    return f"dockerd did not come up within 60 s: see {log}"


def compose_command() -> list[str] | None:
    """Compose v2 (``docker compose``) where installed, else v1 (``docker-compose``, Debian's package)."""
    if _run("docker", "compose", "version").returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def base_image() -> str:
    """The offline base image, built by deploy/offline_base.sh on first use (about a minute)."""
    if _run("docker", "image", "inspect", BASE_IMAGE).returncode != 0:
        built = _run(str(REPO / "deploy" / "offline_base.sh"), BASE_IMAGE, timeout=900)
        if built.returncode != 0:
            raise RuntimeError(f"deploy/offline_base.sh failed: {built.stdout}{built.stderr}")
    return BASE_IMAGE


def wheelhouse(requirements: str) -> Path:
    """deploy/<requirements>'s wheels for this Python, downloaded once into a cache (PyPI is reachable)."""
    folder = WHEEL_CACHE / Path(requirements).stem
    stamp = folder / ".complete"
    wanted = (REPO / "deploy" / requirements).read_text()
    if not stamp.exists() or stamp.read_text() != wanted:
        folder.mkdir(parents=True, exist_ok=True)
        got = _run(
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "-d",
            str(folder),
            "-r",
            str(REPO / "deploy" / requirements),
            timeout=900,
            cwd=REPO / "deploy",
        )
        if got.returncode != 0:
            raise RuntimeError(f"pip download failed: {got.stderr}")
        stamp.write_text(wanted)
    return folder


def build_context(target: Path, wheels: Path) -> Path:
    """A copy of what the images are built from, with ``wheels`` linked into deploy/wheels/."""
    target.mkdir(parents=True, exist_ok=True)
    for name in CONTEXT_FILES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.whl"))
        else:
            shutil.copy2(source, target / name)
    for wheel in wheels.glob("*.whl"):
        try:
            os.link(wheel, target / "deploy" / "wheels" / wheel.name)
        except OSError:  # another file system
            shutil.copy2(wheel, target / "deploy" / "wheels" / wheel.name)
    return target


def compose_project(work: Path) -> tuple[list[str], dict[str, str], Path]:
    """The compose command, environment and build context for images built offline from ``work``, with the
    wheels of deploy/requirements-models.txt (with the CPU torch wheel: a CPU model image). Those include the CPU
    image's, so both images build from equal contexts on one base: the model image reuses the CPU image's layers."""
    compose = compose_command()
    if compose is None:
        raise RuntimeError("no compose: apt-get install docker-compose (or Docker's compose plugin)")
    wheels = wheelhouse("requirements-models.txt")
    torch_wheels = [wheel.name for wheel in wheels.glob("torch-*.whl")]
    assert all("+cpu" in name for name in torch_wheels), f"a CUDA torch wheel in {wheels}: {torch_wheels}"
    project = build_context(work / "project", wheels)
    base = base_image()
    env = {**os.environ, "REWARD_IMAGE_BASE": base, "REWARD_MODELS_BASE": base, "PIP_NO_INDEX": "1"}
    return [*compose, "--project-directory", str(project), "-f", str(project / "docker-compose.yml")], env, project


if __name__ == "__main__":
    # CI starts this in the background while it installs: Docker's packages (--install: make docker-deps), the
    # engine, the base image, the wheels and the CPU images' layers are then ready (cached) for the compose tests.
    import tempfile

    with prepared(), tempfile.TemporaryDirectory() as scratch:
        if "--install" in sys.argv[1:]:
            subprocess.run(["make", "-C", str(REPO), "docker-deps"], check=False)
        why = start_engine(Path(scratch) / "dockerd.log")
        if why is not None:
            sys.exit(f"docker_engine: {why}")
        command, env, project = compose_project(Path(scratch) / "project")
        for service in ("reward-cpu", "reward-models"):  # the second reuses the first one's layers
            built = subprocess.run([*command, "--profile", "gpu", "build", service], cwd=project, env=env, check=False)
            if built.returncode != 0:
                sys.exit(built.returncode)
