"""The store server under bad input, and the elastix-store command."""

import random
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta

import pytest

import elastix

VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)


def raw(port, validated=True):
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if validated:
        sock.sendall(VALIDATE)
    return sock


def closed_by_server(sock) -> bool:
    try:
        while True:
            if not sock.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_garbage_truncated_frames_and_huge_lengths_do_not_disturb_other_clients(master, client):
    rng = random.Random(1234)
    client.set("keep", "safe")
    for i in range(300):
        sock = raw(master.port, validated=i % 2 == 0)
        sock.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))))
        sock.close()
        if i % 50 == 0:
            assert client.get("keep") == b"safe"
    # huge announced lengths: refused from the header, the connection closed
    for header in (
        b"\x01" + struct.pack("<Q", 2**63),  # SET with an absurd key length
        b"\x01" + struct.pack("<Q", 4) + b"/key" + struct.pack("<Q", 9 * 2**20),  # 9 MiB value
        b"\x06" + struct.pack("<Q", 2**40),  # WAIT on 2^40 keys
    ):
        sock = raw(master.port)
        sock.sendall(header)
        assert closed_by_server(sock)
    # truncated frames, then hang up
    frame = b"\x01" + struct.pack("<Q", 4) + b"/abc" + struct.pack("<Q", 3) + b"xyz"
    for cut in range(1, len(frame)):
        sock = raw(master.port)
        sock.sendall(frame[:cut])
        sock.close()
    assert client.get("keep") == b"safe"
    assert not client.check(["abc"])


def test_a_split_validate_is_accepted_unlike_torchs_libuv_server(master):
    sock = raw(master.port, validated=False)
    sock.sendall(VALIDATE[:2])
    time.sleep(0.05)  # the rest a moment later, so that it comes in another segment
    sock.sendall(VALIDATE[2:] + b"\x0d" + struct.pack("<I", 99))
    assert sock.recv(4) == struct.pack("<I", 99)


def test_a_non_validating_client_is_disconnected(master, client):
    sock = raw(master.port, validated=False)
    sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
    assert closed_by_server(sock)
    assert client.num_keys() == 0


def store_command():
    return shutil.which("elastix-store") or pytest.skip("elastix-store console script not installed")


def start_store(*args):
    proc = subprocess.Popen([store_command(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("elastix-store listening on "), (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, int(line.rsplit(":", 1)[1])


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_elastix_store_command_serves_and_stops_cleanly(stop):
    proc, port = start_store("--port", "0", "--log-level", "warn")
    try:
        store = elastix.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=5))
        store.set("k", "v")
        assert store.get("k") == b"v"
        proc.send_signal(stop)
        assert proc.wait(10) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()


def test_elastix_store_command_reports_a_taken_port(master):
    result = subprocess.run([store_command(), "--port", str(master.port)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert str(master.port) in result.stderr and "in use" in result.stderr


def test_elastix_store_help_and_the_elastix_store_subcommand():
    result = subprocess.run([store_command(), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "--port" in result.stdout
    result = subprocess.run(
        [sys.executable, "-m", "elastix", "store", "--help"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0 and "--max-connections" in result.stdout


def _open_connections(metrics_port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return int(
        float(next(line.split()[1] for line in text.splitlines() if line.startswith("elastix_store_connections ")))
    )


def test_connections_closed_on_errors_are_said_once_a_minute_per_address():
    """2,000 connections cut in the middle of a request (churn, or a stranger) are 2,000
    errors, counted, and one WARN line for their one address; the server goes on serving."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2000
    if soft < want + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, want + 200), hard))
    count = min(want, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 200)
    proc, port = start_store("--port", "0", "--host", "127.0.0.1", "--log-level", "warn", "--metrics-port", "0")
    try:
        metrics_port = int(proc.stdout.readline().rsplit(":", 1)[1].split("/")[0])
        socks = []
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"\x00")  # the first byte of a request, and no more
            socks.append(sock)
        for sock in socks:
            sock.close()
        deadline = time.monotonic() + 30
        while _open_connections(metrics_port) > 0:  # every close handled
            assert time.monotonic() < deadline, "the server did not notice the closed connections"
            time.sleep(0.05)
        store = elastix.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=10))
        store.set("still", "served")
        assert store.get("still") == b"served"
        del store
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
    finally:
        proc.kill()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    warned = [line for line in err.splitlines() if "WARN" in line and "closing" in line]
    assert len(warned) == 1, f"{len(warned)} lines for {count} closed connections:\n" + "\n".join(warned[:5])
    assert "connection closed in the middle of a request" in warned[0] and "once a minute per address" in warned[0]
