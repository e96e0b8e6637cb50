"""The agent's data model with torch's names: ``WorkerSpec`` (what to run), ``WorkerState``,
``RunResult`` (how it ended) and ``ProcessFailure``. The agent itself is in Rust; these describe
its input and output for Python callers (``elastix.launch``)."""

from __future__ import annotations

import enum
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from .failures import ProcessFailure


class WorkerState(str, enum.Enum):
    """State of a worker group (torch's members and values)."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: "WorkerState") -> bool:
        return state in {WorkerState.HEALTHY, WorkerState.UNHEALTHY}


@dataclass
class WorkerSpec:
    """One role's workers on a node (torch's fields). ``rdzv_handler`` is optional here: the
    agent opens its own rendezvous. ``fn`` is torch's deprecated name for ``entrypoint``."""

    role: str
    local_world_size: int
    rdzv_handler: Any = None
    fn: Optional[Callable[..., Any]] = None
    entrypoint: Union[Callable[..., Any], str, None] = None
    args: Tuple[Any, ...] = ()
    max_restarts: int = 3
    monitor_interval: float = 0.1
    master_port: Optional[int] = None
    master_addr: Optional[str] = None
    local_addr: Optional[str] = None
    event_log_handler: str = "null"
    numa_options: Any = None
    duplicate_stdout_filters: Optional[List[str]] = None
    duplicate_stderr_filters: Optional[List[str]] = None
    virtual_local_rank: bool = False

    def __post_init__(self) -> None:
        if self.local_world_size <= 0:
            raise ValueError(f"local_world_size must be > 0, got {self.local_world_size}")
        if self.monitor_interval <= 0:
            raise ValueError(f"monitor_interval must be > 0, got {self.monitor_interval}")
        if self.fn is not None:
            warnings.warn("WorkerSpec.fn is deprecated; use entrypoint", DeprecationWarning, stacklevel=3)
            if self.entrypoint is None:
                self.entrypoint = self.fn
        if self.entrypoint is None:
            raise ValueError("WorkerSpec needs an entrypoint (a program path or a function)")

    def get_entrypoint_name(self) -> str:
        if isinstance(self.entrypoint, str):
            return os.path.basename(self.entrypoint)
        return getattr(self.entrypoint, "__qualname__", repr(self.entrypoint))


@dataclass
class RunResult:
    """How a run ended. ``return_values`` and ``failures`` are keyed by global rank and cover
    this node's workers. The fields after ``failures`` are elastix's additions."""

    state: WorkerState
    return_values: Dict[int, Any] = field(default_factory=dict)
    failures: Dict[int, ProcessFailure] = field(default_factory=dict)
    exit_code: int = 0
    restart_count: int = 0
    group_rank: Optional[int] = None
    group_world_size: Optional[int] = None
    log_dir: Optional[str] = None
    summary: Optional[str] = None
    #: For a failure not tied to one of this node's workers: ``{"kind", "message"}``, kind
    #: being "config", "rendezvous_timeout", "rendezvous_closed", "rendezvous", "store",
    #: "spawn", "io" or "remote_failure".
    error: Optional[Dict[str, str]] = None
    #: Lines of worker output not shown on the console because it was not being read.
    dropped_output_lines: int = 0
    #: Output that could not be written ("<log file>: <error>", "stdout: <error>"); with log
    #: files among them, a successful run's ``exit_code`` is 3 rather than 0.
    output_errors: List[str] = field(default_factory=list)

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED

    @classmethod
    def from_report(cls, report: Mapping[str, Any], return_values: Optional[Dict[int, Any]] = None) -> "RunResult":
        """From the agent's result (state SUCCEEDED or FAILED; INTERRUPTED is for the caller
        to turn into a SignalException)."""
        failures: Dict[int, ProcessFailure] = {}
        for entry in report.get("failures") or []:
            failure = ProcessFailure.from_report(entry)
            failures[int(entry["global_rank"])] = failure
        state = WorkerState(report["state"])
        if return_values is None:
            # a program's workers return nothing; torch reports None per rank on success
            ranks = report.get("global_ranks") or []
            return_values = {int(r): None for r in ranks} if state == WorkerState.SUCCEEDED else {}
        return cls(
            state=state,
            return_values=return_values,
            failures=failures,
            exit_code=int(report.get("exit_code", 0)),
            restart_count=int(report.get("restart_count", 0)),
            group_rank=report.get("group_rank"),
            group_world_size=report.get("group_world_size"),
            log_dir=report.get("log_dir"),
            summary=report.get("summary"),
            error=report.get("error"),
            dropped_output_lines=int(report.get("dropped_output_lines", 0)),
            output_errors=list(report.get("output_errors") or []),
        )


__all__ = ["WorkerState", "WorkerSpec", "RunResult", "ProcessFailure"]
