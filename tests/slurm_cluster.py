"""A real Slurm cluster for tests, on this one machine: one host per network namespace of
tests/netns.py (`Hosts`), each running its own `slurmd` under its own host name (n1, n2, ...),
so that `srun -N 2` really starts one task per host through two `slurmd`s, as on a cluster.

- `munged` (its own key, its socket under the scratch directory) and `slurmctld` run on this
  machine; `slurmctld` listens on every address, so the hosts reach it at `hosts.gateway` and the
  test's `srun`/`sbatch`/`squeue`/`scancel` (run with `SlurmCluster.env`) at the same address.
- Host i's processes run in its network namespace (`nsenter --net`: `ip netns exec` mounts a
  fresh /sys, which hides /sys/fs/cgroup from slurmd) and in UTS and mount namespaces of their
  own (`unshare --uts --mount`), where the host name is set and a private hosts file naming every
  node is bind-mounted over /etc/hosts; this machine's own files are left untouched.
- Every process of a job carries the environment of the `srun` that started it (`--export=ALL`,
  Slurm's default), so PATH leads to this interpreter and its `elastix` script first and
  `ELASTIX_TEST_MARKER` marks it (`SlurmCluster.marker` unless the test gives its own).

Differences from a real cluster: one kernel, file system and process table; no cgroups, so a
process that daemonises escapes Slurm here (`close` kills every process in the namespaces and
every process marked with the cluster's marker). Uses Debian's packages `slurmctld`, `slurmd`,
`slurm-client` and `munge` (`install`; `.ci/run` installs them); `available()` says why the
cluster cannot run here."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from typing import Iterator

from conftest import held_port, marked_processes
from netns import Hosts

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
_COMMANDS = ("slurmctld", "slurmd", "srun", "sinfo", "munged", "nsenter", "unshare")
_SLURMD_PORT = 6818  # the same on every host: each has its own network namespace


def _missing() -> list[str]:
    return [command for command in _COMMANDS if shutil.which(command) is None]


def install() -> str | None:
    """Installs the Debian packages with apt-get where a command is missing (root only), then
    disables the boot services the packages enable. None once installed, else why not."""
    if not _missing():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return (
            f"Slurm is not installed ({', '.join(_missing())} missing) and cannot be installed here (apt-get as root)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}

    def apt(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["apt-get", *argv], capture_output=True, text=True, timeout=600, env=env)

    done = apt("install", "-y", "-q", *PACKAGES)
    if done.returncode != 0:
        apt("update", "-q")
        done = apt("install", "-y", "-q", *PACKAGES)
    if shutil.which("update-rc.d"):
        for service in ("slurmctld", "slurmd", "munge"):
            subprocess.run(["update-rc.d", service, "disable"], capture_output=True, timeout=60)
    if done.returncode != 0 or _missing():
        return f"could not install {' '.join(PACKAGES)}: {done.stderr.strip()[-500:]}"
    return None


def available() -> str | None:
    """None where a cluster can be started here (installing the packages when missing, as
    root), else why not."""
    return Hosts.available() or install()


class SlurmCluster:
    def __init__(
        self,
        scratch,
        nodes: int = 2,
        cpus: int = 4,
        conf: dict[str, str] | None = None,
        timeout: float = 30,
    ):
        """`scratch`: a directory for the configuration, keys, state and logs (a pytest
        tmp_path). `cpus`: what each node announces (more than the machine has is fine).
        `conf`: slurm.conf settings added or replacing the defaults (e.g. {"SlurmdTimeout":
        "5"}). Returns once `sinfo` shows every node idle, or raises within `timeout` with the
        daemons' logs."""
        self.dir = os.path.abspath(str(scratch))
        self.node_names = [f"n{i + 1}" for i in range(nodes)]
        self.marker = uuid.uuid4().hex
        self.conf_path = os.path.join(self.dir, "slurm.conf")
        self._slurmd: dict[int, subprocess.Popen | None] = {}
        self._slurmctld: subprocess.Popen | None = None
        self._munged: subprocess.Popen | None = None
        self._closed = False
        self._port_holder = None
        self.hosts = Hosts(nodes)
        try:
            self._write_files(cpus, conf or {})
            self._start_munged()
            self._start_slurmctld()
            for i in range(nodes):
                self.start_node(i)
            self.wait_idle(timeout=timeout)
        except BaseException:
            self.close()
            raise

    # -- set up ---------------------------------------------------------------------------

    def _path(self, *parts: str) -> str:
        return os.path.join(self.dir, *parts)

    def _write_files(self, cpus: int, overrides: dict[str, str]) -> None:
        for sub in ("state", "munge", *(os.path.join("spool", name) for name in self.node_names)):
            os.makedirs(self._path(sub), exist_ok=True)
        os.chmod(self._path("munge"), 0o755)
        with open(os.open(self._path("munge.key"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(secrets.token_bytes(1024))
        open(self._path("plugstack.conf"), "w").close()
        self.munge_socket = self._path("munge", "munge.socket.2")
        # held until close: slurmctld (SO_REUSEADDR) binds it, nobody else can
        self._port_holder = held_port()
        self.port = self._port_holder.getsockname()[1]
        settings = {
            "ClusterName": "elastix",
            "SlurmctldHost": f"ctl({self.hosts.gateway})",
            "SlurmctldPort": str(self.port),
            "SlurmdPort": str(_SLURMD_PORT),
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            # a requeued job waits cred_expire + 1 s before it may start again (slurmd rejects
            # the job's revoked credential until then): 6 s here, where Slurm's default is 121 s
            "AuthInfo": f"socket={self.munge_socket},cred_expire=5",
            "StateSaveLocation": self._path("state"),
            "SlurmdSpoolDir": self._path("spool", "%n"),
            "SlurmctldPidFile": self._path("slurmctld.pid"),
            "SlurmdPidFile": self._path("slurmd-%n.pid"),
            "SlurmctldLogFile": self._path("slurmctld.log"),
            "SlurmdLogFile": self._path("slurmd-%n.log"),
            "SlurmctldDebug": "info",
            "SlurmdDebug": "info",
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            "SlurmdParameters": "config_overrides",
            "MailProg": "/bin/true",
            "PlugStackConfig": self._path("plugstack.conf"),
            "AccountingStorageType": "accounting_storage/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "JobCompType": "jobcomp/none",
            "MpiDefault": "none",
            "ReturnToService": "2",
            # a killed host is set DOWN (its steps cancelled, srun told "Node failure") about
            # 27 s later, 8 s with conf={"SlurmdTimeout": "4", "MessageTimeout": "4"}; a cancelled
            # job is SIGKILLed 2 s after its SIGTERM (Slurm's defaults: 300 s and 30 s)
            "SlurmdTimeout": "10",
            "KillWait": "2",
            "InactiveLimit": "0",
            # pending jobs whose start time comes (a requeued one) are looked at every second
            # rather than every minute
            "SchedulerParameters": "sched_interval=1",
            **overrides,
        }
        lines = [f"{key}={value}" for key, value in settings.items()]
        for i, name in enumerate(self.node_names):
            lines.append(f"NodeName={name} NodeAddr={self.hosts.addr(i)} CPUs={cpus} State=UNKNOWN")
        lines.append("PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        with open(self.conf_path, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(self._path("hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.write(f"{self.hosts.gateway} ctl\n")
            for i, name in enumerate(self.node_names):
                f.write(f"{self.hosts.addr(i)} {name}\n")

    def _daemon(self, argv: list[str], log: str) -> subprocess.Popen:
        with open(self._path(log), "ab") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _start_munged(self) -> None:
        self._munged = self._daemon(
            [
                *("munged", "--foreground", "--force", "--num-threads", "4"),
                f"--key-file={self._path('munge.key')}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self._path('munge', 'munged.pid')}",
                f"--log-file={self._path('munged.log')}",
                f"--seed-file={self._path('munge', 'munged.seed')}",
            ],
            "munged.out",
        )
        self._wait(lambda: os.path.exists(self.munge_socket), 10, "munged's socket")

    def _start_slurmctld(self) -> None:
        # its own UTS namespace, named as SlurmctldHost says, in this machine's network
        self._slurmctld = self._daemon(
            [
                "unshare",
                "--uts",
                "sh",
                "-c",
                'hostname ctl && exec "$@"',
                "sh",
                "slurmctld",
                "-D",
                "-f",
                self.conf_path,
            ],
            "slurmctld.out",
        )

    def host_command(self, i: int, *argv: str) -> list[str]:
        """argv run on host i as its own processes are: its network namespace, its host name,
        its /etc/hosts (the pid stays the same through every exec)."""
        script = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        return [
            *("nsenter", f"--net=/run/netns/{self.hosts.names[i]}", "--"),
            *("unshare", "--uts", "--mount", "--"),
            *("sh", "-c", script, "sh", self.node_names[i], self._path("hosts"), *argv),
        ]

    def start_node(self, i: int) -> None:
        """Starts host i's slurmd (again, after `kill_node`)."""
        argv = ["slurmd", "-D", "-N", self.node_names[i], "-f", self.conf_path]
        self._slurmd[i] = self._daemon(self.host_command(i, *argv), f"slurmd-{self.node_names[i]}.out")

    # -- use ------------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The environment for srun/sbatch/squeue/scancel/sinfo from the test: this cluster's
        configuration, this interpreter's directory first on PATH (tasks inherit it), and the
        cluster's marker (a test may set its own)."""
        bindir = os.path.dirname(sys.executable)
        return {
            **os.environ,
            "SLURM_CONF": self.conf_path,
            "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
            "ELASTIX_TEST_MARKER": self.marker,
        }

    def addr(self, i: int) -> str:
        return self.hosts.addr(i)

    def run(self, *argv: str, timeout: float = 30, env: dict[str, str] | None = None, **kwargs):
        """Any Slurm client command with the cluster's environment (plus `env`)."""
        return subprocess.run(
            list(argv), env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout, **kwargs
        )

    def srun(self, *argv: str, timeout: float = 30, env: dict[str, str] | None = None, **kwargs):
        """`srun --export=ALL ARGV` (srun's options first, then the program), its output
        captured: a CompletedProcess. `env` is added to the cluster's environment."""
        return self.run("srun", "--export=ALL", *argv, timeout=timeout, env=env, **kwargs)

    def popen(self, *argv: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """`srun --export=ALL ARGV` started in the background (text mode; the caller chooses
        where its output goes)."""
        return subprocess.Popen(["srun", "--export=ALL", *argv], env={**self.env, **(env or {})}, text=True, **kwargs)

    def jobs(self) -> list[str]:
        """The ids of the jobs Slurm has pending or running."""
        return self.run("squeue", "-h", "-o", "%i", timeout=10).stdout.split()

    def cancel_all(self, timeout: float = 15) -> None:
        """Cancels every job (a test's cleanup) and waits until none is left."""
        jobs = self.jobs()
        if jobs:
            self.run("scancel", *jobs, timeout=10)
            self._wait(lambda: not self.jobs(), timeout, "every job to end")

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo writes it (idle, alloc, mix, down*, ...)."""
        found = self.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=10)
        states = {}
        for line in found.stdout.splitlines():
            name, _, state = line.partition(" ")
            states[name] = state.strip()
        return states

    def wait_idle(self, nodes=None, timeout: float = 30) -> None:
        """Waits until `nodes` (names; all by default) are idle, or raises with the logs."""
        names = list(nodes or self.node_names)

        def idle() -> bool:
            try:
                states = self.node_states()
            except subprocess.TimeoutExpired:
                return False
            return all(states.get(name) == "idle" for name in names)

        self._wait(idle, timeout, f"nodes {', '.join(names)} idle")

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = self._dead_daemons()
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}{dead}\n{self.logs()}")
            time.sleep(0.05)

    def _dead_daemons(self) -> str:
        procs = {"munged": self._munged, "slurmctld": self._slurmctld}
        procs.update({f"slurmd {self.node_names[i]}": proc for i, proc in self._slurmd.items()})
        dead = [f"{name} exited with {p.returncode}" for name, p in procs.items() if p and p.poll() is not None]
        return f" ({'; '.join(dead)})" if dead else ""

    def logs(self, tail: int = 40) -> str:
        """The last lines of every daemon's logs."""
        parts = []
        for name in sorted(os.listdir(self.dir)):
            if name.endswith((".log", ".out")):
                with open(self._path(name), errors="replace") as f:
                    lines = f.read().splitlines()[-tail:]
                parts.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def kill_node(self, i: int) -> list[int]:
        """Host i dies as a machine would: SIGKILL to its slurmd and every process on it (steps,
        tasks) at once. Returns their pids."""
        pids = self.hosts.kill(i)
        proc = self._slurmd.get(i)
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)
            self._slurmd[i] = None
        return pids

    def close(self) -> None:
        """Stops everything this cluster started (and every process marked with its marker) and
        removes the namespaces; idempotent."""
        if self._closed:
            return
        self._closed = True
        for i in range(len(self.hosts.names)):
            self.kill_node(i)
        for proc in (self._slurmctld, self._munged):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        for pid in marked_processes(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._port_holder is not None:
            self._port_holder.close()
        self.hosts.close()


def slurm_for_tests(scratch, nodes: int = 2, **kwargs) -> Iterator[SlurmCluster]:
    """A cluster of `nodes` hosts for a fixture's body: the test is skipped, saying why, where
    one cannot run here (`available()`), and the cluster is closed after it."""
    from requirements import need

    need("slurm", available())
    cluster = SlurmCluster(scratch, nodes, **kwargs)
    yield cluster
    cluster.close()
