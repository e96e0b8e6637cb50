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

import errno
import logging
import queue
import selectors
import socket
import struct
import threading
import time
from typing import Dict, List, NoReturn, Optional, Sequence, Set

from .. import _core
from .._peers import MalformedNonce, group_key, local_address
from .errors import AuthenticationError, CollectiveError, CollectiveTimeoutError, MismatchError, PeerError
from .mismatch import UNUSABLE, MismatchRecord, seen_elsewhere

log = logging.getLogger(__name__)

MAGIC = 0x454C4153_54495843  # "ELASTIXC": every message header starts with it
PURPOSE = "collectives"
HELLO_BYTES, CHALLENGE_BYTES, PROOF_BYTES, VERDICT_BYTES = _core.pair_sizes(PURPOSE)
PAIR = struct.Struct("<QQ")  # (connector, acceptor) group ranks: the handshake's binding
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


def _address(addr) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Handshake:
    """A connection on the accept side that has not proven itself yet."""

    __slots__ = ("acceptor", "addr", "buf", "claimed", "deadline", "sock", "ticket", "to")

    def __init__(self, sock: socket.socket, addr: str, deadline: float, acceptor: _core.PairAcceptor) -> None:
        self.sock = sock
        self.addr = addr
        self.deadline = deadline
        self.acceptor = acceptor
        self.buf = bytearray()
        self.claimed: Optional[int] = None  # set once the hello is in: who it claims to be,
        self.to: Optional[int] = None  # and whom it means to reach
        self.ticket = -1  # its place in the lobby


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
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((addr, 0))
        self.listener.listen(256)
        self.listener.setblocking(False)
        port = self.listener.getsockname()[1]
        self._conn_store = store.clone()  # connections may be made from the send thread
        self.conns: Dict[int, socket.socket] = {}
        # each connection's session, which seals its headers (and, encrypted, all it carries)
        self._sessions: Dict[int, _core.SessionChannel] = {}
        # authenticated connections not yet taken by _accept, and the latest refused ones,
        # filled by the accept thread; _cond guards both
        self._stash: Dict[int, socket.socket] = {}
        self._refused: List[AuthenticationError] = []
        self._refused_hosts: Set[str] = set()
        self._cond = threading.Condition()
        self._lobby = _core.ConnectionLobby()
        self._closing = False
        self._serve_error: Optional[BaseException] = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._acceptor = threading.Thread(target=self._serve, name="elastix-tcp-accept", daemon=True)
        self._acceptor.start()
        store.set(f"tcp/addr/{me}", f"{addr}|{port}")
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
        deadline = self._deadline()
        with self._cond:
            while peer not in self._stash:
                self.check_usable()
                if self._serve_error is not None:
                    raise CollectiveError(f"the listener failed: {self._serve_error}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    message = f"rank {self.ranks[peer]} did not connect within {self.timeout:.1f} s"
                    if not self._refused:
                        raise CollectiveTimeoutError(message, [self.ranks[peer]])
                    # the intruders (or peers with another secret) are part of the story
                    shown = "; ".join(str(e) for e in self._refused[-8:])
                    raise CollectiveTimeoutError(
                        f"{message}; meanwhile connection(s) that failed the group's handshake were refused: {shown}",
                        [self.ranks[peer]],
                    ) from self._refused[-1]
                self._cond.wait(left)
            return self._stash.pop(peer)

    @property
    def refused(self) -> List[AuthenticationError]:
        """The latest connections that failed the handshake (at most 64), oldest first."""
        with self._cond:
            return list(self._refused)

    # -- the accept thread --------------------------------------------------------------------

    def _serve(self) -> None:
        """Accepts connections and runs their handshakes, all at once, until close()."""
        sel = selectors.DefaultSelector()
        pending: Dict[socket.socket, _Handshake] = {}
        try:
            sel.register(self.listener, selectors.EVENT_READ, None)
            sel.register(self._wake_r, selectors.EVENT_READ, None)
            while not self._closing:
                now = time.monotonic()
                for hs in [h for h in pending.values() if h.deadline <= now]:
                    slow = f"did not complete the handshake within {self._handshake_limit():.1f} s"
                    self._refuse(sel, pending, hs, slow)
                wait = min([1.0] + [h.deadline - now for h in pending.values()])
                for key, _ in sel.select(max(0.0, wait)):
                    if key.fileobj is self._wake_r:
                        continue
                    if key.fileobj is self.listener:
                        self._take(sel, pending)
                    else:
                        self._advance(sel, pending, pending[key.fileobj])  # type: ignore[index]
        except BaseException as err:  # the listener is gone: _accept must not wait for nothing
            if not self._closing:
                with self._cond:
                    self._serve_error = err
                    self._cond.notify_all()
        finally:
            for hs in pending.values():
                hs.sock.close()
            sel.close()

    def _take(self, sel: selectors.BaseSelector, pending: Dict[socket.socket, _Handshake]) -> None:
        try:
            sock, addr = self.listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as err:
            if err.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            # out of descriptors: connections still waiting to prove themselves go first
            oldest = self._lobby.shed_oldest()
            shed = [hs for hs in pending.values() if hs.sock.fileno() == oldest]
            for hs in shed:
                self._refuse(sel, pending, hs, "shed: this process ran out of file descriptors")
            if not shed:
                time.sleep(0.01)  # nothing to shed: do not spin on the listener
            return
        sock.setblocking(False)
        hs = _Handshake(
            sock, _address(addr), time.monotonic() + self._handshake_limit(), _core.PairAcceptor(self._key, PURPOSE)
        )
        hs.ticket, shed_fds = self._lobby.arrive(addr[0].split("%", 1)[0], sock.fileno())  # no IPv6 scope
        pending[sock] = hs
        sel.register(sock, selectors.EVENT_READ, None)
        for old in [h for h in pending.values() if h.sock.fileno() in shed_fds]:
            old.ticket = -1  # the lobby let it go already
            self._refuse(sel, pending, old, "shed to make room: too many connections were waiting to prove themselves")

    def _advance(self, sel: selectors.BaseSelector, pending: Dict[socket.socket, _Handshake], hs: _Handshake) -> None:
        want = HELLO_BYTES if hs.claimed is None else PROOF_BYTES
        try:
            chunk = hs.sock.recv(want - len(hs.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            self._refuse(sel, pending, hs, f"connection failed during the handshake ({err})")
            return
        if not chunk:
            self._refuse(sel, pending, hs, f"closed the connection after {len(hs.buf)} of {want} handshake bytes")
            return
        hs.buf += chunk
        if len(hs.buf) < want:
            return
        if hs.claimed is None:
            self._hello(sel, pending, hs)
        else:
            self._verify(sel, pending, hs)

    def _send(
        self, sel: selectors.BaseSelector, pending: Dict[socket.socket, _Handshake], hs: _Handshake, data: bytes
    ) -> bool:
        try:
            sent = hs.sock.send(data)  # a few bytes into an empty socket buffer: all of them
        except OSError as err:
            self._refuse(sel, pending, hs, f"connection failed during the handshake ({err})")
            return False
        if sent != len(data):
            self._refuse(sel, pending, hs, "the handshake reply did not fit the socket buffer")
            return False
        return True

    def _hello(self, sel: selectors.BaseSelector, pending: Dict[socket.socket, _Handshake], hs: _Handshake) -> None:
        try:
            binding, challenge = hs.acceptor.on_hello(bytes(hs.buf))
        except (ConnectionError, _core.AuthRefused) as err:
            self._refuse(sel, pending, hs, f"sent no elastix collectives handshake ({err})")
            return
        hs.buf.clear()
        # the claim is judged once the key is proven: a stranger learns nothing from which
        # claims are refused (which rank listens here, for one)
        hs.claimed, hs.to = PAIR.unpack(binding)
        self._send(sel, pending, hs, challenge)

    def _verify(self, sel: selectors.BaseSelector, pending: Dict[socket.socket, _Handshake], hs: _Handshake) -> None:
        who = hs.claimed
        assert who is not None
        verdict, wrong = hs.acceptor.on_proof(bytes(hs.buf))
        if wrong is not None:
            self._send(sel, pending, hs, verdict)  # the refusal: a verified wrong key is final for the peer
            if hs.sock in pending:
                self._refuse(sel, pending, hs, f"{wrong} (it does not hold this group's key)")
            return
        with self._cond:
            problem = self._claim_problem(who) if hs.to == self.me else f"it means to reach group rank {hs.to}"
            if problem is not None:
                self._refuse(sel, pending, hs, problem)
                return
            if not self._send(sel, pending, hs, verdict):
                return
            sel.unregister(hs.sock)
            del pending[hs.sock]
            self._lobby.leave(hs.ticket)
            hs.sock.setblocking(True)
            self._sessions[who] = hs.acceptor.session()
            self._stash[who] = hs.sock
            self._cond.notify_all()

    def _claim_problem(self, who: int) -> Optional[str]:
        if not 0 <= who < len(self.ranks):
            return f"no rank {who} in this group of {len(self.ranks)}"
        if who >= self.me:
            return f"rank {self.ranks[who]} does not connect to rank {self.ranks[self.me]} (the lower rank connects)"
        with self._cond:
            if who in self._stash or who in self.conns:
                return f"rank {self.ranks[who]} is connected already"
        return None

    def _refuse(
        self, sel: selectors.BaseSelector, pending: Dict[socket.socket, _Handshake], hs: _Handshake, why: str
    ) -> None:
        sel.unregister(hs.sock)
        del pending[hs.sock]
        if hs.ticket >= 0:
            self._lobby.leave(hs.ticket)
        self._note_refused(hs.addr, hs.claimed, why)  # first: whoever sees the close sees the record
        hs.sock.close()

    def _note_refused(self, addr: str, claimed: Optional[int], why: str) -> None:
        rank = self.ranks[claimed] if claimed is not None and 0 <= claimed < len(self.ranks) else None
        claim = "" if claimed is None else f" (claiming to be rank {claimed if rank is None else rank})"
        err = AuthenticationError(
            f"rank {self.ranks[self.me]} refused a connection from {addr}{claim}: {why}", addr, rank
        )
        host = addr.rsplit(":", 1)[0]
        with self._cond:
            first = host not in self._refused_hosts
            self._refused_hosts.add(host)
            self._refused.append(err)
            del self._refused[:-64]  # the latest ones: a flood must not grow this without bound
        if first:  # once per host: a flood must not flood the log too
            log.warning("%s (it was closed, never used; later refusals from %s are not logged)", err, host)

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
        with self._cond:
            stashed = list(self._stash.values())
            self._cond.notify_all()  # an _accept in progress sees the group broken
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
        self._closing = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._acceptor.join(timeout=5)
        with self._cond:
            stashed = list(self._stash.values())
            self._stash.clear()
        for sock in list(self.conns.values()) + stashed + [self.listener, self._wake_r, self._wake_w]:
            try:
                sock.close()
            except OSError:
                pass
        self.conns.clear()


__all__ = ["TcpComm", "Ticket", "INLINE_BYTES"]
