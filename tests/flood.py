"""A stranger without the job secret who floods a job's listening ports, as tests and benchmarks
need one. It keeps up to ``--per-port`` silent connections open to every target (reopening
those the server closes, at most ``--rate`` new connections a second in all), so that a server
that counted them against its capacity, its descriptors or its pending handshakes would run
out. Targets are ``host:port`` arguments, and/or every TCP port listening in the network
namespaces named by ``--scan`` (read with ``ss``, again every second: listeners come and go, as a
port scan would find them), less loopback-only ones.

    python tests/flood.py --scan NS1,NS2 --per-port 1200 --until STOPFILE --deadline 300 --stats out.json
    python tests/flood.py 127.0.0.1:29400 --source 127.0.0.2 --per-port 2000 --until STOPFILE
    python tests/flood.py --scan NS1 --say 00 --rate 600 --until STOPFILE   # one byte, then silence

With ``--say HEX`` every connection sends those bytes once it is open, then stalls: one byte
below 0x80 looks like the start of a plain torch client's request.

Every loop is bounded: it ends when the stop file appears or the deadline passes. What it did
(connections opened, closed by the servers, failed; the targets found) is in ``--stats``,
rewritten every second and at the end.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import selectors
import socket
import subprocess
import time
from typing import Dict, List, Set, Tuple

Target = Tuple[str, int]


def listening_ports(namespace: str) -> Set[Target]:
    """(address, port) of every TCP listener in `namespace` reachable from outside it."""
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "ss", "-Hltn4"], capture_output=True, text=True, timeout=10
    ).stdout
    own = subprocess.run(
        ["ip", "-n", namespace, "-4", "-o", "addr", "show", "dev", "eth0"], capture_output=True, text=True, timeout=10
    ).stdout.split()
    addr = next((word.split("/")[0] for word in own if "/" in word), None)
    found = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        host, _, port = fields[3].rpartition(":")
        if host.startswith("127.") or addr is None:
            continue
        found.add((addr if host in ("0.0.0.0", "*") else host, int(port)))
    # dual-stack listeners ([::]) show under IPv6 only
    out6 = subprocess.run(
        ["ip", "netns", "exec", namespace, "ss", "-Hltn6"], capture_output=True, text=True, timeout=10
    ).stdout
    for line in out6.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[3].startswith(("[::]:", "*:")) and addr is not None:
            found.add((addr, int(fields[3].rpartition(":")[2])))
    return found


class Flood:
    def __init__(self, per_port: int, rate: float, sources: List[str], say: bytes = b"") -> None:
        self.per_port = per_port
        self.rate = rate
        self.sources = sources or [""]
        self.say = say
        self.pending: Set[socket.socket] = set()  # connecting, with something to say
        self.sel = selectors.DefaultSelector()
        self.open: Dict[Target, Set[socket.socket]] = {}
        self.stats = {"opened": 0, "closed_by_server": 0, "failed": 0, "targets": []}
        self._next_source = 0

    def _connect(self, target: Target) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        source = self.sources[self._next_source % len(self.sources)]
        self._next_source += 1
        try:
            if source:
                sock.bind((source, 0))
            sock.setblocking(False)
            err = sock.connect_ex(target)
        except OSError:
            sock.close()
            self.stats["failed"] += 1
            return
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self.stats["failed"] += 1
            return
        self.open.setdefault(target, set()).add(sock)
        if self.say:
            self.pending.add(sock)
            self.sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, target)
        else:
            self.sel.register(sock, selectors.EVENT_READ, target)
        self.stats["opened"] += 1

    def _drop(self, sock: socket.socket, target: Target) -> None:
        self.pending.discard(sock)
        self.sel.unregister(sock)
        self.open[target].discard(sock)
        sock.close()

    def write(self, path: str) -> None:
        with open(path + ".tmp", "w") as f:
            json.dump({**self.stats, "targets": [f"{h}:{p}" for h, p in self.stats["targets"]]}, f)
        os.replace(path + ".tmp", path)

    def run(self, targets_of, until: str, deadline: float, stats: str = "") -> None:
        end = time.monotonic() + deadline
        targets: Set[Target] = set()
        refreshed = 0.0
        budget = 0.0
        last = time.monotonic()
        while time.monotonic() < end and not os.path.exists(until):
            now = time.monotonic()
            if now - refreshed > 1.0:
                targets = targets_of()
                refreshed = now
                for target in targets - set(self.stats["targets"]):
                    self.stats["targets"].append(target)
                if stats:
                    self.write(stats)  # progress, for whoever waits on the flood
            budget = min(budget + (now - last) * self.rate, self.rate)
            last = now
            for target in sorted(targets):
                missing = self.per_port - len(self.open.get(target, ()))
                while missing > 0 and budget >= 1:
                    self._connect(target)
                    missing -= 1
                    budget -= 1
            for key, events in self.sel.select(0.02):
                sock, target = key.fileobj, key.data
                if events & selectors.EVENT_WRITE and sock in self.pending:
                    self.pending.discard(sock)  # type: ignore[arg-type]
                    try:
                        sock.send(self.say)  # type: ignore[union-attr]
                        self.sel.modify(sock, selectors.EVENT_READ, target)
                    except OSError:
                        self.stats["closed_by_server"] += 1
                        self._drop(sock, target)  # type: ignore[arg-type]
                    continue
                try:
                    data = sock.recv(4096)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # the server closed it (or refused the connection)
                    self.stats["closed_by_server"] += 1
                    self._drop(sock, target)  # type: ignore[arg-type]
        for target, socks in self.open.items():
            for sock in list(socks):
                self._drop(sock, target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="*", help="host:port to flood")
    parser.add_argument("--scan", default="", help="network namespaces whose listeners to flood (comma-separated)")
    parser.add_argument("--source", action="append", default=[], help="local address to connect from (repeatable)")
    parser.add_argument("--per-port", type=int, default=1200)
    parser.add_argument("--rate", type=float, default=1000.0, help="new connections a second, in all")
    parser.add_argument("--until", required=True, help="stop once this file exists")
    parser.add_argument("--deadline", type=float, default=300.0, help="stop after this many seconds anyway")
    parser.add_argument("--stats", help="write the counts here (JSON) at the end")
    parser.add_argument("--say", default="", help="bytes (hex) each connection sends once open, then stalls")
    args = parser.parse_args()
    given = {(host, int(port)) for host, _, port in (t.rpartition(":") for t in args.targets)}
    namespaces = [ns for ns in args.scan.split(",") if ns]

    def targets_of() -> Set[Target]:
        found = set(given)
        for namespace in namespaces:
            found |= listening_ports(namespace)
        return found

    flood = Flood(args.per_port, args.rate, args.source, bytes.fromhex(args.say))
    try:
        flood.run(targets_of, args.until, args.deadline, args.stats or "")
    finally:
        if args.stats:
            flood.write(args.stats)


if __name__ == "__main__":
    main()
