"""run_server.sh start/status/stop with two CPU replicas."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "run_server.sh"


def _free_port_pair() -> int:
    """A port P such that P and P + 1 are free on the loopback interface right now."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


def _run(
    command: str, *args: str, run_dir: Path, gpus: str = "", timeout_s: float = 90
) -> subprocess.CompletedProcess[str]:
    """``run_server.sh COMMAND --run-dir RUN_DIR ARGS...`` with this interpreter; no GPUs unless ``gpus``."""
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": gpus}
    return subprocess.run(
        [str(SCRIPT), command, "--run-dir", str(run_dir), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _pid_running(pid: int) -> bool:
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True, check=False)
    return state.returncode == 0 and not state.stdout.strip().startswith("Z")


def test_start_status_stop_two_cpu_replicas(tmp_path: Path) -> None:
    port = _free_port_pair()
    run_dir = tmp_path / "reward"
    started = _run("start", "--replicas", "2", "--base-port", str(port), "--scorers", "brightness", "--",
                   "--drain-grace-s", "0.2", run_dir=run_dir)  # fmt: skip
    pids = []
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        assert started.stdout.strip().splitlines()[-3:] == ["ready:", *urls]
        pids = [int((run_dir / f"replica-{i}.pid").read_text()) for i in range(2)]
        instances = set()
        for url in urls:
            assert httpx.get(f"{url}/readyz", trust_env=False).status_code == 200
            instances.add(httpx.get(f"{url}/info", trust_env=False).json()["instance"])
        assert len(instances) == 2
        assert (run_dir / "replica-1.log").exists()

        status = _run("status", run_dir=run_dir)
        assert status.returncode == 0 and status.stdout.count(", ready") == 2

        again = _run("start", "--replicas", "2", "--base-port", str(port), run_dir=run_dir)
        assert again.returncode == 1 and "already running" in again.stderr
    finally:
        stopped = _run("stop", run_dir=run_dir)
    assert stopped.returncode == 0 and "stopped 2 replica(s)" in stopped.stdout
    assert not any(_pid_running(pid) for pid in pids)
    assert _run("status", run_dir=run_dir).returncode == 3


def test_start_reports_a_replica_that_dies(tmp_path: Path) -> None:
    failed = _run("start", "--replicas", "1", "--base-port", str(_free_port_pair()), "--scorers", "brightness",
                  "--", "--bogus", run_dir=tmp_path)  # fmt: skip
    assert failed.returncode == 1
    assert "replica 0 exited" in failed.stderr and "unrecognized arguments: --bogus" in failed.stderr
    assert not list(tmp_path.glob("*.pid"))


def test_a_second_pool_on_an_occupied_base_port_fails_instead_of_reporting_ready(tmp_path: Path) -> None:
    """Readiness used to take any answer on the port: the second pool's replica failed to bind and died, yet
    ``start`` printed "ready" with the first pool's URL and exited 0."""
    port = _free_port_pair()
    first = _run("start", "--replicas", "1", "--base-port", str(port), "--scorers", "brightness",
                 run_dir=tmp_path / "first")  # fmt: skip
    try:
        assert first.returncode == 0, first.stdout + first.stderr
        second = _run("start", "--replicas", "1", "--base-port", str(port), "--scorers", "brightness",
                      run_dir=tmp_path / "second")  # fmt: skip
        assert second.returncode == 1, second.stdout + second.stderr
        assert "ready:" not in second.stdout
        assert "replica 0 exited" in second.stderr
        assert str(tmp_path / "second" / "replica-0.log") in second.stderr
        assert f"port {port} is taken by another process" in second.stderr and "--base-port" in second.stderr
        assert not list((tmp_path / "second").glob("*.pid"))

        assert _run("status", run_dir=tmp_path / "first").returncode == 0
        first_instance = (tmp_path / "first" / "replica-0.instance").read_text().strip()
        assert first_instance.startswith(f"{socket.gethostname()}-{port}-replica-0-")
        reply = httpx.get(f"http://127.0.0.1:{port}/readyz", trust_env=False).json()
        assert reply["instance"] == first_instance
    finally:
        assert _run("stop", run_dir=tmp_path / "first").returncode == 0


def test_status_does_not_count_another_server_on_the_port_as_its_replica(tmp_path: Path) -> None:
    port = _free_port_pair()
    started = _run("start", "--replicas", "1", "--base-port", str(port), "--scorers", "brightness",
                   run_dir=tmp_path)  # fmt: skip
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        (tmp_path / "replica-0.instance").write_text("another-pool-replica-0\n")
        status = _run("status", run_dir=tmp_path)
        assert status.returncode == 1 and status.stdout.strip().endswith(", not ready")
    finally:
        assert _run("stop", run_dir=tmp_path).returncode == 0


def test_stop_goes_on_when_a_replica_exits_between_its_check_and_the_signal(tmp_path: Path) -> None:
    """``kill`` on a replica that has just exited failed, and ``set -e`` ended ``stop`` there: the replicas
    after it kept running and every pid file stayed. The race is made certain with a ``ps`` that still shows
    replica 0's exited process; replica 1 is a real process whose command line names reward_server."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "ps").write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ " $* " == *" {gone.pid} "* ]]; then\n'
        '  [[ "$*" == *stat=* ]] && echo S || echo "python -m reward_server --port 9"\n'
        "  exit 0\n"
        "fi\n"
        f'exec {shutil.which("ps")} "$@"\n'
    )
    (fake_bin / "ps").chmod(0o755)
    other = subprocess.Popen(["bash", "-c", "exec -a reward_server-stand-in sleep 60"])
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        for index, pid in enumerate([gone.pid, other.pid]):
            (run_dir / f"replica-{index}.pid").write_text(f"{pid}\n")
            (run_dir / f"replica-{index}.url").write_text("http://127.0.0.1:9\n")
        stopped = subprocess.run(
            [str(SCRIPT), "stop", "--run-dir", str(run_dir)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"},
        )
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert "stopped 1 replica(s)" in stopped.stdout
        assert other.wait(timeout=10) == -15
        assert not list(run_dir.glob("*.pid"))
    finally:
        other.kill()
        other.wait()


def test_a_stale_pid_file_never_signals_the_process_that_now_has_its_number(tmp_path: Path) -> None:
    """A replica that crashed leaves its pid file; the system may give that pid to another process, which
    ``stop`` used to SIGTERM (then SIGKILL) and ``start`` took for a running replica."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "replica-0.pid").write_text(f"{other.pid}\n")
        (tmp_path / "replica-0.url").write_text("http://127.0.0.1:9\n")
        assert _run("status", run_dir=tmp_path).stdout.strip().endswith(", dead")
        stopped = _run("stop", run_dir=tmp_path)
        assert stopped.returncode == 0 and "stopped 0 replica(s)" in stopped.stdout
        assert other.poll() is None and _pid_running(other.pid)
    finally:
        other.kill()
        other.wait()


def test_an_ipv6_host_gets_a_bracketed_url(tmp_path: Path) -> None:
    """``--host ::1`` made ``http://::1:PORT``, which nothing can connect to: start waited for readiness
    until its timeout."""
    with socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", 0))
        port = sock.getsockname()[1]
    started = _run("start", "--replicas", "1", "--host", "::1", "--base-port", str(port), "--scorers", "brightness",
                   run_dir=tmp_path)  # fmt: skip
    try:
        assert started.returncode == 0, started.stderr
        assert started.stdout.strip().splitlines()[-1] == f"http://[::1]:{port}"
        assert httpx.get(f"http://[::1]:{port}/readyz", timeout=5, trust_env=False).status_code == 200
    finally:
        assert _run("stop", run_dir=tmp_path).returncode == 0


def test_unknown_command_and_option() -> None:
    assert subprocess.run([str(SCRIPT), "restart"], capture_output=True, check=False).returncode == 1
    result = subprocess.run([str(SCRIPT), "start", "--gpus", "2"], capture_output=True, text=True, check=False)
    assert result.returncode == 1 and "unknown option --gpus" in result.stderr


def test_one_replica_per_visible_gpu_pinned_by_cuda_visible_devices(tmp_path: Path) -> None:
    """GPU ids are only passed on, so this runs on the CPU; the servers never touch CUDA."""
    port = _free_port_pair()
    started = _run("start", "--base-port", str(port), "--scorers", "brightness", run_dir=tmp_path, gpus="3,5")
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert "replica 0: pid" in started.stdout and "GPU 3," in started.stdout
        assert "replica 1: pid" in started.stdout and "GPU 5," in started.stdout
        for index, gpu in enumerate(["3", "5"]):
            pid = (tmp_path / f"replica-{index}.pid").read_text().strip()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"CUDA_VISIBLE_DEVICES={gpu}".encode() in environ
    finally:
        assert _run("stop", run_dir=tmp_path).returncode == 0
