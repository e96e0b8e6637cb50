"""The ``cpu`` backend: shared memory between ranks of a host, TCP between hosts.

At creation every member publishes its host identity and pid in the group's store and reads
everyone's; the topology decides the mode:
  single  one rank: nothing to exchange;
  shm     one host: every collective is a lock-step over one shared segment (shm_algos);
  tcp     one rank per host: rings and direct transfers over TCP (tcp_algos);
  hier    both: all_reduce, reduce, broadcast, barrier and all_gather run in shared memory
          inside each host and over TCP between the hosts' leaders (lowest rank of each host);
          the others are built from those (see the methods).
send/recv use a shared-memory channel between ranks of one host and TCP otherwise.
Ranks here are group ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator, Optional, Sequence

import numpy as np

from . import _native, shm_algos, shm_segment, tcp_algos
from .mismatch import MismatchRecord
from .shm_comm import ABORT_DESTROYED, ABORT_ERROR, ShmComm, default_slot_bytes, segment_bytes
from .shm_p2p import HEADER as P2P_HEADER
from .shm_p2p import MAGIC as P2P_MAGIC
from .shm_p2p import ShmP2P
from .shm_segment import Segment
from .tcp_comm import TcpComm
from .topology import Topology, host_id

_U8 = np.dtype(np.uint8)


class CpuBackend:
    name = "cpu"

    def __init__(self, store, rank: int, size: int, ranks: Sequence[int], timeout: Optional[float]):
        self.store = store
        self.rank = rank
        self.size = size
        self.ranks = list(ranks)
        self.timeout = timeout
        self.shm: Optional[ShmComm] = None
        self.tcp: Optional[TcpComm] = None
        self.p2p: Optional[ShmP2P] = None
        self.segment: Optional[Segment] = None
        self.shared_calls = 0  # shared_empty calls so far
        store.set(f"info/{rank}", json.dumps({"host": host_id(), "pid": os.getpid()}))
        infos = (
            [json.loads(v) for v in store.multi_get([f"info/{r}" for r in range(size)])]
            if size > 1
            else [json.loads(store.get("info/0"))]
        )
        self.pids = [int(i["pid"]) for i in infos]
        self.topo = Topology.from_ids([i["host"] for i in infos])
        self.mode = self.topo.mode
        self.local = self.topo.local(rank)
        self.leaders = self.topo.leaders
        # over TCP a mismatch breaks the group: its cause is left here for every rank to read
        self.record = MismatchRecord(store) if len(self.topo.hosts) > 1 else None
        if len(self.local) > 1:
            self._setup_shm()
            self.p2p = ShmP2P(store, rank, self.ranks, {r: self.pids[r] for r in self.local}, timeout)
        if len(self.topo.hosts) > 1:
            self.tcp = TcpComm(store, rank, self.ranks, timeout, self.record)

    def _setup_shm(self) -> None:
        local = self.local
        me = local.index(self.rank)
        host = self.topo.host_of[self.rank]
        slot = default_slot_bytes()
        key = f"shm/{host}"
        if me == 0:
            seg = shm_segment.create(segment_bytes(len(local), slot))
            self.store.set(key, seg.encode())
        else:
            seg = shm_segment.attach(self.store.get(key))
        if self.store.add(f"{key}/attached", 1) == len(local):
            self.store.set(f"{key}/all", "1")
        if me == 0:
            self.store.wait([f"{key}/all"])
            seg.release_name()
        self.segment = seg
        self.shm = ShmComm(
            seg,
            len(local),
            me,
            [self.ranks[r] for r in local],
            [self.pids[r] for r in local],
            self.timeout,
            slot,
            self.record,
        )

    def shared_empty(self, nbytes: int) -> np.ndarray:
        """``nbytes`` (zeroed) that this host's other ranks of the group map too (see shm_shared);
        called by every rank of the group, with the same size. Where this host has no other
        rank of the group, an ordinary array."""
        if self.shm is None:
            return np.zeros(nbytes, np.uint8)
        local, me = self.local, self.shm.me
        # every call its own keys, the failed ones too (their offers must not be read again)
        self.shared_calls += 1
        key = f"shared/{self.topo.host_of[self.rank]}/{self.shared_calls}"
        own = shm_segment.create(max(nbytes, 1))
        try:
            self.store.set(f"{key}/{me}", json.dumps({"nbytes": nbytes, "handle": own.encode()}))
            keys = [f"{key}/{j}" for j in range(len(local))]
            self.store.wait(keys)
            offers = [json.loads(v) for v in self.store.multi_get(keys)]
            sizes = {int(o["nbytes"]) for o in offers}
            if len(sizes) > 1:  # every rank reads the same offers, so every rank raises this
                asked = ", ".join(f"rank {self.ranks[r]} {int(o['nbytes'])}" for r, o in zip(local, offers))
                raise ValueError(f"shared_empty: the ranks of a host asked for different sizes in bytes ({asked})")
            segments = [own if j == me else shm_segment.attach(o["handle"]) for j, o in enumerate(offers)]
            if self.store.add(f"{key}/attached", 1) == len(local):
                self.store.set(f"{key}/all", "1")
            self.store.wait([f"{key}/all"])
        finally:
            own.release_name()  # mapped by every rank now, or given up: either way no name is left
        return self.shm.shared.add(segments, nbytes)

    # -- helpers ------------------------------------------------------------------------------

    def check_usable(self) -> None:
        if self.shm is not None:
            self.shm.check_usable()
        if self.tcp is not None:
            self.tcp.check_usable()

    def _local_index(self, rank: int) -> int:
        return self.local.index(rank)

    def _leader_of(self, rank: int) -> int:
        return self.topo.local(rank)[0]

    @property
    def is_leader(self) -> bool:
        return self.local[0] == self.rank

    @contextlib.contextmanager
    def _hosts_phase(self) -> Iterator[None]:
        """The leaders' TCP phase of a hierarchical collective. If it fails, the host's other
        ranks, which wait in shared memory for their leader, fail at once too (they read a
        mismatch's cause from the group's record) rather than at the group's timeout."""
        try:
            yield
        except BaseException as err:
            if self.shm is not None:
                self.shm.abort(ABORT_ERROR, (self.tcp.broken if self.tcp else None) or str(err))
            raise

    # -- collectives (x: contiguous 1-D numpy; reductions get kernel-typed views) -------------

    def all_reduce(self, x, code, op, div, desc):
        if self.mode == "single":
            if div > 1:
                _native.reduce(code, op, [x], [x], 1)
        elif self.mode == "shm":
            shm_algos.all_reduce(self.shm, x, code, op, div, desc)
        elif self.mode == "tcp":
            tcp_algos.all_reduce(self.tcp, list(range(self.size)), x, code, op, div, desc)
        else:
            self._hier_all_reduce(x, code, op, div, desc)

    def _hier_all_reduce(self, x, code, op, div, desc, root: Optional[int] = None):
        # 1. reduce onto the host's leader, 2. all_reduce among leaders, 3. broadcast locally
        # (a host with local peers has their segment; a leader has the TCP ring)
        if len(self.local) > 1:
            assert self.shm is not None
            shm_algos.all_reduce(self.shm, x, code, op, 1, desc, root=0, what="all_reduce (host)")
        if self.is_leader:
            assert self.tcp is not None
            with self._hosts_phase():
                tcp_algos.all_reduce(self.tcp, self.leaders, x, code, op, div, desc, what="all_reduce (hosts)")
        if len(self.local) > 1:
            assert self.shm is not None
            shm_algos.broadcast(self.shm, x.view(_U8), 0, desc)

    def reduce(self, x, root, code, op, div, desc):
        if self.mode == "single":
            self.all_reduce(x, code, op, div, desc)
        elif self.mode == "shm":
            shm_algos.all_reduce(self.shm, x, code, op, div, desc, root=self._local_index(root), what="reduce")
        else:
            # the reduction on a scratch copy everywhere, kept by the root
            work = x.copy()
            self.all_reduce(work, code, op, div, desc)
            if self.rank == root:
                np.copyto(x, work)

    def broadcast(self, x, root, desc):
        if self.mode == "single":
            return
        if self.mode == "shm":
            shm_algos.broadcast(self.shm, x, self._local_index(root), desc)
        elif self.mode == "tcp":
            tcp_algos.broadcast(self.tcp, list(range(self.size)), x, root, desc)
        else:
            root_leader = self._leader_of(root)
            on_root_host = self.topo.same_host(self.rank, root)
            if on_root_host and len(self.local) > 1:
                shm_algos.broadcast(self.shm, x, self._local_index(root), desc)
            if self.is_leader:
                with self._hosts_phase():
                    tcp_algos.broadcast(self.tcp, self.leaders, x, root_leader, desc)
            if not on_root_host and len(self.local) > 1:
                shm_algos.broadcast(self.shm, x, 0, desc)

    def all_gather(self, outs, x, desc):
        if self.mode == "single":
            np.copyto(outs[0].view(_U8), x.view(_U8))
        elif self.mode == "shm":
            shm_algos.all_gather(self.shm, outs, x, desc)
        elif self.mode == "tcp":
            tcp_algos.all_gather(self.tcp, list(range(self.size)), outs, x, desc)
        else:
            self._hier_all_gather(outs, x, desc)

    def _hier_all_gather(self, outs, x, desc):
        nb = x.nbytes
        local = self.local
        # 1. gather the host's blocks on its leader
        host_block = np.empty(len(local) * nb, np.uint8)
        parts = [host_block[i * nb : (i + 1) * nb] for i in range(len(local))]
        if len(local) > 1:
            shm_algos.all_gather(self.shm, parts if self.is_leader else None, x, desc, root=0, what="all_gather (host)")
        else:
            np.copyto(parts[0], x.view(_U8))
        # 2. leaders exchange host blocks (sizes differ when hosts have different rank counts)
        everything = np.empty(self.size * nb, np.uint8)
        if self.is_leader:
            blocks = [np.empty(len(h) * nb, np.uint8) for h in self.topo.hosts]
            with self._hosts_phase():
                tcp_algos.all_gather(self.tcp, self.leaders, blocks, host_block, desc, what="all_gather (hosts)")
            for h, ranks in enumerate(self.topo.hosts):
                for i, r in enumerate(ranks):
                    everything[r * nb : (r + 1) * nb] = blocks[h][i * nb : (i + 1) * nb]
        # 3. the leader hands the whole result to its host
        if len(local) > 1:
            shm_algos.broadcast(self.shm, everything, 0, desc)
        for r in range(self.size):
            np.copyto(outs[r].view(_U8), everything[r * nb : (r + 1) * nb])

    def gather(self, outs, x, root, desc):
        if self.mode == "single":
            np.copyto(outs[0].view(_U8), x.view(_U8))
        elif self.mode == "shm":
            shm_algos.all_gather(self.shm, outs, x, desc, root=self._local_index(root), what="gather")
        elif self.mode == "tcp":
            tcp_algos.gather(self.tcp, list(range(self.size)), outs, x, root, desc)
        else:
            scratch = [np.empty(x.nbytes, np.uint8) for _ in range(self.size)]
            self._hier_all_gather(scratch, x, desc)
            if self.rank == root:
                for o, s in zip(outs, scratch):
                    np.copyto(o.view(_U8), s)

    def scatter(self, x, ins, root, desc):
        if self.mode == "single":
            np.copyto(x.view(_U8), ins[0].view(_U8))
        elif self.mode == "shm":
            shm_algos.scatter(self.shm, x, ins, self._local_index(root), desc)
        elif self.mode == "tcp":
            tcp_algos.scatter(self.tcp, list(range(self.size)), x, ins, root, desc)
        else:
            nb = x.nbytes
            everything = np.empty(self.size * nb, np.uint8)
            if self.rank == root:
                for r in range(self.size):
                    everything[r * nb : (r + 1) * nb] = ins[r].view(_U8)
            self.broadcast(everything, root, desc)
            np.copyto(x.view(_U8), everything[self.rank * nb : (self.rank + 1) * nb])

    def reduce_scatter(self, out, ins, code, op, div, desc):
        if self.mode == "single":
            _native.reduce(code, op, [ins[0]], [out], div)
        elif self.mode == "shm":
            shm_algos.reduce_scatter(self.shm, out, ins, code, op, div, desc)
        elif self.mode == "tcp":
            tcp_algos.reduce_scatter(self.tcp, list(range(self.size)), out, ins, code, op, div, desc)
        else:
            work = np.concatenate(ins) if out.size else np.empty(0, out.dtype)
            self._hier_all_reduce(work, code, op, div, desc)
            np.copyto(out, work[self.rank * out.size : (self.rank + 1) * out.size])

    def all_to_all(self, outs, ins, desc):
        if self.mode == "single":
            np.copyto(outs[0].view(_U8), ins[0].view(_U8))
        elif self.mode == "shm":
            shm_algos.all_to_all(self.shm, outs, ins, desc)
        elif self.mode == "tcp":
            tcp_algos.all_to_all(self.tcp, list(range(self.size)), outs, ins, desc)
        else:
            nb = ins[0].nbytes
            mine = np.concatenate([i.view(_U8) for i in ins]) if nb else np.empty(0, np.uint8)
            rows = [np.empty(self.size * nb, np.uint8) for _ in range(self.size)]
            self._hier_all_gather(rows, mine, desc)
            for j in range(self.size):
                np.copyto(outs[j].view(_U8), rows[j][self.rank * nb : (self.rank + 1) * nb])

    def barrier(self, desc):
        if self.mode == "single":
            return
        if self.mode == "shm":
            shm_algos.barrier(self.shm, desc)
        elif self.mode == "tcp":
            tcp_algos.barrier(self.tcp, list(range(self.size)), desc)
        else:
            if len(self.local) > 1:
                shm_algos.barrier(self.shm, desc)
            if self.is_leader:
                with self._hosts_phase():
                    tcp_algos.barrier(self.tcp, self.leaders, desc)
            if len(self.local) > 1:
                shm_algos.barrier(self.shm, desc)

    # -- point to point -------------------------------------------------------------------------

    def send(self, x, peer, desc):
        if peer == self.rank:
            raise ValueError("send to self is not supported")
        data = memoryview(x.view(_U8)) if x.size else memoryview(b"")
        if self.p2p is not None and peer in self.local:
            self.p2p.send(peer, P2P_HEADER.pack(P2P_MAGIC, 0, *desc), data)
        else:
            self.tcp.send(peer, [self.tcp.header(desc), data])

    def recv(self, x, peer, desc):
        if peer == self.rank:
            raise ValueError("recv from self is not supported")
        data = memoryview(x.view(_U8)) if x.size else memoryview(bytearray())
        if self.p2p is not None and peer in self.local:
            self.p2p.recv(peer, desc, data)
        else:
            self.tcp.check_header(peer, desc, "recv")
            self.tcp.recv_into(peer, data)

    # -- teardown -------------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Makes every collective in progress fail promptly, here and on the peers: the peers
        see this rank's abort word, the waits of this process end because the segments close
        (after which every access to them fails), TCP connections are shut."""
        if self.shm is not None:
            self.shm.abort(ABORT_DESTROYED, reason)
        if self.segment is not None:
            self.segment.close()
        if self.p2p is not None:
            self.p2p.close()
        if self.tcp is not None:
            self.tcp.abort(reason)

    def close(self) -> None:
        """Frees what is left once no collective runs any more (after ``abort``)."""
        self.abort("destroyed")
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        self.p2p = None
        if self.tcp is not None:
            self.tcp.close()
            self.tcp = None
        self.segment = None


__all__ = ["CpuBackend"]
