"""The pre-flight check of a run's reward servers, before anything is built or warmed up: every configured URL
answers ``/info``, serves every weighted and alarm scorer and takes the run's requests within its limits (a job's
own local pool: every scorer is one a reward server has; its limits are checked once it is up, still before the
warm-up). A problem is one line naming the URL, what is missing and the setting or command that fixes it."""

from __future__ import annotations

import difflib
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError

from shared.protocol import InfoResponse, Limits
from trainer.rewards.launcher import SERVER_SCRIPT, RewardPoolError, server_module
from trainer.rewards.wire import detail


class PreflightError(ValueError):
    """The run cannot get its rewards; raised alike on every rank (rank 0 alone reports it)."""

    every_rank = True


def server_command(url: str, scorers: Iterable[str]) -> str:
    """The command that serves ``scorers`` at ``url``."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)
    return f"{SERVER_SCRIPT} --scorers {','.join(scorers)} --host {host} --port {port}"


@dataclass(frozen=True)
class Requests:
    """The largest /score request a run sends: ``items`` images (``reward.batch_size``) of ``side`` px a side
    (``model.resolution``; 0: the model's own, not known before it loads) in ``wire_format``, each a video of
    ``frames`` frames where ``frames`` > 1 (``model.frames``); ``own``: to the job's own replicas (the fix is then a
    setting of the run, not a server flag)."""

    items: int
    side: int = 0
    wire_format: str = "msgpack"
    own: bool = False
    frames: int = 1

    def beyond(self, url: str, limits: Limits) -> str | None:
        """Why a server with ``limits`` refuses (HTTP 413) these requests, or None."""
        fits, frame_pixels = None, self.frames * self.side**2  # an item's pixels, every frame counted
        if self.items > limits.max_items:
            got, fits, flag = f"{self.items} items", limits.max_items, f"--max-items {self.items}"
        elif self.frames > 1 and limits.max_frames is not None and self.frames > limits.max_frames:
            return f"videos of {self.frames} frames are more than reward server {url} takes ({limits.max_frames}): " + (
                "lower model.frames" if self.own else f"restart it with --max-frames {self.frames}"
            )
        elif self.side and self.side > limits.max_image_side:
            return (
                f"model.resolution={self.side} is above the largest image side reward server {url} takes "
                f"({limits.max_image_side}): "
                + ("lower model.resolution" if self.own else f"restart it with --max-image-side {self.side}")
            )
        elif self.side and limits.max_pixels_per_request and self.items * frame_pixels > limits.max_pixels_per_request:
            got, flag = f"{self.items * frame_pixels} pixels", f"--max-pixels-per-request {self.items * frame_pixels}"
            fits = limits.max_pixels_per_request // frame_pixels
        elif self.side and self.wire_format == "msgpack" and self.items * frame_pixels * 3 > limits.max_body_bytes:
            got, flag = f"{self.items * frame_pixels * 3} bytes", f"--max-body-bytes {self.items * frame_pixels * 3}"
            fits = limits.max_body_bytes // (3 * frame_pixels)
        if fits is None:
            return None
        return (
            f"reward.batch_size={self.items} makes requests of {got}, more than reward server {url} takes in one "
            f"(HTTP 413): set reward.batch_size={max(fits, 1)} or less"
            + ("" if self.own else f", or restart the server with {flag}")
        )


def check_reward_urls(
    urls: Sequence[str],
    scorers: Mapping[str, str],
    token: str | None,
    requests: Requests | None = None,
    timeout_s: float = 5.0,
) -> str | None:
    """Why the servers at ``urls`` cannot score ``scorers`` (name -> the config field that names it: the fix
    says where), or take ``requests``: the first problem found, or None. Without ``urls`` the job starts its
    own servers: then every scorer must be registered."""
    if not urls:
        return _unknown_scorers(scorers)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(timeout=httpx.Timeout(timeout_s), trust_env=False) as client:
        for url in (u.rstrip("/") for u in urls):
            problem = _check_one(client, url, scorers, headers, requests)
            if problem is not None:
                return problem
    return None


def _check_one(
    client: httpx.Client, url: str, scorers: Mapping[str, str], headers: dict[str, str], requests: Requests | None
) -> str | None:
    try:
        response = client.get(f"{url}/info", headers=headers)
    except httpx.TransportError as exc:
        reason = str(exc) or type(exc).__name__
        return (
            f"reward server {url} is unreachable ({reason}): start it with `{server_command(url, scorers)}`, "
            "or leave reward.urls empty and the job starts its own"
        )
    if response.status_code == 401:
        return (
            f"reward server {url} refused the bearer token (HTTP 401, {detail(response)}): export "
            "REWARD_SERVER_TOKEN=<the token the server was started with> before the job, or pass reward.token"
        )
    if response.status_code != 200:
        return (
            f"reward server {url}/info answered HTTP {response.status_code} ({detail(response)[:200]}): is "
            f"{url} a rewardflow reward server? Start one with `{server_command(url, scorers)}`"
        )
    try:
        info = InfoResponse.model_validate_json(response.content)
    except ValidationError:
        return (
            f"{url}/info is not a rewardflow reward server's answer: point reward.urls at servers started "
            f"with `{server_command(url, scorers)}`"
        )
    served = [s.name for s in info.scorers]
    missing = [name for name in scorers if name not in served]
    if missing:
        return (
            f"reward server {url} does not serve {', '.join(missing)} (it serves {', '.join(served) or 'nothing'}):"
            f" restart it with `{server_command(url, [*served, *missing])}`, or take "
            f"{', '.join(missing)} out of {' and '.join(sorted({scorers[name] for name in missing}))}"
        )
    return requests.beyond(url, info.limits) if requests is not None else None


def _unknown_scorers(scorers: Mapping[str, str]) -> str | None:
    """A local pool's servers would exit at start-up on a scorer name they do not know: the installed server's
    ``--list-scorers`` names the ones it has."""
    try:
        listed = subprocess.run(
            [sys.executable, "-m", server_module(), "--list-scorers"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except (RewardPoolError, subprocess.TimeoutExpired):  # the pool's own start reports a missing server
        return None
    known = listed.stdout.split()
    if listed.returncode != 0 or not known:
        return None
    for name in scorers:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            return (
                f"{scorers[name]} names scorer {name!r}, which no reward server has"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f": use one of {', '.join(known)}"
            )
    return None
