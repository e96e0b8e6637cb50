"""TCP connections between ranks of a group on different hosts.

Every rank listens on a port chosen by the kernel and publishes ``host:port`` in the group's
store; a connection between two ranks is made the first time they talk, by the lower rank
(the higher one accepts, and files connections that arrive for other pairs meanwhile). Each
message of a collective starts with a 128-byte header (magic + the sender's descriptor), which
the receiver compares with its own: ranks that disagree raise ``MismatchError``.

Large transfers are queued to a sender thread (``sendall`` releases the GIL), so a rank sends
to its right neighbour while it receives from its left one and reduces what arrived. A peer
that closes its connection (it died or failed) is an EOF here, a ``PeerError`` naming it; a
peer that sends nothing is a ``CollectiveTimeoutError`` after the group's timeout. Any error
breaks the group: this rank closes its connections, so the peers fail fast too.
"""

from __future__ import annotations

import os
import queue
import socket
import struct
import threading
import time
from typing import Dict, List, Optional, Sequence

from .errors import CollectiveError, CollectiveTimeoutError, MismatchError, PeerError

MAGIC = 0x454C4153_54495843  # "ELASTIXC"
HELLO = struct.Struct("<QQ")
HEADER = struct.Struct("<QQ14q")
INLINE_BYTES = 64 << 10  # sends up to this size fit in socket buffers: sent from the caller


def local_address() -> str:
    """The address peers reach this rank at: ELASTIX_COLLECTIVES_ADDR, else the source
    address of the route to MASTER_ADDR, else this host's name."""
    override = os.environ.get("ELASTIX_COLLECTIVES_ADDR")
    if override:
        return override
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            family = socket.AF_INET6 if ":" in master else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostname()


class Ticket:
    """Completion of queued sends."""

    __slots__ = ("_event", "error")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.error: Optional[BaseException] = None


