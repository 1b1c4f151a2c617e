"""A private one-node SLURM cluster for tests: munged, slurmctld and slurmd from Debian's packages (``make
slurm-deps``), each on its own socket, ports and folders under a temporary directory, as root (slurmd starts the
jobs). The node is named ``localhost``: jobs take their rendezvous host from the node list, as on a real cluster,
and that name resolves on any machine. ``SlurmCluster.env`` is what ``sbatch``, ``squeue``, ``scancel`` and
``scontrol`` need to reach it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def _which(name: str) -> str | None:
    """``name``'s path, the daemons' /usr/sbin included (not on every PATH)."""
    return shutil.which(name, path=f"/usr/sbin:{os.environ['PATH']}")


def missing() -> str | None:
    """Why no cluster can start here (None: one can)."""
    absent = [name for name in (*DAEMONS, "sbatch") if _which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (make slurm-deps)"
    if os.geteuid() != 0:
        return "slurmd starts jobs as their user: run as root"
    return None


def _free_ports(count: int) -> list[int]:
    """Ports nothing listens on now (the daemons bind them themselves: they take no socket from us)."""
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


class SlurmCluster:
    """``with SlurmCluster(tmp) as cluster:`` one node (all the machine's CPUs) in one partition."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._processes: list[subprocess.Popen] = []

    def __enter__(self) -> SlurmCluster:
        for folder in ("state", "spool", "log"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        munge_socket = self.root / "munge.socket"
        ctld_port, node_port = _free_ports(2)
        self.conf.write_text(
            "\n".join(
                [
                    f"ClusterName=rf{os.getpid()}",
                    f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={munge_socket}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={node_port}",
                    f"StateSaveLocation={self.root / 'state'}",
                    f"SlurmdSpoolDir={self.root / 'spool'}",
                    f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={self.root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
                    f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
                    "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        self._start(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self.root / 'munged.pid'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={self.root / 'munge.seed'}",
            ]
        )
        self._wait(lambda: munge_socket.exists(), "munged")
        self._start(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._start(["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)])
        self._wait(lambda: "idle" in self.run("sinfo", "-h", "-o", "%T", check=False).stdout, "the node to be idle")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if len(self._processes) == len(DAEMONS):  # jobs first: slurmd leaves running ones behind when it stops
            self.run("scancel", "--partition=test", "--full", check=False)
            deadline = time.monotonic() + 30
            while self.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        for process in reversed(self._processes):
            process.terminate()
        for process in reversed(self._processes):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _start(self, command: list[str]) -> None:
        log = open(self.root / "log" / f"{command[0]}.out", "wb")  # noqa: SIM115 (the process keeps it)
        self._processes.append(
            subprocess.Popen([_which(command[0]), *command[1:]], stdout=log, stderr=subprocess.STDOUT, env=self.env)
        )
        log.close()

    def _wait(self, ready, what: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p.args[0] for p in self._processes if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in (self.root / "log").iterdir())
                why = f"exited: {', '.join(dead)}" if dead else "timeout"
                raise RuntimeError(f"SLURM test cluster: no {what} ({why})\n{logs}")
            time.sleep(0.2)

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60, check=check)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ...)."""
        fields = {}
        for word in self.run("scontrol", "show", "job", job_id).stdout.split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields
