"""``LocalRewardPool``, the trainer's own reward replicas: the ports it holds, restarts of a killed replica, a
replica that dies, its temporary logs, and a server handed a file descriptor that is no TCP socket."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys

import httpx
import pytest

from trainer.rewards import LocalRewardPool, RewardPoolError


def test_launcher_holds_each_port_from_its_choice_on(tmp_path) -> None:
    """A replica's port is bound by the launcher and the socket passed to it (``--fd``): from launch on, no other
    process can take it (the launcher used to pick a free port, release it and let the replica bind it later,
    which a concurrent job could win). Until the replica listens, a connection is refused, not left waiting."""
    pool = LocalRewardPool(["brightness"], replicas=2, log_dir=tmp_path)
    try:
        pool.launch()
        ports = list(pool.ports)
        assert len(set(ports)) == 2
        for port in ports:
            with socket.socket() as rival, pytest.raises(OSError, match="Address already in use"):
                rival.bind(("127.0.0.1", port))
        pool.wait_ready()
        assert [httpx.get(f"{url}/readyz", trust_env=False).status_code for url in pool.urls] == [200, 200]
    finally:
        pool.stop()
    for port in ports:  # released with the replicas (SO_REUSEADDR: past connections' TIME_WAIT, never a listener)
        with socket.socket() as after:
            after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            after.bind(("127.0.0.1", port))


def test_a_killed_replica_restarts_on_its_port_while_a_client_holds_a_connection_to_it() -> None:
    """The connections a killed replica had accepted linger (FIN_WAIT) while their clients keep them; the bound
    socket's SO_REUSEADDR, which they inherit, lets the restart bind the port again (without it: EADDRINUSE)."""
    with LocalRewardPool(["brightness"], replicas=1) as pool, httpx.Client(trust_env=False) as client:
        assert client.get(f"{pool.urls[0]}/readyz").status_code == 200  # a kept-alive connection
        pool.kill(0)
        pool.restart(0)
        assert client.get(f"{pool.urls[0]}/readyz").status_code == 200


def test_a_server_given_an_fd_that_is_not_a_tcp_socket_exits_with_one_line(tmp_path) -> None:
    with open(tmp_path / "file", "w") as not_a_socket:
        fd = not_a_socket.fileno()
        result = subprocess.run(
            [sys.executable, "-m", "reward_server", "--scorers", "brightness", "--fd", str(fd)],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=60,
        )
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and last == f"--fd {fd}: not an open socket (Socket operation on non-socket)", last


def test_launcher_reports_a_replica_that_dies(tmp_path) -> None:
    with pytest.raises(RewardPoolError, match="exited with status 2(.|\n)*unrecognized arguments: --bogus"):
        with LocalRewardPool(["brightness"], replicas=1, log_dir=tmp_path, extra_args=["--bogus"]):
            pass
    assert (tmp_path / "replica-0.log").exists()
    pool = LocalRewardPool(["brightness"], replicas=1, extra_args=["--bogus"])  # logs in a temporary directory
    with pytest.raises(RewardPoolError, match="end of (.*replica-0.log)") as info:
        with pool:
            pass
    log = pool.log_paths[0]
    assert str(log) in str(info.value) and "--bogus" in log.read_text(), "the log the error names is kept"
    shutil.rmtree(log.parent)


def test_launcher_deletes_its_temporary_logs_when_it_stops() -> None:
    with LocalRewardPool(["brightness"], replicas=1) as pool:
        log = pool.log_paths[0]
        assert log.is_file()
    assert not log.parent.exists()
