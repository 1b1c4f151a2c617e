"""docker-compose.yml and deploy/Dockerfile.reward agree with the real reward server CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from reward_server.__main__ import GRACEFUL_SHUTDOWN_S, build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _server_args(command: list[str]) -> list[str]:
    assert command[:3] == ["python", "-m", "reward_server"], command
    return command[3:]


def test_services_exist() -> None:
    assert {"reward-basic", "reward-gpu"} <= set(SERVICES)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_command_is_accepted_by_the_cli(name: str) -> None:
    service = SERVICES[name]
    assert isinstance(service["command"], list), "use the list form so that no shell re-parses arguments"
    args = build_parser().parse_args(_server_args(service["command"]))
    assert args.host == "0.0.0.0"  # inside the container; the host side is published on loopback
    assert str(args.model_dir) == "/models"
    assert any(volume.endswith(":/models:ro") for volume in service["volumes"])


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_ports_are_published_on_loopback_and_match_the_command(name: str) -> None:
    service = SERVICES[name]
    args = build_parser().parse_args(_server_args(service["command"]))
    assert service["ports"] == [f"127.0.0.1:{args.port}:{args.port}"]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_healthcheck_probes_readyz_on_the_served_port(name: str) -> None:
    service = SERVICES[name]
    args = build_parser().parse_args(_server_args(service["command"]))
    check = service["healthcheck"]
    assert check["test"][0] == "CMD"
    assert f"http://127.0.0.1:{args.port}/readyz" in " ".join(check["test"])
    assert {"interval", "timeout", "retries", "start_period"} <= set(check)


def test_gpu_group_reserves_a_gpu_and_is_opt_in() -> None:
    service = SERVICES["reward-gpu"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert service["profiles"] == ["gpu"]
    assert "deploy" not in SERVICES["reward-basic"]


def test_services_drain_and_take_the_token_from_the_environment() -> None:
    for service in SERVICES.values():
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
    args = build_parser().parse_args(_server_args(service["command"]))
    assert int(grace.group(1)) > args.drain_grace_s + GRACEFUL_SHUTDOWN_S


def test_dockerfile_default_command_is_accepted_by_the_cli() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile.reward").read_text()
    command = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, re.MULTILINE).group(1))
    args = build_parser().parse_args(_server_args(command))
    assert f"http://127.0.0.1:{args.port}/readyz" in dockerfile
    assert re.search(r"^USER ", dockerfile, re.MULTILINE), "run as a non-root user"
