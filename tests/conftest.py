import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta

import pytest

import elastix
import requirements
import torch_gate
from requirements import need_etcd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    torch_gate.configure(config)
    # what the tests' agents note of their jobs' ends (rust/core/src/agent/finished.rs) stays
    # with this session, not in the user's own state directory
    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="elastix-test-state-")
    # and so does what they keep in the temporary directory: the log directories of the jobs
    # that failed on purpose (an agent keeps them, as torchrun does), some hundred a run. The
    # tests' own temporary directories stay where they were (tempfile has read them already)
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="elastix-test-tmp-")
    # a shell that starts a job in the background (`nohup pytest &`) has it ignore SIGINT, an
    # ignored signal stays ignored across exec, and Python then installs no KeyboardInterrupt:
    # the tests that press Ctrl-C on their programs need it delivered
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config):
    shutil.rmtree(os.environ.pop("XDG_STATE_HOME", ""), ignore_errors=True)
    shutil.rmtree(os.environ.pop("TMPDIR", ""), ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    torch_gate.deselect_without_torch(config, items)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    torch_gate.report(terminalreporter, config)
    requirements.report(terminalreporter)


@pytest.fixture(params=["uring", "epoll"])
def store_io(request, monkeypatch):
    """Each store server in turn (ELASTIX_STORE_IO) for the masters a test starts: io_uring's,
    which serves where it can, and epoll's, which serves jobs with a secret."""
    monkeypatch.setenv("ELASTIX_STORE_IO", request.param)
    return request.param


@pytest.fixture
def master(store_io):
    """A master TCPStore on a free port, on each server in turn, with a short timeout so
    failures do not hang."""
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    yield store


@pytest.fixture
def client(master):
    return elastix.TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=10))


def held_port(addr: str = "0.0.0.0") -> socket.socket:
    """A bound, non-listening socket with SO_REUSEADDR on a port the kernel picked at `addr`:
    the port is taken by no one but servers that bind with SO_REUSEADDR (elastix's, torch's,
    etcd's) until it is closed. By default on the wildcard, where stores listen: a port picked
    for one address may be in use on another, and a store finding it taken there would take
    another agent to be hosting it."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind((addr, 0))
    return holder


@contextlib.contextmanager
def reserved_port():
    """A port for a server that must be told its port up front (MASTER_PORT, tcp:// init,
    torch's TCPStore): held by a bound, non-listening socket until the block ends. Servers
    that bind with SO_REUSEADDR (elastix's and torch's) can take it meanwhile; nobody else can,
    and the kernel hands it to no one, so there is no race between choosing and binding."""
    with held_port() as holder:
        yield holder.getsockname()[1]


@pytest.fixture
def rdzv_port():
    """A rendezvous store started by the test on a port the kernel picked, for agents told
    `is_host=false` (as torchrun users run a standalone store)."""
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    yield store.port


def closed_port():
    """A bound socket that never listens: connecting to its port is refused, and no one else
    can take the port while the socket is open."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def run_python(code: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, **kwargs)


def alive(pid):
    """Runs (a zombie has exited and counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _main_thread(pid):
    """(state, voluntary context switches) of `pid`'s main thread; None once it is gone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return fields["State"].split()[0], int(fields["voluntary_ctxt_switches"])
    except (OSError, KeyError, ValueError, IndexError):
        return None


def blocked(pid, settle=0.02):
    """`pid`'s main thread sleeps in the kernel (a wait, a lock, a read) and stayed in that one
    sleep for `settle` seconds (it switched out no more meanwhile): blocked in a call, not
    passing through a short wait such as a request's round trip. For `wait_for`."""
    first = _main_thread(pid)
    if first is None or first[0] not in ("S", "D"):
        return False
    time.sleep(settle)  # the interval the sleep must span, not a wait for something
    return _main_thread(pid) == first


def ignores(pid, signum):
    """`pid` ignores `signum` (SIG_IGN, as the kernel shows it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(mask & (1 << (signum - 1)))


def marked_processes(marker):
    """Live processes started with our marker in their environment (agents, workers, theirs)."""
    found = []
    for environ in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(environ, "rb") as f:
                if f"ELASTIX_TEST_MARKER={marker}".encode() in f.read().split(b"\0"):
                    found.append(int(environ.split("/")[2]))
        except OSError:
            pass
    return [pid for pid in found if alive(pid)]


@pytest.fixture
def marker():
    marker = uuid.uuid4().hex
    yield marker
    for pid in marked_processes(marker):  # a failed test must not leak processes
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def store_deadline():
    """The class a missed store deadline is raised as: elastix's StoreTimeoutError (also a
    TimeoutError); once torch.distributed is loaded in this process (the torch interop tests
    load it), torch's DistStoreError, exactly as torch's own stores raise (elastix.errors.raised)."""
    torch_distributed = sys.modules.get("torch.distributed")
    return torch_distributed.DistStoreError if torch_distributed else elastix.StoreTimeoutError


def network_deadline():
    """The same for a connection's deadline: NetworkTimeoutError, or torch's DistNetworkError."""
    torch_distributed = sys.modules.get("torch.distributed")
    return torch_distributed.DistNetworkError if torch_distributed else elastix.NetworkTimeoutError


@pytest.fixture
def etcd(tmp_path):
    """A real etcd cluster of three members (tests/etcd_cluster.py), closed after the test."""
    need_etcd()
    from etcd_cluster import EtcdCluster

    data = tmp_path / "etcd"
    data.mkdir()
    cluster = EtcdCluster(data)
    yield cluster
    cluster.close()


@pytest.fixture
def hosts():
    """Three simulated hosts in network namespaces (tests/netns.py), removed after the test."""
    from netns import hosts_for_a_test

    yield from hosts_for_a_test(3)


@pytest.fixture
def rendezvous(request, tmp_path, hosts):
    """(backend, endpoint) for the hosts (indirect parameter "c10d" or "etcd"): host 0's agent
    serving the c10d store, or a real etcd cluster of three members on this machine, reached
    through the hosts' gateway."""
    if request.param == "c10d":
        yield "c10d", f"{hosts.addr(0)}:29400"
        return
    need_etcd()
    from etcd_cluster import EtcdCluster

    data = tmp_path / "etcd"
    data.mkdir()
    cluster = EtcdCluster(data, client_host=hosts.gateway)
    yield "etcd", cluster.endpoints
    cluster.close()
