"""docker-compose.yml and deploy/Dockerfile.reward agree with the real reward server CLI and scorer registry
(the compose file's ``${VAR:-default}`` values read at their defaults, as compose reads them with no .env)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from reward_server.__main__ import GRACEFUL_SHUTDOWN_S, build_parser
from reward_server.scorers import SCORERS

ROOT = Path(__file__).resolve().parents[2]


def _defaults(value):
    """``value`` with every ``${NAME:-default}`` / ``${NAME-default}`` replaced by its default."""
    if isinstance(value, dict):
        return {key: _defaults(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_defaults(item) for item in value]
    if isinstance(value, str):
        return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", value)
    return value


COMPOSE = _defaults(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))
SERVICES = COMPOSE["services"]
CONTAINER_PORT = 8000
DOCKERFILE = (ROOT / "deploy" / "Dockerfile.reward").read_text()


def _server_args(command: list[str]):
    assert command[:3] == ["python", "-m", "reward_server"], command
    return build_parser().parse_args(command[3:])


def test_services_exist() -> None:
    assert {"reward-cpu", "reward-models", "reward-qwenvl"} <= set(SERVICES)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_command_is_accepted_by_the_cli_and_names_registered_scorers(name: str) -> None:
    service = SERVICES[name]
    assert isinstance(service["command"], list), "use the list form so that no shell re-parses arguments"
    args = _server_args(service["command"])
    assert args.host == "0.0.0.0"  # inside the container; the host side is published on loopback
    assert args.port == CONTAINER_PORT and str(args.model_dir) == "/models"
    assert set(args.scorers) <= set(SCORERS), args.scorers
    assert any(volume.endswith(":/models:ro") for volume in service["volumes"])


def test_ports_are_published_on_loopback_each_its_own() -> None:
    host_ports = []
    for service in SERVICES.values():
        (port,) = service["ports"]
        loopback, host_port, container_port = port.split(":")
        assert loopback == "127.0.0.1" and int(container_port) == CONTAINER_PORT, port
        host_ports.append(host_port)
    assert len(set(host_ports)) == len(host_ports), host_ports


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_healthcheck_probes_readyz_on_the_served_port(name: str) -> None:
    check = SERVICES[name]["healthcheck"]
    assert check["test"][0] == "CMD"
    assert f"http://127.0.0.1:{CONTAINER_PORT}/readyz" in " ".join(check["test"])
    assert {"interval", "timeout", "retries", "start_period"} <= set(check)


def test_model_groups_reserve_a_gpu_and_are_opt_in() -> None:
    for name in ("reward-models", "reward-qwenvl"):
        service = SERVICES[name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert service["profiles"] == ["gpu"]
        assert service["build"]["args"]["REQUIREMENTS"] == "requirements-models.txt"
    assert "deploy" not in SERVICES["reward-cpu"] and "profiles" not in SERVICES["reward-cpu"]


def test_services_drain_and_take_the_token_from_the_environment() -> None:
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for service in raw.values():
        assert service["stop_grace_period"]
        assert service["environment"]["REWARD_SERVER_TOKEN"].startswith("${REWARD_SERVER_TOKEN")
        assert service["build"]["dockerfile"] == "deploy/Dockerfile.reward"


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_stop_grace_period_outlasts_the_servers_shutdown(name: str) -> None:
    """Past stop_grace_period docker kills the server: with 60 s, requests still open after the drain were cut
    before uvicorn's own 60 s graceful shutdown ran out."""
    service = SERVICES[name]
    grace = re.fullmatch(r"(\d+)s", service["stop_grace_period"])
    assert grace, f"write stop_grace_period in seconds, e.g. 75s, not {service['stop_grace_period']!r}"
    args = _server_args(service["command"])
    assert int(grace.group(1)) > args.drain_grace_s + GRACEFUL_SHUTDOWN_S


def test_dockerfile_default_command_is_accepted_by_the_cli() -> None:
    command = json.loads(re.search(r"^CMD (\[.*\])$", DOCKERFILE, re.MULTILINE).group(1))
    args = _server_args(command)
    assert f"http://127.0.0.1:{args.port}/readyz" in DOCKERFILE
    assert set(args.scorers) <= set(SCORERS), args.scorers
    assert re.search(r"^USER ", DOCKERFILE, re.MULTILINE), "run as a non-root user"


@pytest.mark.parametrize("name", ["requirements-cpu.txt", "requirements-models.txt"])
def test_image_requirements_are_pinned_as_the_suite_runs_them(name: str) -> None:
    """Every package the images install is pinned to the version installed here (the one the tests ran)."""
    from importlib.metadata import version

    for line in (ROOT / "deploy" / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-r"):
            package, pinned = line.split("==")
            assert version(package).split("+")[0] == pinned, (name, package)
