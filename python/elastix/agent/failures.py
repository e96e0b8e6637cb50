"""A failed worker (``ProcessFailure``, torch's fields), and the error a launcher raises when its
workers failed (``ChildFailedError``, torch's message layout: defined in ``elastix.errors`` with
the other errors, and importable from here as from torch's module of the same role)."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from ..errors import NOT_AVAILABLE, ChildFailedError


@dataclass
class ProcessFailure:
    """One failed worker. Built from the agent's report, or like torch's from
    ``(local_rank, pid, exitcode, error_file)`` alone, reading the error file when it exists.

    ``exitcode`` is minus the signal number for a worker killed by a signal. ``timestamp`` is
    in seconds since the epoch, with the agent's millisecond precision (torch: whole seconds).
    ``message`` is the agent's text; when built from the error file, as in torch, it is the
    file's ``message`` (a dict for files written by ``record``). ``hung`` says why a worker
    killed as hung counted as hung; ``held_others_up``: other ranks waited for it in a
    collective (it is the root cause even if another was found hung first).
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: Optional[str] = None
    message: Union[str, Dict[str, Any], None] = None
    timestamp: Optional[float] = None
    global_rank: Optional[int] = None
    host: str = ""
    signal: Optional[str] = None
    error_file_data: Dict[str, Any] = field(default_factory=dict)
    hung: Optional[str] = None
    held_others_up: bool = False

    def __post_init__(self) -> None:
        if self.error_file and os.path.isfile(self.error_file):
            try:
                with open(self.error_file) as f:
                    self.error_file_data = json.load(f)
            except (OSError, ValueError):
                self.error_file_data = {}
            if self.message is None or self.timestamp is None:
                message, timestamp = _error_data(self.error_file_data)
                if self.message is None:
                    self.message = message
                if self.timestamp is None:
                    self.timestamp = timestamp
        elif not self.error_file:
            self.error_file = NOT_AVAILABLE
        if self.timestamp is None:
            self.timestamp = time.time()
        if self.signal is None and self.exitcode < 0:
            name = self.signal_name()
            self.signal = None if name == NOT_AVAILABLE else name
        if not self.message:
            if self.exitcode < 0:
                self.message = f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
            else:
                self.message = (
                    f"exited with code {self.exitcode}; for its traceback, decorate the program's "
                    "main function with @elastix.record, or run it with --run-path"
                )

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> "ProcessFailure":
        """From one entry of the agent's result ``failures``."""
        return cls(
            local_rank=int(report["local_rank"]),
            pid=int(report["pid"]),
            exitcode=int(report["exitcode"]),
            error_file=report.get("error_file"),
            message=report.get("message") or None,
            timestamp=float(report.get("timestamp") or time.time()),
            global_rank=report.get("global_rank"),
            host=report.get("host") or "",
            signal=report.get("signal"),
            hung=report.get("hung"),
            held_others_up=bool(report.get("held_others_up")),
        )

    def signal_name(self) -> str:
        if self.signal:
            return self.signal
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                pass
        return NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        """Local time as YYYY-MM-DD_HH:MM:SS (torch's format)."""
        return datetime.fromtimestamp(int(self.timestamp or 0)).isoformat(sep="_")

    def traceback(self) -> str:
        """The worker's Python traceback if its error file has one, else the message."""
        message = self.error_file_data.get("message") if self.error_file_data else None
        if isinstance(message, dict):
            return _callstack(message)
        if isinstance(self.message, dict):
            return _callstack(self.message)
        return str(self.message)


def _callstack(message: Mapping[str, Any]) -> str:
    return message.get("extraInfo", {}).get("py_callstack") or message.get("message") or NOT_AVAILABLE


def _error_data(data: Mapping[str, Any]) -> Tuple[Any, Optional[float]]:
    message = data.get("message")
    try:
        if isinstance(message, dict):
            return message, float(message["extraInfo"]["timestamp"])
        return message, float(data.get("timestamp", 0))
    except (KeyError, TypeError, ValueError):
        return message, None


__all__ = ["ProcessFailure", "ChildFailedError", "NOT_AVAILABLE"]
