"""Which ranks of a group share a host (and so can share memory), from their own reports.

The hierarchy is chosen from the group's members, not from LOCAL_WORLD_SIZE: every member
publishes an identity of the memory domain it runs in, and ranks with equal identities are
"local" to each other. The identity is the boot id, the /dev/shm mount and the pid namespace,
so containers that do not share /dev/shm or pids count as different hosts.
``ELASTIX_COLLECTIVES_HOST_ID`` overrides it (to force TCP between processes of one machine).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Dict, List, Sequence


def host_id() -> str:
    override = os.environ.get("ELASTIX_COLLECTIVES_HOST_ID")
    if override:
        return override
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    for path in ("/dev/shm", "/proc/self/ns/pid"):
        try:
            st = os.stat(path)
            parts.append(f"{st.st_dev}:{st.st_ino}")
        except OSError:
            parts.append("-")
    return "/".join(parts)


@dataclass(frozen=True)
class Topology:
    """``hosts[h]`` lists the group ranks on host h (ascending); hosts are ordered by their
    lowest rank. ``host_of[r]`` is rank r's host; its leader is ``hosts[h][0]``."""

    hosts: List[List[int]]
    host_of: List[int]

    @classmethod
    def from_ids(cls, ids: Sequence[str]) -> "Topology":
        index: Dict[str, int] = {}
        hosts: List[List[int]] = []
        host_of: List[int] = []
        for rank, hid in enumerate(ids):
            if hid not in index:
                index[hid] = len(hosts)
                hosts.append([])
            hosts[index[hid]].append(rank)
            host_of.append(index[hid])
        return cls(hosts, host_of)

    @property
    def leaders(self) -> List[int]:
        return [h[0] for h in self.hosts]

    def local(self, rank: int) -> List[int]:
        return self.hosts[self.host_of[rank]]

    def same_host(self, a: int, b: int) -> bool:
        return self.host_of[a] == self.host_of[b]

    @property
    def mode(self) -> str:
        """'single' (one rank), 'shm' (one host), 'tcp' (one rank per host) or 'hier'."""
        if len(self.host_of) == 1:
            return "single"
        if len(self.hosts) == 1:
            return "shm"
        if all(len(h) == 1 for h in self.hosts):
            return "tcp"
        return "hier"


__all__ = ["host_id", "Topology"]
