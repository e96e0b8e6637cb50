"""The accepting side of a rank's TCP connections (see ``tcp_comm.py``): its listener, and the
thread that serves it. The thread runs every pending handshake at once (non-blocking sockets,
each bounded by the core's handshake deadline), files the connections that proved the group's
key by the rank they proved to be, and refuses the others: closed, never used, their address
logged once per host and kept (the latest 64) for the timeout's message. Connections waiting
to prove themselves are bounded per source address and in all (the core's lobby); past a bound
the oldest waiting one is shed, and when the process is out of descriptors waiting ones are
shed before anything else."""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import struct
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from .. import _core
from .errors import AuthenticationError, CollectiveError, CollectiveTimeoutError

log = logging.getLogger("elastix.collectives.tcp_comm")

PURPOSE = "collectives"
HELLO_BYTES, CHALLENGE_BYTES, PROOF_BYTES, VERDICT_BYTES = _core.pair_sizes(PURPOSE)
PAIR = struct.Struct("<QQ")  # (connector, acceptor) group ranks: the handshake's binding


def address_of(addr) -> str:
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


class Acceptor:
    """Group rank ``me``'s listener on ``addr``: connections from lower ranks, each proven under
    ``key`` within ``limit`` seconds, taken by rank with :meth:`take`. ``connected(rank)`` says
    whether the comm holds a connection to ``rank`` already (a second claim is refused)."""

    def __init__(
        self,
        addr: str,
        key: _core.PeerKey,
        me: int,
        ranks: Sequence[int],
        limit: float,
        connected: Callable[[int], bool],
    ) -> None:
        self._key, self.me, self.ranks, self._limit, self._connected = key, me, list(ranks), limit, connected
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((addr, 0))
        self._listener.listen(256)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        # proven connections not taken yet (with their sessions), and the latest refused ones;
        # _cond guards both
        self._stash: Dict[int, Tuple[socket.socket, _core.SessionChannel]] = {}
        self._refused: List[AuthenticationError] = []
        self._refused_hosts: Set[str] = set()
        self._cond = threading.Condition()
        self._lobby = _core.ConnectionLobby()
        self._closing = False
        self._serve_error: Optional[BaseException] = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="elastix-tcp-accept", daemon=True)
        self._thread.start()

    def take(
        self, peer: int, deadline: Optional[float], timeout: Optional[float], check_usable: Callable[[], None]
    ) -> Tuple[socket.socket, _core.SessionChannel]:
        """Rank ``peer``'s proven connection and its session, once it came (by ``deadline``, a
        monotonic time; ``check_usable`` raises once the comm broke meanwhile)."""
        with self._cond:
            while peer not in self._stash:
                check_usable()
                if self._serve_error is not None:
                    raise CollectiveError(f"the listener failed: {self._serve_error}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    message = f"rank {self.ranks[peer]} did not connect within {timeout or 0:.1f} s"
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

    def interrupt(self) -> List[socket.socket]:
        """Wakes a :meth:`take` in progress (to see the comm broken); returns the proven
        connections not taken yet, for the comm to shut."""
        with self._cond:
            self._cond.notify_all()
            return [sock for sock, _ in self._stash.values()]

    def close(self) -> None:
        """Stops the thread and closes the listener and every connection not taken."""
        self._closing = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        with self._cond:
            stashed = [sock for sock, _ in self._stash.values()]
            self._stash.clear()
        for sock in [*stashed, self._listener, self._wake_r, self._wake_w]:
            try:
                sock.close()
            except OSError:
                pass

    def _serve(self) -> None:
        """Accepts connections and runs their handshakes, all at once, until close()."""
        sel = selectors.DefaultSelector()
        pending: Dict[socket.socket, _Handshake] = {}
        try:
            sel.register(self._listener, selectors.EVENT_READ, None)
            sel.register(self._wake_r, selectors.EVENT_READ, None)
            while not self._closing:
                now = time.monotonic()
                for hs in [h for h in pending.values() if h.deadline <= now]:
                    slow = f"did not complete the handshake within {self._limit:.1f} s"
                    self._refuse(sel, pending, hs, slow)
                wait = min([1.0] + [h.deadline - now for h in pending.values()])
                for key, _ in sel.select(max(0.0, wait)):
                    if key.fileobj is self._wake_r:
                        continue
                    if key.fileobj is self._listener:
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
            sock, addr = self._listener.accept()
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
        hs = _Handshake(sock, address_of(addr), time.monotonic() + self._limit, _core.PairAcceptor(self._key, PURPOSE))
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
            self._stash[who] = (hs.sock, hs.acceptor.session())
            self._cond.notify_all()

    def _claim_problem(self, who: int) -> Optional[str]:
        if not 0 <= who < len(self.ranks):
            return f"no rank {who} in this group of {len(self.ranks)}"
        if who >= self.me:
            return f"rank {self.ranks[who]} does not connect to rank {self.ranks[self.me]} (the lower rank connects)"
        with self._cond:
            if who in self._stash or self._connected(who):
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
