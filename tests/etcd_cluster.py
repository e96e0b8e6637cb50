"""A real etcd cluster for tests: members on 127.0.0.1 ports with data in a temporary
directory, started and stopped by the test. Uses Debian's `etcd-server` package (`etcd` on
PATH; `.ci/run` installs it), driven through etcd's JSON gateway. Elections are made fast by
default (50 ms heartbeats, 500 ms election timeout) so that a killed leader is replaced within a
second; a benchmark that loads the members' cores gives etcd's own timing instead."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request


def _held_ports(n: int) -> list[socket.socket]:
    """`n` ports held for the cluster's lifetime by bound, non-listening sockets: etcd (Go sets
    SO_REUSEADDR) can bind them, nobody else can, and a member restarted later finds its ports
    still free."""
    holders = []
    for _ in range(n):
        holder = socket.socket()
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        holders.append(holder)
    return holders


class Tls:
    """A CA, and a server certificate for 127.0.0.1 and a client certificate it signed, made
    with openssl in `directory`."""

    def __init__(self, directory):
        self.ca, self.cert, self.key = (
            os.path.join(directory, name) for name in ("ca.pem", "server.pem", "server.key")
        )
        self.client_cert, self.client_key = (os.path.join(directory, name) for name in ("client.pem", "client.key"))
        client_csr = os.path.join(directory, "client.csr")
        client_ext = os.path.join(directory, "client.ext")
        with open(client_ext, "w") as f:
            f.write("extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n")
        ca_key = os.path.join(directory, "ca.key")
        csr = os.path.join(directory, "server.csr")
        ext = os.path.join(directory, "san.ext")
        with open(ext, "w") as f:
            f.write("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
        ca_subject = ["-subj", "/CN=elastix test CA", "-addext", "basicConstraints=critical,CA:TRUE"]
        ca_usage = ["-addext", "keyUsage=critical,keyCertSign,cRLSign"]
        sign_args = ["-out", self.cert, "-days", "1", "-extfile", ext]
        for argv in (
            [
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                ca_key,
                "-out",
                self.ca,
                *ca_subject,
                *ca_usage,
            ],
            ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", self.key, "-out", csr, "-subj", "/CN=127.0.0.1"],
            ["x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", ca_key, "-CAcreateserial", *sign_args],
            [
                *("req", "-newkey", "rsa:2048", "-nodes", "-keyout", self.client_key),
                *("-out", client_csr, "-subj", "/CN=elastix agent"),
            ],
            [
                *("x509", "-req", "-in", client_csr, "-CA", self.ca, "-CAkey", ca_key, "-CAcreateserial"),
                *("-out", self.client_cert, "-days", "1", "-extfile", client_ext),
            ],
        ):
            subprocess.run(["openssl", *argv], check=True, capture_output=True, timeout=60)


class EtcdCluster:
    def __init__(
        self,
        data_dir,
        members: int = 3,
        extra_args: tuple[str, ...] = (),
        tls: Tls | None = None,
        client_certs: bool = False,
        client_host: str = "127.0.0.1",
        elections_ms: tuple[int, int] = (50, 500),
    ):
        """`client_certs`: clients must show a certificate signed by the TLS CA (mutual TLS).
        `client_host`: an address clients reach the members at besides 127.0.0.1 (the
        gateway of namespace hosts). `elections_ms`: the members' heartbeat interval and
        election timeout."""
        self.client_host = client_host
        self.elections_ms = elections_ms
        self.etcd = shutil.which("etcd")
        if self.etcd is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        self._holders = _held_ports(2 * members)
        ports = [holder.getsockname()[1] for holder in self._holders]
        self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.names = [f"m{i}" for i in range(members)]
        self.data_dir = data_dir
        self.tls = tls
        self.scheme = "https" if tls else "http"
        self.extra_args = (*extra_args, "--cert-file", tls.cert, "--key-file", tls.key) if tls else extra_args
        self.client_certs = client_certs
        if client_certs:
            assert tls is not None, "client certificates need TLS"
            self.extra_args = (*self.extra_args, "--client-cert-auth", "--trusted-ca-file", tls.ca)
        self.procs: dict[int, subprocess.Popen | None] = {}
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports))
        self._initial = initial
        try:
            for i in range(members):
                self.start(i, state="new")
            self.wait_healthy()
        except BaseException:  # a cluster that never formed: its members are still ours to stop
            self.close()
            raise

    @property
    def endpoints(self) -> str:
        return ",".join(f"{self.client_host}:{port}" for port in self.client_ports)

    def start(self, i: int, state: str = "existing") -> None:
        client, peer = self.client_ports[i], self.peer_ports[i]
        log = open(os.path.join(self.data_dir, f"{self.names[i]}.log"), "a")
        self.procs[i] = subprocess.Popen(
            [
                self.etcd,
                *("--name", self.names[i], "--data-dir", os.path.join(self.data_dir, self.names[i])),
                *("--listen-client-urls", self._client_urls(client)),
                *("--advertise-client-urls", f"{self.scheme}://{self.client_host}:{client}"),
                *("--listen-peer-urls", f"http://127.0.0.1:{peer}"),
                *("--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}"),
                *("--initial-cluster", self._initial, "--initial-cluster-state", state),
                *("--initial-cluster-token", os.path.basename(str(self.data_dir))),
                *("--heartbeat-interval", str(self.elections_ms[0])),
                *("--election-timeout", str(self.elections_ms[1])),
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def _client_urls(self, port: int) -> str:
        hosts = dict.fromkeys(["127.0.0.1", self.client_host])
        return ",".join(f"{self.scheme}://{host}:{port}" for host in hosts)

    def _call(self, i: int, path: str, body: dict) -> dict | None:
        """etcd's JSON gateway on member i (None if it does not answer)."""
        request = urllib.request.Request(
            f"{self.scheme}://127.0.0.1:{self.client_ports[i]}/v3/{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            context = ssl.create_default_context(cafile=self.tls.ca) if self.tls else None
            if context is not None and self.client_certs:
                context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
            with urllib.request.urlopen(request, timeout=5, context=context) as response:
                return json.load(response)
        except (OSError, ValueError):
            return None

    def _any(self, path: str, body: dict) -> dict:
        for i, proc in self.procs.items():
            if proc is not None and proc.poll() is None:
                answer = self._call(i, path, body)
                if answer is not None:
                    return answer
        raise RuntimeError("no etcd member answers")

    def status(self, i: int) -> dict | None:
        return self._call(i, "maintenance/status", {})

    def put(self, key: bytes, value: bytes) -> None:
        self._any("kv/put", {"key": _b64(key), "value": _b64(value)})

    def compact(self) -> int:
        """Writes a key, then drops the history up to that write's revision; returns it."""
        revision = int(self._any("kv/put", {"key": _b64(b"/compaction-mark"), "value": ""})["header"]["revision"])
        self._any("kv/compaction", {"revision": revision, "physical": True})
        return revision

    def keys(self) -> list[bytes]:
        """Every key in the cluster."""
        answer = self._any("kv/range", {"key": _b64(b"\0"), "range_end": _b64(b"\0"), "keys_only": True})
        return [base64.b64decode(kv["key"]) for kv in answer.get("kvs", [])]

    def leader(self, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, proc in self.procs.items():
                if proc is None or proc.poll() is not None:
                    continue
                status = self.status(i)
                if status and "leader" in status and status["header"]["member_id"] == status["leader"]:
                    return i
            time.sleep(0.1)
        raise RuntimeError("the etcd cluster has no leader")

    def wait_healthy(self, timeout: float = 30) -> None:
        self.leader(timeout)

    def kill(self, i: int) -> None:
        proc = self.procs.get(i)
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            self.procs[i] = None

    def close(self) -> None:
        for i in list(self.procs):
            self.kill(i)
        for holder in self._holders:
            holder.close()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
