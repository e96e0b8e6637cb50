"""TCP connections between ranks of a group on different hosts.

Every rank listens on a port chosen by the kernel and publishes ``host:port`` in the group's
store; a connection between two ranks is made the first time they talk, by the lower rank
(the higher one's accept thread takes it, whenever it comes, and files it by rank). Each
message of a collective starts with a 128-byte header (magic + the sender's descriptor), which
the receiver compares with its own: ranks that disagree raise ``MismatchError``, and the group is
unusable afterwards (the mismatched calls' data is in flight; see ``mismatch.py``).

Large transfers are queued to a sender thread (``sendall`` releases the GIL), so a rank sends
to its right neighbour while it receives from its left one and reduces what arrived. A peer
that closes its connection (it died or failed) is an EOF here, a ``PeerError`` naming it; a
peer that sends nothing is a ``CollectiveTimeoutError`` after the group's timeout. Any error
breaks the group: this rank closes its connections, so the peers fail fast too.

Only members of the group may connect. When the comm is made, group rank 0 puts a fresh random
nonce in the group's store (``tcp/nonce``: the store is prefixed per group, and per rendezvous
round under ``elastix run``); the group key is derived from the job secret and that nonce by the
core (``elastix._auth``; without a secret the nonce itself, as private as the store: enough to
stop a stranger who can reach the port but not the store). Every connection starts with the
core's pair handshake under that key, bound to (connector rank, acceptor rank), before any data
flows: the connector proves the key first, so a stranger who connects learns nothing to test
guesses against, then the acceptor proves it in its verdict (``rust/core/src/auth/pair.rs``).
A connector whose listener refuses its proof, or cannot prove the key, raises
``AuthenticationError`` naming the address: the store sent it to something that is not its peer.
A connection the listener closed before its verdict (it sheds unproven connections under a
flood) is tried again until the group's deadline.

The listener is served by a thread that runs every pending handshake at once (non-blocking
sockets, each bounded by the core's handshake deadline, 3 s), so a silent or slow stranger holds
up no one, and a connector never waits for the acceptor's main thread to reach an accept: sends
stay as eager as with plain TCP, and programs that rely on that do not deadlock. Connections
waiting to prove themselves are bounded per source address and in all (the core's lobby); past
a bound the oldest waiting one is shed, and when the process is out of descriptors waiting ones
are shed before anything else, so a flood of strangers from one host cannot hold the slots a
genuine peer needs. A connection that fails (not a handshake, truncated, wrong proof, a rank out
of range or that does not connect to this one, a rank already connected) is closed, its address
logged once per host, and it is never used. The acceptor then keeps waiting for the genuine rank
rather than raising at once: a stranger who could break a group with one packet would turn this
check into a way to kill jobs. If the genuine rank does not come in time, the
``CollectiveTimeoutError`` names the refused connections, so an intruder (or a peer with the
wrong secret) is never silent.
"""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
import time
from typing import Dict, List, NoReturn, Optional, Sequence

from .. import _core
from .._peers import MalformedNonce, group_key, local_address
from .errors import AuthenticationError, CollectiveError, CollectiveTimeoutError, MismatchError, PeerError
from .mismatch import UNUSABLE, MismatchRecord, seen_elsewhere
from .tcp_accept import CHALLENGE_BYTES, PAIR, PURPOSE, VERDICT_BYTES, Acceptor

log = logging.getLogger(__name__)

MAGIC = 0x454C4153_54495843  # "ELASTIXC": every message header starts with it
KEY_LABEL = b"elastix collectives v1\0"
HANDSHAKE_LIMIT = _core.HANDSHAKE_DEADLINE  # seconds a connection may take to prove itself
HEADER = struct.Struct("<QQ14q")
INLINE_BYTES = 64 << 10  # sends up to this size fit in socket buffers: sent from the caller
SEALED_HEADER = HEADER.size + _core.SESSION_OVERHEAD
RECORD_HEAD = struct.Struct("<I")  # a sealed record's payload length


class _Header(bytes):
    """A message header: sealed in the peer's session when it is sent (it travels with the
    data views, in order), so that nothing but the peer can make one."""


