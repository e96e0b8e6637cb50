"""Simulated hosts for fault tests: network namespaces joined by a bridge, as machines on one
switch. Host i has the address `Hosts.addr(i)` on its own veth; `cut(i)` takes its link down
(a partition: packets are dropped, nothing is refused) and `heal(i)` brings it back; `kill(i)`
kills every process on it. This machine itself is `Hosts.gateway` on the switch.

Partitions as firewalls make them (iptables in a host's namespace): `firewall(i, others, how)`
cuts host i off from `others` by dropping their packets, or by rejecting them with TCP resets
or ICMP port-unreachable (the answers let through: the far side sees "connection refused", as
from a dead agent); `no_new_connections(i, to)` is a one-way cut (i cannot open a connection
to `to`, which can still open one to i); `open_firewall(i)` heals.

Slow links as a bad cable or switch port makes them (tc in and outside a host's namespace):
`slow_link(i, how)` delays every packet to and from host i by 25 ms each way ("delay", netem:
50 ms a round trip) or holds it to 16 Mbit/s ("throttle", a token bucket); `Hosts.qdisc_missing`
says where the kernel lacks the one asked for.

Needs root and `ip` (iproute2), and `iptables` for the firewalls; `Hosts.available()` and
`Hosts.firewalls_available()` say why not where they are missing."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from typing import Iterator

# how `Hosts.slow_link` slows a link: tc's queueing disciplines
SLOW_LINKS = {
    "delay": ("netem", "delay", "25ms"),
    "throttle": ("tbf", "rate", "16mbit", "burst", "32kbit", "latency", "1s"),
}


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _free_tag() -> str:
    """A tag no link, namespace or subnet here uses yet. A namespace deleted by an earlier test
    can outlive it (its sockets still retransmit to a cut peer), and keeps its veth's name in
    this namespace for minutes: a tag drawn again would collide with it."""
    for _ in range(20):
        tag = secrets.token_hex(3)
        taken = _ip("-o", "link", "show") + _ip("netns", "list") + _ip("-4", "-o", "addr", "show")
        if tag not in taken and f" {_subnet_of(tag)}." not in taken:
            return tag
    raise RuntimeError("no free tag for simulated hosts in 20 draws")


def _subnet_of(tag: str) -> str:
    return f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"


class Hosts:
    def __init__(self, count: int):
        tag = _free_tag()
        self._subnet = _subnet_of(tag)
        self.bridge = f"elxbr{tag}"
        self.names = [f"elx{tag}h{i}" for i in range(count)]
        self._veths = [f"elx{tag}v{i}" for i in range(count)]
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name, veth, i in zip(self.names, self._veths, range(count)):
                _ip("netns", "add", name)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", name, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def available() -> str | None:
        """None where namespaces can be made here, else why not."""
        if shutil.which("ip") is None:
            return "the ip command (iproute2) is not installed"
        if os.geteuid() != 0:
            return "network namespaces need root"
        probe = f"elxprobe{secrets.token_hex(2)}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    def addr(self, i: int) -> str:
        return f"{self._subnet}.{i + 1}"

    @property
    def gateway(self) -> str:
        """This machine's own address on the hosts' switch: a service the test runs outside the
        hosts (an etcd cluster) listens there for them."""
        return f"{self._subnet}.254"

    def command(self, i: int, *argv: str) -> list[str]:
        """argv run on host i (the process keeps the pid of `ip netns exec`, which execs)."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def python(self, i: int, *argv: str) -> list[str]:
        return self.command(i, sys.executable, *argv)

    def cut(self, i: int) -> None:
        _ip("link", "set", self._veths[i], "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self._veths[i], "up")

    @staticmethod
    def firewalls_available() -> str | None:
        """None where firewalls can be set in the hosts here, else why not."""
        return None if shutil.which("iptables") else "the iptables command is not installed"

    def _iptables(self, i: int, *rule: str) -> None:
        subprocess.run(
            ["ip", "netns", "exec", self.names[i], "iptables", *rule], check=True, capture_output=True, timeout=20
        )

    def firewall(self, i: int, others, how: str = "drop") -> None:
        """Host i's firewall cuts it off from hosts `others`, both ways: `how` is "drop"
        (silence), "tcp-reset" or "icmp" (every TCP packet rejected, the answer let through)."""
        answer = {"tcp-reset": "tcp-reset", "icmp": "icmp-port-unreachable"}
        verdict = ["-j", "DROP"] if how == "drop" else ["-j", "REJECT", "--reject-with", answer[how]]
        # a reset is an answer: rejecting it would silence the cut
        match = [] if how == "drop" else ["-p", "tcp", "!", "--tcp-flags", "RST", "RST"]
        for j in others:
            self._iptables(i, "-A", "INPUT", "-s", self.addr(j), *match, *verdict)
            self._iptables(i, "-A", "OUTPUT", "-d", self.addr(j), *match, *verdict)

    def no_new_connections(self, i: int, to: int) -> None:
        """A one-way cut: host i cannot open a connection to host `to` (refused at once); `to`
        can still open one to i, and connections already open go on."""
        self._iptables(
            i, "-A", "OUTPUT", "-d", self.addr(to), "-p", "tcp", "--syn", "-j", "REJECT", "--reject-with", "tcp-reset"
        )

    def open_firewall(self, i: int) -> None:
        self._iptables(i, "-F")

    @staticmethod
    def qdisc_missing(how: str) -> str | None:
        """None where `slow_link(_, how)` can be made here, else why not."""
        if shutil.which("tc") is None:
            return "the tc command (iproute2) is not installed"
        probe = f"elxq{secrets.token_hex(2)}"
        _ip("link", "add", probe, "type", "veth", "peer", "name", f"{probe}p")
        try:
            tried = subprocess.run(["tc", "qdisc", "add", "dev", probe, "root", *SLOW_LINKS[how]], capture_output=True,
                                   text=True, timeout=20)  # fmt: skip
        finally:
            _ip("link", "del", probe)
        return (
            None if tried.returncode == 0 else f"this kernel has no {SLOW_LINKS[how][0]} qdisc: {tried.stderr.strip()}"
        )

    def slow_link(self, i: int, how: str) -> None:
        """Host i's link slowed both ways: its side (in its namespace) and the switch's."""
        tc = ["tc", "qdisc", "add", "dev"]
        subprocess.run([*tc, self._veths[i], "root", *SLOW_LINKS[how]], check=True, capture_output=True, timeout=20)
        subprocess.run(self.command(i, *tc, "eth0", "root", *SLOW_LINKS[how]), check=True, capture_output=True,
                       timeout=20)  # fmt: skip

    def kill(self, i: int) -> list[int]:
        """Kills host i as a power loss would its software: SIGKILL to every process in its
        namespace at once (agent, workers, any store it serves). Returns their pids."""
        found = subprocess.run(["ip", "netns", "pids", self.names[i]], capture_output=True, text=True, timeout=20)
        pids = [int(pid) for pid in found.stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        return pids

    def close(self) -> None:
        # the veths go first: a namespace can outlive its deletion (see _free_tag), its veth
        # with it, and deleting one end of a pair deletes both
        for veth in self._veths:
            subprocess.run(["ip", "link", "del", veth], capture_output=True)
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def hosts_for_a_test(count: int) -> Iterator[Hosts]:
    """`count` simulated hosts for one test (a fixture's body): the test is skipped, saying
    why, where namespaces cannot be made (fails, where CI requires them: tests/requirements.py),
    and the hosts are removed after it."""
    from requirements import need

    need("namespaces", Hosts.available())
    hosts = Hosts(count)
    yield hosts
    hosts.close()
