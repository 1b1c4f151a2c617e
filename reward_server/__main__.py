"""Run one reward server: ``python -m reward_server --scorers digit,brightness --port 8000``.

Besides the registry's scorers, ``--scorers sleep --sleep-ms MS [--sleep-load-s S]`` serves the
benchmark stand-in :class:`reward_server.sleep_scorer.SleepScorer`.

On SIGTERM (or Ctrl-C) the server drains: ``/readyz`` and ``/score`` answer 503 for ``--drain-grace-s``
seconds while in-flight requests finish, then the listener closes, uvicorn waits for open requests and
the process exits with status 0. A second signal exits at once. If a scorer fails to load the process
exits with status 1, or 3 (``EXIT_MODEL_FILES_MISSING``) when it needs ``--model-dir``. With ``--parent-pid``
it also drains when that process is gone (the trainer's own replicas: they outlive no trainer, even one killed
with SIGKILL), and while it lives ignores SIGTERM and SIGUSR1 (a scheduler signals every process of a job: the
trainer still needs its rewards to end its epoch, and then stops them with SIGINT). With ``--fd`` it serves on a
socket its parent bound and passed down (``LocalRewardPool``), so no other process can take the port in between.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

if __name__ == "__main__":  # before uvicorn and the scorers' libraries load: a Ctrl-C then is one line too
    from reward_server import run

    run()

import uvicorn

from reward_server.app import create_app
from reward_server.connections import head_deadline_protocol
from reward_server.scorers import SCORERS, Scorer, build_scorers
from reward_server.scorers.base import ModelFilesMissing
from reward_server.scorers.frames import REDUCTIONS
from reward_server.service import RewardService
from reward_server.settings import ServerSettings
from reward_server.sleep_scorer import SleepScorer
from shared.protocol import EXIT_MODEL_FILES_MISSING

_DEFAULTS = ServerSettings(instance_id="defaults")
_SLEEP = "sleep"
GRACEFUL_SHUTDOWN_S = 60
"""After the drain, how long uvicorn waits for open requests before closing them (deployments must give
the process at least drain grace + this before they kill it)."""


def _available() -> list[str]:
    return [*SCORERS, _SLEEP]


def _scorer_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in _available()]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown or empty scorer list {text!r}; available: {', '.join(_available())}")
    return names


def _build(names: list[str], model_dir: Path | None, sleep_ms: float, sleep_load_s: float) -> dict[str, Scorer]:
    registered = build_scorers([name for name in names if name != _SLEEP], model_dir=model_dir)
    return {name: SleepScorer(sleep_ms, sleep_load_s) if name == _SLEEP else registered[name] for name in names}


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (also used by tests to check deploy files against it)."""
    parser = argparse.ArgumentParser(prog="python -m reward_server", description="Serve reward scorers over HTTP.")
    _add_scorer_arguments(parser)
    _add_listen_arguments(parser)
    _add_request_limits(parser)
    _add_http_arguments(parser)
    _add_batching_arguments(parser)
    return parser


def _add_scorer_arguments(parser: argparse.ArgumentParser) -> None:
    """Which scorers to serve (and the ``sleep`` benchmark stand-in's timings)."""
    parser.add_argument(
        "--list-scorers", action=_ListScorers, nargs=0, help="print the registered scorer names, one per line, and exit"
    )
    parser.add_argument(
        "--scorers",
        type=_scorer_list,
        required=True,
        help=f"comma-separated names from: {', '.join(_available())}",
    )
    parser.add_argument(
        "--sleep-ms",
        type=float,
        default=0.0,
        help="for the 'sleep' benchmark scorer: how long it holds each batch, in ms",
    )
    parser.add_argument(
        "--sleep-load-s",
        type=float,
        default=0.0,
        help="for the 'sleep' benchmark scorer: how long its load takes, in s (as a model's would)",
    )