class TcpComm:
    def __init__(self, store, me: int, ranks: Sequence[int], timeout: Optional[float]):
        self.store = store
        self.me = me
        self.ranks = list(ranks)  # global ranks of the group, for messages
        self.timeout = timeout
        self.broken: Optional[str] = None
        addr = local_address()
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((addr, 0))
        self.listener.listen(256)
        port = self.listener.getsockname()[1]
        store.set(f"tcp/addr/{me}", f"{addr}|{port}")
        self._conn_store = store.clone()  # connections may be made from the send thread
        self.conns: Dict[int, socket.socket] = {}
        self._stash: Dict[int, socket.socket] = {}
        self._queue: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.RLock()

    # -- connections ------------------------------------------------------------------------

    def _deadline(self) -> Optional[float]:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def conn(self, peer: int) -> socket.socket:
        sock = self.conns.get(peer)
        if sock is not None:
            return sock
        with self._lock:
            sock = self.conns.get(peer)
            if sock is not None:
                return sock
            return self._make_conn(peer)

    def _make_conn(self, peer: int) -> socket.socket:
        self.check_usable()
        if peer == self.me:
            raise ValueError("a rank has no connection to itself")
        if self.me < peer:
            sock = self._connect(peer)
        else:
            sock = self._accept(peer)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout)
        self.conns[peer] = sock
        return sock

    def _connect(self, peer: int) -> socket.socket:
        host, port = self._conn_store.get(f"tcp/addr/{peer}").decode().rsplit("|", 1)
        deadline = self._deadline()
        delay = 0.01
        while True:
            try:
                left = None if deadline is None else max(0.1, deadline - time.monotonic())
                sock = socket.create_connection((host, int(port)), timeout=left)
                sock.sendall(HELLO.pack(MAGIC, self.me))
                return sock
            except OSError as err:
                if deadline is not None and time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"cannot connect to rank {self.ranks[peer]} at {host}:{port}: {err}", [self.ranks[peer]]
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _accept(self, peer: int) -> socket.socket:
        deadline = self._deadline()
        while peer not in self._stash:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise CollectiveTimeoutError(
                    f"rank {self.ranks[peer]} did not connect within {self.timeout:.1f} s", [self.ranks[peer]]
                )
            self.listener.settimeout(left)
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                continue
            sock.settimeout(self.timeout)
            try:
                magic, who = HELLO.unpack(self._recv_exact(sock, HELLO.size, None))
            except (OSError, CollectiveError):
                sock.close()
                continue
            if magic != MAGIC or not 0 <= who < len(self.ranks):
                sock.close()
                continue
            self._stash[who] = sock
        return self._stash.pop(peer)

    # -- sending ------------------------------------------------------------------------------

    def _sender(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            peer, views, ticket, last = item
            if ticket.error is None:
                try:
                    sock = self.conns[peer]
                    for view in views:
                        sock.sendall(view)
                except BaseException as err:
                    ticket.error = err
            if last:
                ticket._event.set()

    def send(self, peer: int, views: Sequence, ticket: Optional[Ticket] = None, last: bool = True) -> None:
        """Sends ``views`` (bytes-like) to ``peer``: inline when small and no ticket is given,
        else through the sender thread (``ticket`` completes when ``last`` is sent)."""
        sock = self.conn(peer)
        if ticket is None:
            try:
                for view in views:
                    sock.sendall(view)
            except OSError as err:
                self._raise_io(peer, err, "sending to")
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._sender, name="elastix-tcp-sender", daemon=True)
            self._thread.start()
        self._queue.put((peer, views, ticket, last))

    def wait(self, ticket: Ticket, peer_hint: Optional[int] = None) -> None:
        deadline = self._deadline()
        while not ticket._event.wait(0.05):
            if deadline is not None and time.monotonic() > deadline:
                self.abort("send timed out")
                raise CollectiveTimeoutError(
                    "timed out sending", [self.ranks[peer_hint]] if peer_hint is not None else []
                )
        if ticket.error is not None:
            self._raise_io(peer_hint, ticket.error, "sending to")

    # -- receiving ----------------------------------------------------------------------------

    def _recv_exact(self, sock: socket.socket, n: int, peer: Optional[int]) -> bytes:
        buf = bytearray(n)
        self._recv_into_sock(sock, memoryview(buf), peer)
        return bytes(buf)

    def _recv_into_sock(self, sock: socket.socket, view: memoryview, peer: Optional[int]) -> None:
        got, n = 0, len(view)
        while got < n:
            try:
                k = sock.recv_into(view[got:])
            except socket.timeout:
                who = "a peer" if peer is None else f"rank {self.ranks[peer]}"
                message = f"timed out after {self.timeout:.1f} s waiting for data from {who}"
                self.abort(message)
                raise CollectiveTimeoutError(message, [] if peer is None else [self.ranks[peer]]) from None
            except OSError as err:
                self._raise_io(peer, err, "receiving from")
            if k == 0:
                who = "a peer" if peer is None else f"rank {self.ranks[peer]}"
                message = f"{who} closed its connection (it exited or failed)"
                self.abort(message)
                raise PeerError(message, None if peer is None else self.ranks[peer])
            got += k

    def recv_into(self, peer: int, view) -> None:
        mv = memoryview(view).cast("B") if not isinstance(view, memoryview) else view
        if len(mv):
            self._recv_into_sock(self.conn(peer), mv, peer)

    # -- headers ------------------------------------------------------------------------------

    @staticmethod
    def header(desc: List[int]) -> bytes:
        return HEADER.pack(MAGIC, 0, *desc)

    def check_header(self, peer: int, desc: List[int], what: str) -> None:
        raw = self._recv_exact(self.conn(peer), HEADER.size, peer)
        fields = HEADER.unpack(raw)
        if fields[0] != MAGIC:
            self.abort("garbled stream")
            raise CollectiveError(f"{what}: garbled data from rank {self.ranks[peer]}")
        theirs = list(fields[2:])
        if theirs != list(desc):
            from .descriptor import describe

            message = (
                f"{what}: rank {self.ranks[self.me]} called {describe(desc)} but rank "
                f"{self.ranks[peer]} called {describe(theirs)}"
            )
            self.abort(message)
            raise MismatchError(message)

    # -- failure ------------------------------------------------------------------------------

    def _raise_io(self, peer: Optional[int], err: BaseException, doing: str) -> None:
        who = "a peer" if peer is None else f"rank {self.ranks[peer]}"
        if isinstance(err, CollectiveError):
            raise err
        if isinstance(err, socket.timeout):
            message = f"timed out {doing} {who}"
            self.abort(message)
            raise CollectiveTimeoutError(message, [] if peer is None else [self.ranks[peer]]) from None
        message = f"connection to {who} failed while {doing} it ({err}); it probably exited or failed"
        self.abort(message)
        raise PeerError(message, None if peer is None else self.ranks[peer]) from None

    def check_usable(self) -> None:
        if self.broken is not None:
            raise CollectiveError(
                f"this group is unusable after an earlier failure ({self.broken}); destroy it and create a new one"
            )

    def abort(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
        for sock in list(self.conns.values()) + list(self._stash.values()):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None
        for sock in list(self.conns.values()) + list(self._stash.values()) + [self.listener]:
            try:
                sock.close()
            except OSError:
                pass
        self.conns.clear()
        self._stash.clear()


__all__ = ["TcpComm", "Ticket", "INLINE_BYTES", "local_address"]