class Ticket:
    """Completion of queued sends."""

    __slots__ = ("_event", "error")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.error: Optional[BaseException] = None


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError("the listener closed the connection during the handshake")
        data += chunk
    return bytes(data)


class TcpComm:
    def __init__(
        self, store, me: int, ranks: Sequence[int], timeout: Optional[float], record: Optional[MismatchRecord] = None
    ):
        self.store = store
        self.me = me
        self.ranks = list(ranks)  # global ranks of the group, for messages
        self.timeout = timeout
        self.broken: Optional[str] = None
        self.record = record or MismatchRecord(store)
        try:
            self._key = group_key(store, me, "tcp/nonce", KEY_LABEL)
        except MalformedNonce as err:
            raise CollectiveError(str(err)) from None
        addr = local_address()
        self.conns: Dict[int, socket.socket] = {}
        # each connection's session, which seals its headers (and, encrypted, all it carries)
        self._sessions: Dict[int, _core.SessionChannel] = {}
        self._acceptor = Acceptor(addr, self._key, me, self.ranks, self._handshake_limit(), self.conns.__contains__)
        self._conn_store = store.clone()  # connections may be made from the send thread
        store.set(f"tcp/addr/{me}", f"{addr}|{self._acceptor.port}")
        self._queue: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.RLock()

    # -- connections ------------------------------------------------------------------------

    def _deadline(self) -> Optional[float]:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def _handshake_limit(self) -> float:
        return HANDSHAKE_LIMIT if self.timeout is None else min(self.timeout, HANDSHAKE_LIMIT)

    def conn(self, peer: int) -> socket.socket:
        if self.broken is not None:  # not the shut sockets of a group that failed: why it failed
            self.check_usable()
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
                try:
                    self._prove(sock, peer, host, port)
                except BaseException:
                    sock.close()
                    raise
                return sock
            except OSError as err:
                # refused, reset, or closed mid-handshake: the peer is not listening yet, or
                # gone (then the deadline ends the retries)
                if deadline is not None and time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"cannot connect to rank {self.ranks[peer]} at {host}:{port}: {err}", [self.ranks[peer]]
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _prove(self, sock: socket.socket, peer: int, host: str, port: str) -> None:
        """The connector's side of the handshake (OSError: try again; AuthenticationError: the
        listener is not our peer)."""
        limit = self._handshake_limit()
        current = sock.gettimeout()
        sock.settimeout(limit if current is None else min(current, limit))
        connector = _core.PairConnector(self._key, PURPOSE, PAIR.pack(self.me, peer))
        sock.sendall(connector.hello)
        try:
            sock.sendall(connector.on_challenge(_recv_exact(sock, CHALLENGE_BYTES)))
            connector.on_verdict(_recv_exact(sock, VERDICT_BYTES))
            self._sessions[peer] = connector.session()
        except _core.AuthRefused as err:
            # the store sent us to something that is not our peer: no retry can fix that
            message = (
                f"the listener at {host}:{port} is not rank {self.ranks[peer]} of this group ({err}: a stranger, "
                f"a process of another job or round, or a different secret)"
            )
            self.abort(message)
            raise AuthenticationError(message, f"{host}:{port}", self.ranks[peer]) from None

    def _accept(self, peer: int) -> socket.socket:
        sock, self._sessions[peer] = self._acceptor.take(peer, self._deadline(), self.timeout, self.check_usable)
        return sock

    @property
    def refused(self) -> List[AuthenticationError]:
        """The latest connections that failed the handshake (at most 64), oldest first."""
        return self._acceptor.refused

    # -- sending ------------------------------------------------------------------------------

    def _sender(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            peer, views, ticket, last = item  # sealed already, in the order they were given
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
        views = self._seal(peer, views)
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

    def _seal(self, peer: int, views: Sequence) -> Sequence:
        """What goes on the wire for ``views`` to ``peer``: headers sealed in the peer's
        session, data as it is (an encrypted session seals the data too)."""
        session = self._sessions[peer]
        if session.encrypted:
            return [session.seal(memoryview(view).cast("B")) for view in views]
        if not any(isinstance(view, _Header) for view in views):
            return views
        return [session.seal(view) if isinstance(view, _Header) else view for view in views]

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
                self._peer_gone(peer, f"{who} closed its connection (it exited or failed)")
            got += k

    def recv_into(self, peer: int, view) -> None:
        mv = memoryview(view).cast("B") if not isinstance(view, memoryview) else view
        if not len(mv):
            return
        sock = self.conn(peer)
        if not self._sessions[peer].encrypted:
            self._recv_into_sock(sock, mv, peer)
            return
        # the sender sealed the same bytes in one go: as many records, full ones but the last
        records = -(-len(mv) // _core.SESSION_MAX_RECORD)
        sealed = bytearray(len(mv) + records * _core.SESSION_OVERHEAD)
        self._recv_into_sock(sock, memoryview(sealed), peer)
        try:
            payload = self._sessions[peer].open(sealed)
        except ValueError as err:
            self._garbled(peer, str(err))
        if len(payload) != len(mv):
            self._garbled(peer, f"{len(payload)} bytes where {len(mv)} were due")
        mv[:] = payload

    def _open_record(self, sock: socket.socket, peer: int, size: Optional[int] = None) -> bytes:
        """The payload of the next sealed record from ``peer`` (of ``size`` bytes, if given):
        a record that does not verify ends the group, naming the connection."""
        head = self._recv_exact(sock, RECORD_HEAD.size, peer)
        (length,) = RECORD_HEAD.unpack(head)
        if length > _core.SESSION_MAX_RECORD or (size is not None and length != size):
            self._garbled(peer, f"a record of {length} bytes")
        rest = self._recv_exact(sock, length + _core.SESSION_OVERHEAD - RECORD_HEAD.size, peer)
        try:
            return self._sessions[peer].open(head + rest)
        except ValueError as err:
            self._garbled(peer, str(err))

    def _garbled(self, peer: int, what: str) -> NoReturn:
        message = f"rank {self.ranks[peer]}'s connection carried {what}: it was altered after its handshake"
        self.abort(f"garbled stream: {message}")
        raise CollectiveError(message)

    # -- headers ------------------------------------------------------------------------------

    @staticmethod
    def header(desc: List[int]) -> bytes:
        return _Header(HEADER.pack(MAGIC, 0, *desc))

    def check_header(self, peer: int, desc: List[int], what: str) -> None:
        raw = self._open_record(self.conn(peer), peer, HEADER.size)
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
            self.record.write(message)  # first: whoever sees the connections close finds it
            self.abort(f"mismatch: {message}")
            raise MismatchError(f"{message}; {UNUSABLE}")

    # -- failure ------------------------------------------------------------------------------

    def _raise_io(self, peer: Optional[int], err: BaseException, doing: str) -> None:
        who = "a peer" if peer is None else f"rank {self.ranks[peer]}"
        if isinstance(err, CollectiveError):
            raise err
        if isinstance(err, socket.timeout):
            message = f"timed out {doing} {who}"
            self.abort(message)
            raise CollectiveTimeoutError(message, [] if peer is None else [self.ranks[peer]]) from None
        self._peer_gone(peer, f"connection to {who} failed while {doing} it ({err}); it probably exited or failed")

    def _peer_gone(self, peer: Optional[int], message: str) -> NoReturn:
        """A peer's connection closed or broke: a PeerError, unless a rank found a mismatch
        and closed its connections for it (then this rank raises the mismatch too)."""
        found = self.record.read()
        if found is not None:
            self.abort(f"mismatch: {found}")
            raise MismatchError(seen_elsewhere(found, "it closed its connections")) from None
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
        stashed = self._acceptor.interrupt()  # an _accept in progress sees the group broken
        for sock in list(self.conns.values()) + stashed:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None
        self._acceptor.close()
        for sock in list(self.conns.values()):
            try:
                sock.close()
            except OSError:
                pass
        self.conns.clear()


__all__ = ["TcpComm", "Ticket", "INLINE_BYTES"]