def _add_listen_arguments(parser: argparse.ArgumentParser) -> None:
    """Where to listen, who may call, where models load from and how responses name the instance."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port, 0-65535 (0: any free one)")
    parser.add_argument(
        "--fd",
        type=int,
        default=None,
        help="serve on this inherited, already bound TCP socket instead of binding --host:--port "
        "(which then only name it in the log)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("REWARD_SERVER_TOKEN"),
        help="require 'Authorization: Bearer TOKEN' (default: $REWARD_SERVER_TOKEN; prefer it to the flag, "
        "which other users can see in the process list)",
    )
    parser.add_argument("--model-dir", type=Path, default=None, help="directory that model-based scorers load from")
    parser.add_argument("--instance-id", default=None, help="reported in responses (default: host-pid-random)")


def _add_request_limits(parser: argparse.ArgumentParser) -> None:
    """What one request, and all requests at once, may hold: items, pixels, body bytes and rate."""
    parser.add_argument("--max-items", type=int, default=_DEFAULTS.max_items)
    parser.add_argument("--max-image-side", type=int, default=_DEFAULTS.max_image_side)
    parser.add_argument("--max-frames", type=int, default=_DEFAULTS.max_frames, help="frames per video item")
    parser.add_argument(
        "--video-frames",
        type=int,
        default=_DEFAULTS.video_frames,
        help="frames an image scorer scores per video item, evenly spaced, first and last included",
    )
    parser.add_argument(
        "--video-reduce",
        choices=REDUCTIONS,
        default=_DEFAULTS.video_reduce,
        help="how an image scorer's frame scores become a video item's score",
    )
    parser.add_argument(
        "--max-pixels-per-request",
        type=int,
        default=_DEFAULTS.max_pixels_per_request,
        help="height x width summed over a request's images and masks (bounds the memory it decodes to)",
    )
    parser.add_argument(
        "--max-pixels-in-flight",
        type=int,
        default=None,
        help="pixels all requests being decoded and scored hold at once; more waits (default: twice "
        "--max-pixels-per-request)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes)
    parser.add_argument(
        "--max-values",
        type=int,
        default=_DEFAULTS.max_values,
        help="values (array and map entries) in a request body (bounds the memory a parsed body takes)",
    )
    parser.add_argument(
        "--body-timeout-s",
        type=float,
        default=_DEFAULTS.body_timeout_s,
        help="a client that sends no part of its body for this long gets a 408",
    )
    parser.add_argument(
        "--min-body-rate",
        type=int,
        default=_DEFAULTS.min_body_rate,
        help="bytes/s a body must average once it has taken --body-timeout-s, else a 408",
    )
    parser.add_argument(
        "--max-body-bytes-in-flight",
        type=int,
        default=None,
        help="bytes of all bodies being received at once; past it a 429 (default: 4 x --max-body-bytes)",
    )


def _add_http_arguments(parser: argparse.ArgumentParser) -> None:
    """uvicorn's HTTP implementation and the deadline and cap on each request's head."""
    parser.add_argument(
        "--http",
        choices=("auto", "httptools", "h11"),
        default="auto",
        help="uvicorn's HTTP implementation (auto: httptools where installed, else h11)",
    )
    parser.add_argument(
        "--head-timeout-s",
        type=float,
        default=_DEFAULTS.head_timeout_s,
        help="a connection whose request line and headers have not all come this long after it "
        "opened (or after a later request's first byte) is closed",
    )
    parser.add_argument(
        "--max-head-bytes",
        type=int,
        default=_DEFAULTS.max_head_bytes,
        help="a request whose request line and headers take more gets a 431",
    )


def _add_batching_arguments(parser: argparse.ArgumentParser) -> None:
    """Batching, queueing, the drain on a signal, logging, and the parent process whose end stops the server."""
    parser.add_argument("--max-batch-size", type=int, default=_DEFAULTS.max_batch_size)
    parser.add_argument("--batch-wait-ms", type=float, default=_DEFAULTS.batch_wait_ms)
    parser.add_argument("--max-queue-items", type=int, default=_DEFAULTS.max_queue_items)
    parser.add_argument("--drain-grace-s", type=float, default=_DEFAULTS.drain_grace_s)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=0,
        help="drain and exit once this process (the one that started the server) is gone",
    )


class _DrainingServer(uvicorn.Server):
    """uvicorn server whose first SIGTERM/SIGINT starts a drain instead of closing the listener at once."""

    def __init__(
        self, config: uvicorn.Config, service: RewardService, drain_grace_s: float, parent_pid: int = 0
    ) -> None:
        super().__init__(config)
        self.service = service
        self.drain_grace_s = drain_grace_s
        self.drain_deadline: float | None = None
        self.exit_code = 0
        self.parent_pid = parent_pid

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.parent_pid and os.getppid() == self.parent_pid:
            return  # a trainer's own replica: the trainer stops it (SIGINT) once its own SIGTERM has been handled
        if self.drain_deadline is not None:  # second signal: stop now
            self.should_exit = True
            self.force_exit = True
            return
        self.drain_deadline = time.monotonic() + self.drain_grace_s
        self.service.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
            self.should_exit = True
        # uvicorn ticks every 0.1 s: once a second, a parent that is gone (we were re-parented) starts the drain
        if self.parent_pid and counter % 10 == 0 and self.drain_deadline is None and os.getppid() != self.parent_pid:
            self.handle_exit(0, None)
        return await super().on_tick(counter)

    def fail(self, exc: BaseException) -> None:
        """Exit with status 1 (a scorer failed to load), or 3 when it needs ``--model-dir``."""
        self.exit_code = EXIT_MODEL_FILES_MISSING if isinstance(exc, ModelFilesMissing) else 1
        self.should_exit = True


def _port(text: str) -> int:
    """A TCP port number (the OS took 99999 modulo 65536 and the server printed the number it was given)."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


