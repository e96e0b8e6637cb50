"""Interrupting the training function when the job re-forms.

Aborting the collectives stops a worker that waits inside one; a worker that computes (a
forward pass, a sleep standing for an accelerator's time) would only see the abort at its next
collective, and the rest of its step is lost anyway: the re-form restores a saved step. So
:func:`elastix.elastic.run` also interrupts the main thread, as a monitor thread of NVIDIA's
in-process restart does: the agent's line sends it a signal, and its handler raises
:class:`Reforming` wherever the function is (a blocking sleep or read returns early for it).

The signal is SIGURG: ignored by default (a stray one harms nothing) and used by no one else
here (the Go runtime takes it for the same reason). A program that installed a SIGURG handler of
its own keeps it, and is interrupted at its next collective, as without this.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

SIGNAL = signal.SIGURG


class Reforming(BaseException):
    """Raised in the training function's thread when the job re-forms: whatever the step was
    doing is dropped, and :func:`elastix.elastic.run` calls the function again in the next
    round. A ``BaseException``, like ``KeyboardInterrupt``: ``except Exception`` in a training
    loop does not swallow it."""


class Interrupter:
    """Raises :class:`Reforming` in the main thread on :meth:`fire`, while :meth:`armed`."""

    def __init__(self) -> None:
        self._main = threading.main_thread().ident
        self._previous: Any = None
        self._installed = False
        self._armed = False
        self._why = ""

    def install(self) -> Optional[str]:
        """Installs the handler; the reason it cannot when it cannot (not the main thread, or
        the program's own SIGURG handler)."""
        if threading.current_thread() is not threading.main_thread():
            return "elastix.elastic.run is not called in the main thread"
        previous = signal.getsignal(SIGNAL)
        if previous not in (signal.SIG_DFL, signal.SIG_IGN):
            return "the program has a SIGURG handler of its own"
        self._previous = previous
        signal.signal(SIGNAL, self._handle)
        self._installed = True
        return None

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(SIGNAL, self._previous)
            self._installed = False

    @contextmanager
    def armed(self) -> Iterator[None]:
        """The span in which :meth:`fire` interrupts: the training function's call (never the
        re-form's own steps). Leaving it disarms first, so that nothing is raised in the code
        that handles what ended the call."""
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def fire(self, why: str) -> None:
        """Interrupts the main thread if it is armed (from any thread); at most once per span."""
        if self._installed and self._armed and self._main is not None:
            self._why = why
            signal.pthread_kill(self._main, SIGNAL)

    def _handle(self, signum: int, frame: Any) -> None:
        if self._armed:
            self._armed = False  # once: a second signal finds the function already left
            raise Reforming(self._why)
