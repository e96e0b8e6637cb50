"""The worker's end of its agent's line (rust/core/src/agent/workers/control.rs): JSON lines
over the Unix socket ``ELASTIX_CONTROL_SOCKET`` names. The worker says hello as its local rank;
the agent answers how long to wait for its word after a collective failed (the worker tells it
such a failure: ``broken``). When the job re-forms, the agent says so (``abort``: every
collective of this process is aborted at once, from the line's thread, and the training
function is interrupted, :mod:`.interrupt`) and later gives the worker its place in the next
round (``assign``). For a node that joins, nothing is lost: the agent rather says after which
step's checkpoint save to stop (``drain``; at once, as for an abort, if this worker saved that
step already), and the worker says when it did (``drained``)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

SOCKET_VAR = "ELASTIX_CONTROL_SOCKET"
HELLO_TIMEOUT = 10.0  # seconds for the agent's welcome: it answers at once


@dataclass(frozen=True)
class Notice:
    """The agent's word that the job re-forms: why, and until when (monotonic seconds) the
    worker's next place may take."""

    round: int
    why: str
    until: float
    at: float


@dataclass(frozen=True)
class Drain:
    """The agent's word that the job re-forms once every worker saved step ``step``."""

    round: int
    step: int
    why: str
    until: float


@dataclass(frozen=True)
class Place:
    """The worker's place in the next round: the environment a worker started now would get."""

    round: int
    env: Dict[str, str]