class _ListScorers(argparse.Action):
    """``--list-scorers``: the registry's names (the trainer's pre-flight reads them without importing us)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print("\n".join(_available()))
        parser.exit()


def _inherited(fd: int) -> socket.socket:
    """The bound TCP socket on file descriptor ``fd`` (uvicorn's own ``fd`` option takes it for a Unix socket)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise SystemExit(f"--fd {fd}: not an open socket ({exc.strerror})") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        raise SystemExit(f"--fd {fd}: not a TCP socket")
    return sock


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = ServerSettings(
            token=args.token or None,
            max_items=args.max_items,
            max_image_side=args.max_image_side,
            max_frames=args.max_frames,
            video_frames=args.video_frames,
            video_reduce=args.video_reduce,
            max_pixels_per_request=args.max_pixels_per_request,
            max_pixels_in_flight=args.max_pixels_in_flight,
            max_body_bytes=args.max_body_bytes,
            max_values=args.max_values,
            body_timeout_s=args.body_timeout_s,
            min_body_rate=args.min_body_rate,
            max_body_bytes_in_flight=args.max_body_bytes_in_flight,
            head_timeout_s=args.head_timeout_s,
            max_head_bytes=args.max_head_bytes,
            max_batch_size=args.max_batch_size,
            batch_wait_ms=args.batch_wait_ms,
            max_queue_items=args.max_queue_items,
            drain_grace_s=args.drain_grace_s,
            **({"instance_id": args.instance_id} if args.instance_id else {}),
        )
    except ValueError as exc:
        build_parser().error(str(exc))
    sockets = None if args.fd is None else [_inherited(args.fd)]  # checked before any scorer loads
    if args.parent_pid:  # a trainer's own replica: the scheduler's signals to the job are the trainer's to act on
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # until uvicorn's handler (handle_exit) takes it over
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    scorers = _build(args.scorers, args.model_dir, args.sleep_ms, args.sleep_load_s)

    def exit_on_load_failure(exc: BaseException) -> None:
        server.fail(exc)  # bound below, before uvicorn starts the app

    app = create_app(scorers, settings, on_load_failure=exit_on_load_failure)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=head_deadline_protocol(settings.head_timeout_s, args.http, settings.max_head_bytes),
        access_log=args.log_level == "debug",
    )
    server = _DrainingServer(config, app.state.service, settings.drain_grace_s, args.parent_pid)
    server.run(sockets=sockets)
    return server.exit_code
