"""A failed worker (``ProcessFailure``, torch's fields) and the error a launcher raises when its
workers failed (``ChildFailedError``, torch's message layout)."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

NOT_AVAILABLE = "<N/A>"
_MAX_WIDTH = 60  # torch caps the message's rules at 60 columns


@dataclass
class ProcessFailure:
    """One failed worker. Built from the agent's report, or like torch's from
    ``(local_rank, pid, exitcode, error_file)`` alone, reading the error file when it exists.

    ``exitcode`` is minus the signal number for a worker killed by a signal. ``timestamp`` is
    in seconds since the epoch, with the agent's millisecond precision (torch: whole seconds).
    ``message`` is the agent's text; when built from the error file, as in torch, it is the
    file's ``message`` (a dict for files written by ``record``).
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


class ChildFailedError(Exception):
    """Workers failed: ``name`` is the program, ``failures`` maps global rank to failure. The
    message is torch's table, with the first failure (earliest timestamp) as the root cause."""

    def __init__(self, name: str, failures: Mapping[int, ProcessFailure]) -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        self.name = name
        self.failures: Dict[int, ProcessFailure] = dict(failures)
        super().__init__(self.format_msg())

    def get_first_failure(self) -> Tuple[int, ProcessFailure]:
        rank = min(self.failures, key=lambda r: (self.failures[r].timestamp or 0.0, r))
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        title = f"{self.name} FAILED"
        root_rank, _ = self.get_first_failure()
        width = len(title)
        root = ""
        others: List[str] = []
        for index, (rank, failure) in enumerate(self.failures.items()):
            block = _format_failure(index, rank, failure)
            width = max(width, max(len(line) for line in block.split("\n")))
            if rank == root_rank:
                root = block
            else:
                others.append(block)
        width = min(width, _MAX_WIDTH)
        lines = [
            "",
            boarder_delim * width,
            title,
            section_delim * width,
            "Failures:",
            "\n".join(others) if others else "  <NO_OTHER_FAILURES>",
            section_delim * width,
            "Root Cause (first observed failure):",
            root,
            boarder_delim * width,
        ]
        return "\n".join(lines)


def _format_failure(index: int, rank: int, failure: ProcessFailure) -> str:
    name = failure.signal_name()
    exit_text = f"{failure.exitcode} (pid: {failure.pid})"
    if name != NOT_AVAILABLE and failure.exitcode < 0:
        exit_text += f" ({name})"
    host = failure.host or _hostname()
    traceback = failure.traceback().replace("\n", "\n  ")
    return (
        f"[{index}]:\n"
        f"  time      : {failure.timestamp_isoformat()}\n"
        f"  host      : {host}\n"
        f"  rank      : {rank} (local_rank: {failure.local_rank})\n"
        f"  exitcode  : {exit_text}\n"
        f"  error_file: {failure.error_file}\n"
        f"  traceback : {traceback}"
    )


def _hostname() -> str:
    import socket

    return socket.gethostname()


__all__ = ["ProcessFailure", "ChildFailedError", "NOT_AVAILABLE"]