class AgentLine:
    """A connection to this worker's agent; :meth:`connect` makes one under ``elastix run``."""

    def __init__(self, sock: socket.socket, notice_within: float) -> None:
        self._sock = sock
        self._reader = sock.makefile("rb")
        #: How long a worker whose collective failed waits for the agent's word.
        self.notice_within = notice_within
        self._cond = threading.Condition()
        self._notice: Optional[Notice] = None
        self._place: Optional[Place] = None
        self._drain: Optional[Drain] = None
        self._saved: Optional[int] = None  # the step of this worker's last checkpoint save
        self._closed = False
        #: Called with the reason, from the line's thread, once the collectives are aborted.
        self.on_abort: Optional[Callable[[str], None]] = None
        threading.Thread(target=self._listen, name="elastix-agent-line", daemon=True).start()

    @classmethod
    def connect(cls) -> Optional["AgentLine"]:
        """The line to this worker's agent; None outside ``elastix run`` (no socket named)."""
        path = os.environ.get(SOCKET_VAR)
        if not path:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(HELLO_TIMEOUT)
        try:
            sock.connect(path)
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            sock.sendall(json.dumps({"kind": "hello", "local_rank": local_rank}).encode() + b"\n")
            welcome = json.loads(sock.makefile("rb").readline() or b"{}")
        except (OSError, ValueError) as err:
            sock.close()
            raise ConnectionError(
                f"cannot reach this worker's elastix agent at {path} ({err}): "
                "the worker would be restarted rather than re-formed in process"
            ) from err
        if welcome.get("kind") != "welcome":
            sock.close()
            raise ConnectionError(f"the elastix agent at {path} answered {welcome!r} instead of its welcome")
        sock.settimeout(None)
        return cls(sock, welcome.get("notice_within_ms", 0) / 1000)

    def notice(self, wait: float) -> Optional[Notice]:
        """The agent's word that the job re-forms, waiting up to ``wait`` seconds for it."""
        until = time.monotonic() + wait
        with self._cond:
            while self._notice is None and not self._closed:
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._notice

    def place(self, step: float, after: int = -1) -> Optional[Place]:
        """The place in a round after ``after``, waiting up to ``step`` seconds for it (None:
        not yet)."""
        with self._cond:
            if not self._placed(after) and not self._closed:
                self._cond.wait(step)
            if not self._placed(after) and self._closed:
                raise ConnectionError("this worker's elastix agent closed its line before placing it")
            return self._place if self._placed(after) else None

    def _placed(self, after: int) -> bool:
        return self._place is not None and self._place.round > after

    def at_save(self, step: int) -> Optional[Notice]:
        """Notes this worker's checkpoint save of ``step``; the notice to stop now if the job
        re-forms after this step (the worker then leaves its group and calls :meth:`drained`)."""
        with self._cond:
            self._saved = step
            drain = self._drain
            if drain is None or step < drain.step or self._notice is not None:
                return None
            self._notice = Notice(drain.round, drain.why, drain.until, time.monotonic())
            self._cond.notify_all()
            return self._notice

    def drained(self) -> None:
        """Tells the agent this worker left its group for the drain it was told of, if any,
        with the step of its last save (whole: the save was waited for)."""
        with self._cond:
            drain, self._drain = self._drain, None
            saved = self._saved
        if drain is not None:
            self._send({"kind": "drained", "round": drain.round, "step": saved})

    def settled(self, took: float, left: float, placed: float) -> None:
        """Forgets the re-form just done and tells the agent the worker trains again, ``took``
        seconds after it was told; it had left its group after ``left`` and its place after
        ``placed``. Word about the round it joined, which can come while it joins (a node's
        replacement arrives as the round forms: a drain), is kept for it."""
        with self._cond:
            place, self._place = self._place, None
            joined = place.round if place is not None else None
            if joined is None or (self._notice is not None and self._notice.round < joined):
                self._notice = None
            if joined is None or (self._drain is not None and self._drain.round < joined):
                self._drain = None
            self._saved = None  # the new round's saves start from the step it restored
        if place is not None:
            message = {"kind": "reformed", "round": place.round, "took_ms": int(took * 1000)}
            self._send({**message, "left_ms": int(left * 1000), "placed_ms": int(placed * 1000)})

    def broken(self, why: str) -> None:
        """Tells the agent a collective failed before it said why: it asks whether a member is
        lost, as it would for a worker that failed."""
        self._send({"kind": "broken", "why": why[:500]})

    def _send(self, message: Dict[str, Any]) -> None:
        try:
            self._sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            pass  # the agent is gone: it stops the worker, or the worker's own deadline does

    def _listen(self) -> None:
        for raw in self._reader:
            message = json.loads(raw)
            kind = message.get("kind")
            if kind == "abort":
                self._abort(int(message["round"]), str(message["why"]), message["deadline_ms"] / 1000)
            elif kind == "drain":
                self._drain_after(message)
            elif kind == "assign":
                with self._cond:
                    self._place = Place(int(message["round"]), dict(message["env"]))
                    self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _abort(self, round: int, why: str, deadline: float) -> None:
        notice = Notice(round, why, time.monotonic() + deadline, time.monotonic())
        with self._cond:
            self._notice = notice  # first: whatever the abort makes the worker raise, this explains it
            self._cond.notify_all()
        _abort_collectives(f"the job re-forms: {notice.why}")
        if self.on_abort is not None:
            self.on_abort(notice.why)

    def _drain_after(self, message: Dict[str, Any]) -> None:
        """A drain: kept until the save of its step (:meth:`at_save`), or an abort now if this
        worker saved that step already (its peers stop there: it would wait for them in its
        next collective)."""
        deadline = message["deadline_ms"] / 1000
        drain = Drain(int(message["round"]), int(message["step"]), str(message["why"]), time.monotonic() + deadline)
        with self._cond:
            self._drain = drain
            past = self._saved is not None and self._saved >= drain.step and self._notice is None
        if past:
            self._abort(drain.round, f"{drain.why} (this worker had saved it already)", deadline)


def _abort_collectives(reason: str) -> None:
    """Makes every collective of this process fail at once (they wait for peers the re-form
    takes away, or for a round that is over)."""
    from ..collectives import group

    world = group._world
    if world is None:
        return
    for g in list(world.groups):
        backend = g.backend
        if backend is not None:
            backend.abort(reason)
