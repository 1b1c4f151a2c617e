"""Start a local pool of reward server processes for a run that has no reward URLs configured.

``LocalRewardPool`` runs reward server replicas on free loopback ports, waits until each answers ``/readyz``,
and stops them (SIGINT, then SIGKILL after a grace period) on exit::

    with LocalRewardPool(["digit"], replicas=2) as pool:
        client = HttpRewardClient(pool.urls, {"digit": 1.0})

Each port is bound here and the bound socket passed to its replica (``--fd``): no other process can take it
between the choice and the replica's start. ``launch()`` then ``wait_ready()`` let the caller build its model
while the replicas load theirs.

Failure drills (tests, benchmarks): ``pool.kill(i)`` sends a signal to replica ``i`` and
``pool.restart(i)`` starts it again on the same port (instance id ``local-<i>-<port>-r<n>`` for the
n-th restart). ``pool.supervise()`` restarts replicas that exit by themselves (a run's own replicas).

The server is found by its console script, ``rewardflow-reward-server`` (pyproject.toml): each replica runs
that script's module with ``python -m``, so that any interpreter with the package installed can serve.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import httpx

_REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_SCRIPT = "rewardflow-reward-server"
logger = logging.getLogger("rewardflow.rewards")


class RewardPoolError(RuntimeError):
    """A replica of the local pool died (``exit_status``: its status) or did not become ready in time (None)."""

    def __init__(self, message: str, exit_status: int | None = None) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def bound_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: a free port), not yet listening: until its replica listens,
    connections are refused rather than left waiting."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn sets it on the sockets it binds: the connections a killed replica accepted inherit it, and
        # without it they (in FIN_WAIT or TIME_WAIT) would keep its restart from binding the port again.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def server_module() -> str:
    """The module that runs one reward server, from the installed :data:`SERVER_SCRIPT` console script."""
    found = importlib.metadata.entry_points(group="console_scripts", name=SERVER_SCRIPT)
    if not found:
        raise RewardPoolError(
            f"no {SERVER_SCRIPT} console script is installed: install the package "
            "(pip install -e . in the checkout), or set reward.urls to running servers"
        )
    return next(iter(found)).module


def _tail(path: Path, num_lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


class LocalRewardPool:
    """A context manager owning ``replicas`` reward server subprocesses.

    Args:
        scorers: scorer names passed to ``--scorers``.
        replicas: number of server processes.
        host: bind address of every replica.
        python: interpreter that runs the server module (``python -m``).
        log_dir: where ``replica-<i>.log`` files go; the paths stay in ``log_paths`` after the pool stops.
            Default: a fresh temporary directory, deleted when the pool stops unless a replica failed (the
            error names its log there).
        extra_args: more command-line flags for every replica, e.g. ``["--max-batch-size", "64"]``.
        env: environment of the replicas (default: this process's), read as each starts: a restart sees a change.
        ready_timeout_s: how long to wait for all replicas to answer ``/readyz``.
        stop_grace_s: how long a replica may drain after SIGINT before it is killed.
    """

    def __init__(
        self,
        scorers: list[str],
        replicas: int = 2,
        host: str = "127.0.0.1",
        python: str = sys.executable,
        log_dir: Path | None = None,
        *,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 120.0,
        stop_grace_s: float = 15.0,
    ) -> None:
        if not scorers:
            raise ValueError("scorers must name at least one scorer")
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.scorers = list(scorers)
        self.replicas = replicas
        self.host = host
        self.python = python
        self.module = server_module()
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.extra_args = list(extra_args)
        self.env = dict(env) if env is not None else None
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.urls: list[str] = []
        self.ports: list[int] = []
        self.log_paths: list[Path] = []
        self._processes: list[subprocess.Popen[bytes]] = []
        self._restarts: list[int] = []
        self._temp_log_dir: Path | None = None
        self._keep_logs = False
        self._lock = threading.Lock()  # a supervisor's restart against stop()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    def __enter__(self) -> LocalRewardPool:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start every replica and wait until all are ready.

        Raises:
            RewardPoolError: a replica exited or was not ready within ``ready_timeout_s`` (the pool is
                stopped and the message includes the end of that replica's log).
        """
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start every replica on a port bound here (``urls`` are set); ``wait_ready`` waits for them."""
        if self._processes:
            raise RuntimeError("the pool is already started")
        if self.log_dir is None:
            self._temp_log_dir = Path(tempfile.mkdtemp(prefix="rewardflow-pool-"))
        log_dir = self.log_dir or self._temp_log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_paths = [log_dir / f"replica-{index}.log" for index in range(self.replicas)]
        failed: list[BaseException] = []
        # Spawned by a thread of its own, under the lock that stop() takes first: a signal handler that raises (a
        # SIGTERM as the run starts) runs in the main thread only, so it cannot come between a fork and the
        # recording of its process, which stop() would then miss (an orphan replica).
        spawner = threading.Thread(target=self._spawn_all, args=(failed,), name="reward-replicas-start")
        try:
            spawner.start()
            spawner.join()
            if failed:
                raise failed[0]
        except BaseException:
            self.stop()
            raise

    def _spawn_all(self, failed: list[BaseException]) -> None:
        with self._lock:
            try:
                for index in range(self.replicas):
                    with bound_socket(self.host) as sock:
                        port = sock.getsockname()[1]
                        self.ports.append(port)
                        self.urls.append(f"http://{self.host}:{port}")
                        self._restarts.append(0)
                        self._processes.append(self._spawn(index, sock))
            except BaseException as exc:  # raised by launch(), in the caller's thread
                failed.append(exc)

    def wait_ready(self) -> None:
        """Wait until every replica answers ``/readyz`` (raises as ``start`` does)."""
        try:
            self._wait_ready(range(self.replicas))
        except BaseException:
            self.stop()
            raise

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL: no drain) to replica ``index`` and wait for it to exit."""
        process = self._processes[index]
        if process.poll() is None:
            process.send_signal(sig)
        process.wait(timeout=self.stop_grace_s)

    def restart(self, index: int) -> None:
        """Start replica ``index`` again on its port (it must have exited) and wait until it is ready.

        Raises:
            RuntimeError: the replica is still running.
            RewardPoolError: it exited, or was not ready within ``ready_timeout_s`` (then it is killed).
        """
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("the pool is stopping")
            if self._processes[index].poll() is None:
                raise RuntimeError(f"replica {index} is still running; kill it first")
            self._restarts[index] += 1
            try:
                sock = bound_socket(self.host, self.ports[index])
            except OSError as exc:
                raise RewardPoolError(
                    f"reward replica {index} cannot restart on its port {self.ports[index]} "
                    f"({exc.strerror}): another process took it meanwhile"
                ) from None
            with sock:
                self._processes[index] = self._spawn(index, sock)
        try:
            self._wait_ready([index])
        except RewardPoolError:  # hung (not ready in time): killed, so that a supervisor's next check restarts it
            self.kill(index)
            raise

    def supervise(self, max_restarts: int = 5, interval_s: float = 1.0, window_s: float = 600.0) -> None:
        """From now until ``stop``, restart each replica that exits (a crash, the OOM killer) on its port, checking
        every ``interval_s``; one that has already restarted ``max_restarts`` times in the last ``window_s`` seconds
        is left down (a crash loop), while one that dies now and then over a long run is always started again.
        Each exit and restart is logged with the end of the replica's log. The client's requests meanwhile go to
        the others, or wait (``outage_s``)."""
        if self._supervisor is None:
            self._supervisor = threading.Thread(
                target=self._supervise, args=(max_restarts, interval_s, window_s), name="reward-replicas", daemon=True
            )
            self._supervisor.start()

    def _supervise(self, max_restarts: int, interval_s: float, window_s: float) -> None:
        given_up: set[int] = set()
        restarted: dict[int, list[float]] = {}  # replica -> when each of its restarts began (monotonic)
        while not self._stopping.wait(interval_s):
            for index, process in enumerate(list(self._processes)):
                if process.poll() is None or index in given_up or self._stopping.is_set():
                    continue
                what = (
                    f"reward replica {index} ({self.urls[index]}) exited with status {process.returncode}; end "
                    f"of {self.log_paths[index]}:\n{_tail(self.log_paths[index], 10)}"
                )
                now = time.monotonic()
                recent = restarted[index] = [t for t in restarted.get(index, []) if now - t < window_s]
                if len(recent) >= max_restarts:
                    logger.warning(
                        "%s\nnot restarted: it has restarted %d times in %.0f s", what, max_restarts, window_s
                    )
                    given_up.add(index)
                    continue
                recent.append(now)
                logger.warning(
                    "%s\nrestarting it (restart %d of at most %d in %.0f s)", what, len(recent), max_restarts, window_s
                )
                try:
                    self.restart(index)
                except (RewardPoolError, RuntimeError, IndexError) as exc:  # again at the next check; IndexError:
                    if not self._stopping.is_set():  # stop() emptied the pool meanwhile
                        logger.warning("reward replica %d did not restart: %s", index, str(exc).splitlines()[0])

    def pid(self, index: int) -> int:
        """Process id of replica ``index``."""
        return self._processes[index].pid

    def exited(self, index: int) -> bool:
        """Whether replica ``index``'s process has ended."""
        return self._processes[index].poll() is not None

    def _spawn(self, index: int, sock: socket.socket) -> subprocess.Popen[bytes]:
        """Start replica ``index`` serving on ``sock`` (bound to its port; the child keeps its own copy)."""
        port = self.ports[index]
        instance = f"local-{index}-{port}" + (f"-r{self._restarts[index]}" if self._restarts[index] else "")
        command = [
            self.python, "-m", self.module,
            "--scorers", ",".join(self.scorers),
            "--host", self.host,
            "--port", str(port),
            "--fd", str(sock.fileno()),
            "--instance-id", instance,
            "--drain-grace-s", "0",  # only our own trainer talks to these replicas
            "--parent-pid", str(os.getpid()),
            *self.extra_args,
        ]  # fmt: skip
        # A session of their own: the terminal's Ctrl-C reaches the trainer alone, which stops them after
        # it has said where it stopped (stopping first, they would fail the rollout that waits on them).
        with open(self.log_paths[index], "ab") as log:
            return subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._child_env(),
                start_new_session=True,
                pass_fds=(sock.fileno(),),
            )

    def _child_env(self) -> dict[str, str]:
        """A replica's environment: ``env`` (read at each start, so a restart sees a change) or ours, unbuffered,
        with this source tree importable whatever the working directory."""
        env = dict(self.env if self.env is not None else os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
        return env

    def _wait_ready(self, indices: Iterable[int]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        pending = set(indices)
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while pending:
                for index in sorted(pending):
                    process = self._processes[index]
                    if process.poll() is not None:
                        self._keep_logs = True
                        raise RewardPoolError(
                            f"reward replica {index} ({self.urls[index]}) exited with status {process.returncode}; "
                            f"end of {self.log_paths[index]}:\n{_tail(self.log_paths[index])}",
                            exit_status=process.returncode,
                        )
                    try:
                        if client.get(f"{self.urls[index]}/readyz").status_code == 200:
                            pending.discard(index)
                    except httpx.TransportError:
                        pass
                if pending and time.monotonic() > deadline:
                    index = min(pending)
                    self._keep_logs = True
                    raise RewardPoolError(
                        f"reward replica {index} ({self.urls[index]}) not ready after {self.ready_timeout_s} s; "
                        f"end of {self.log_paths[index]}:\n{_tail(self.log_paths[index])}"
                    )
                if pending:
                    time.sleep(0.1)

    def stop(self) -> None:
        """SIGINT every replica (they ignore SIGTERM while we live), wait ``stop_grace_s`` for them to drain, then
        SIGKILL the rest; delete the default temporary log directory unless a replica failed."""
        with self._lock:  # no restart after this
            self._stopping.set()
            for process in self._processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + self.stop_grace_s
        for process in self._processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes.clear()
        self._restarts.clear()
        self.urls.clear()
        self.ports.clear()
        if self._supervisor is not None:
            self._supervisor.join(timeout=self.stop_grace_s)
            self._supervisor = None
        self._stopping.clear()
        if self._temp_log_dir is not None and not self._keep_logs:
            shutil.rmtree(self._temp_log_dir, ignore_errors=True)
            self._temp_log_dir = None
