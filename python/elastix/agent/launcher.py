"""Launching from Python: ``LaunchConfig`` (torch's fields and defaults), ``launch`` and torch's
``elastic_launch(config, entrypoint)(*args)``.

The entrypoint is a program path (a ``.py`` script runs with Python, anything else is executed),
or a picklable function: then ``(fn, args)`` is pickled into a temporary directory and every
worker runs ``python -u -m elastix.worker.function_worker PAYLOAD RESULTS``, which calls the function
under ``@record`` and pickles its return value to ``RESULTS/<RANK>.pkl``.

Differences from torch:
* ``rdzv_backend`` defaults to ``"c10d"`` (torch's API: ``"etcd"``, which in elastix is the
  etcd v3 backend);
* no ``timeout=900`` is injected into ``rdzv_configs`` (elastix's backends have their own
  defaults; ``rdzv_timeout`` or an explicit ``timeout`` is still passed on);
* ``max_restarts`` is a budget for the whole job, shared by all nodes;
* ``exit_barrier_timeout`` (seconds, default 300) is configurable;
* a run ended by a signal raises ``SignalException`` from ``launch`` as well;
* ``standby_workers`` (default True): Python workers restart from warm interpreters;
* ``numa_options`` takes torch's ``NumaOptions``, ``elastix.agent.numa.NumaOptions`` or a mode's
  name (``"node"``), without torch and without ``numactl`` (see ``elastix.agent.numa``).
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from . import config as configs
from .failures import ChildFailedError
from .logs_specs import DefaultLogsSpecs, masks_per_rank, parse_ranks_filter, translate_torch_prefix
from .numa import agent_binding, numa_options
from .signals import DEFAULT_SIGNALS
from .spec import RunResult, WorkerState

Entrypoint = Union[str, Callable[..., Any]]


@dataclass
class LaunchConfig:
    """What to launch and how (torch's fields in torch's order; elastix's additions last)."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: Union[int, str]
    logs_specs: Optional[DefaultLogsSpecs] = None
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "c10d"
    rdzv_configs: Dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_line_prefix_template: Optional[str] = None
    metrics_cfg: Dict[str, str] = field(default_factory=dict)  # accepted; a no-op, as in torch's OSS build
    local_addr: Optional[str] = None
    event_log_handler: str = "null"
    numa_options: Any = None
    signals_to_handle: str = DEFAULT_SIGNALS
    duplicate_stdout_filters: Optional[List[str]] = None
    duplicate_stderr_filters: Optional[List[str]] = None
    virtual_local_rank: bool = False
    shutdown_timeout: Optional[float] = None
    exit_barrier_timeout: Optional[float] = None
    standby_workers: bool = True
    # seconds without a heartbeat after which a worker that sent one is hung (None: off)
    worker_timeout: Optional[float] = None
    # check the nodes before the first round trains; a straggler's node leaves at a re-form
    preflight: bool = False
    exclude_stragglers: bool = False

    def __post_init__(self) -> None:
        if self.rdzv_timeout != -1:
            self.rdzv_configs["timeout"] = self.rdzv_timeout
        if self.logs_specs is None:
            self.logs_specs = DefaultLogsSpecs()
        self.shutdown_timeout = configs.shutdown_timeout_from_env(self.shutdown_timeout)
        self.exit_barrier_timeout = configs.exit_barrier_timeout_from_env(self.exit_barrier_timeout)
        if self.shutdown_timeout < 0:  # torch's check, when the config is made
            raise ValueError(f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}")
        if configs.parse_seconds("monitor_interval", self.monitor_interval) <= 0:
            raise ValueError(f"monitor_interval must be > 0, got {self.monitor_interval}")
        if self.start_method not in ("spawn", "fork", "forkserver"):
            raise ValueError(f"start_method must be spawn, fork or forkserver, got {self.start_method!r}")
        numa_options(self.numa_options, "numa_options")  # a clear error now, not at launch
        refused = []
        if self.event_log_handler != "null":
            refused.append(f"event_log_handler={self.event_log_handler!r}")
        if refused:
            raise ValueError("elastix does not implement " + ", ".join(refused))


def launch(config: LaunchConfig, entrypoint: Entrypoint, args: Sequence[Any] = ()) -> RunResult:
    """Runs this node's agent to the end and returns its result (failures included; see
    ``elastic_launch`` for the raising form). Raises SignalException if a signal stopped it."""
    from .call import run_agent

    workdir = tempfile.mkdtemp(prefix="elastix_launch_") if callable(entrypoint) else None
    try:
        program, program_args = _command(entrypoint, args, workdir)
        agent = agent_config(config, program, program_args)
        agent["name"] = entrypoint_name(entrypoint, args)
        report = run_agent(agent)
        if report["state"] == "INTERRUPTED":
            from ..errors import SignalException

            signum = int(report["exit_code"]) - 128
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signum)
        return_values = None
        if workdir is not None:
            return_values = _read_results(os.path.join(workdir, "results"), report)
        return RunResult.from_report(report, return_values)
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


class elastic_launch:
    """torch's ``elastic_launch(config, entrypoint)(*args)``: returns ``{global_rank: return
    value}`` for this node's workers, or raises ChildFailedError."""

    def __init__(self, config: LaunchConfig, entrypoint: Entrypoint) -> None:
        self._config = config
        self._entrypoint = entrypoint

    def __call__(self, *args: Any) -> Dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, list(args))


def launch_agent(config: LaunchConfig, entrypoint: Entrypoint, args: List[Any]) -> Dict[int, Any]:
    result = launch(config, entrypoint, args)
    if result.is_failed():
        if result.failures:
            raise ChildFailedError(name=entrypoint_name(entrypoint, args), failures=result.failures)
        raise _agent_error(result)
    return result.return_values


def _agent_error(result: RunResult) -> Exception:
    """The exception for a run that failed without a failing local worker."""
    from .. import errors

    kind = (result.error or {}).get("kind")
    message = (
        (result.error or {}).get("message")
        or result.summary
        or (f"the elastix agent failed (exit code {result.exit_code})")
    )
    error_type = {
        "config": ValueError,
        "rendezvous_timeout": errors.RendezvousTimeoutError,
        "rendezvous_closed": errors.RendezvousClosedError,
        "rendezvous": errors.RendezvousError,
        "store": errors.DistStoreError,
        "remote_failure": errors.DistError,
    }.get(kind or "", RuntimeError)
    return error_type(message)


def entrypoint_name(entrypoint: Entrypoint, args: Sequence[Any]) -> str:
    """torch's rule: a function's name; for the Python interpreter, the script; else the path
    (and no name for anything else, such as None)."""
    if callable(entrypoint):
        return getattr(entrypoint, "__name__", repr(entrypoint))
    if not isinstance(entrypoint, str):
        return ""
    if entrypoint == sys.executable:
        return next((str(a) for a in args if not str(a).startswith("-")), "")
    return entrypoint


def agent_config(config: LaunchConfig, program: str, program_args: Sequence[str]) -> Dict[str, Any]:
    """The AgentConfig dict for a LaunchConfig and a resolved command line."""
    from .nproc import resolve_nproc

    nproc = resolve_nproc(str(config.nproc_per_node))
    backend = config.rdzv_backend
    confs = dict(config.rdzv_configs)
    rank = confs.pop("rank", None)
    node_rank = master_addr = master_port = None
    if backend == "static":
        # torch's API reads the master's address from the endpoint, and the rank from the confs
        host, _, port = config.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"static rendezvous needs rdzv_endpoint HOST:PORT, got {config.rdzv_endpoint!r}")
        master_addr, master_port = host, int(port)
        if rank is None and config.max_nodes > 1:
            raise ValueError("static rendezvous over several nodes: set rdzv_configs['rank']")
        node_rank = int(rank or 0)
    specs = config.logs_specs or DefaultLogsSpecs()
    prefix = config.log_line_prefix_template
    return configs.build(
        run_id=config.run_id or _new_run_id(),
        role=config.role,
        local_world_size=nproc,
        entrypoint=program,
        args=program_args,
        env={},
        rdzv_backend=backend,
        rdzv_endpoint=config.rdzv_endpoint,
        rdzv_conf=confs,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        node_rank=node_rank,
        local_addr=config.local_addr,
        master_addr=master_addr,
        master_port=master_port,
        max_restarts=config.max_restarts,
        signals_to_handle=config.signals_to_handle,
        # LaunchConfig.__post_init__ resolved them (None: the variable, else the default); resolved
        # again for a None set since
        shutdown_timeout=configs.shutdown_timeout_from_env(config.shutdown_timeout),
        exit_barrier_timeout=configs.exit_barrier_timeout_from_env(config.exit_barrier_timeout),
        worker_timeout=config.worker_timeout,
        log_dir=_spec_attr(specs, "log_dir"),
        redirects=masks_per_rank(_spec_attr(specs, "redirects"), nproc, "redirects"),
        tee=masks_per_rank(_spec_attr(specs, "tee"), nproc, "tee"),
        local_ranks_filter=parse_ranks_filter(_spec_attr(specs, "local_ranks_filter")),
        line_prefix=translate_torch_prefix(prefix) if prefix else None,
        virtual_local_rank=config.virtual_local_rank,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        python_workers=program == _python(),
        standby_workers=config.standby_workers,
        numa_binding=agent_binding(config.numa_options, nproc, what="numa_options", warn=configs.warn),
        slow_nodes={"preflight": config.preflight, "exclude_stragglers": config.exclude_stragglers},
    )


def _new_run_id() -> str:
    import uuid

    return str(uuid.uuid4().int)  # torch's choice for an empty run_id


def _spec_attr(specs: Any, name: str) -> Any:
    """Our DefaultLogsSpecs, or torch's (which keeps the same values in private fields)."""
    for attr in (name, "_" + name, "_root_log_dir" if name == "log_dir" else None):
        if attr and hasattr(specs, attr):
            return getattr(specs, attr)
    raise TypeError(
        f"logs_specs of type {type(specs).__name__} is not supported; use elastix.agent.logs_specs.DefaultLogsSpecs"
    )


def _python() -> str:
    return os.environ.get("PYTHON_EXEC", sys.executable)


def _command(entrypoint: Entrypoint, args: Sequence[Any], workdir: Optional[str]) -> "tuple[str, List[str]]":
    python = _python()
    if callable(entrypoint):
        assert workdir is not None
        payload = os.path.join(workdir, "payload.pkl")
        results = os.path.join(workdir, "results")
        os.mkdir(results)
        write_payload(payload, entrypoint, tuple(args))
        return python, ["-u", "-m", "elastix.worker.function_worker", payload, results]
    if not isinstance(entrypoint, str):
        raise TypeError(f"entrypoint must be a program path or a function, got {type(entrypoint).__name__}")
    if entrypoint.endswith(".py"):
        return python, ["-u", entrypoint, *map(str, args)]
    return entrypoint, [str(a) for a in args]


def write_payload(path: str, fn: Callable[..., Any], args: Tuple[Any, ...]) -> None:
    """Pickles (fn, args) with what the worker needs to unpickle them: this process's sys.path
    and, when they refer to ``__main__``, how to load the main module again (as spawn does)."""
    try:
        blob = pickle.dumps((fn, args))
    except Exception as err:
        raise TypeError(
            f"the entrypoint function and its arguments must be picklable (a function defined at module level): {err}"
        ) from err
    main = sys.modules.get("__main__")
    main_name = main_path = None
    if b"__main__" in blob and main is not None:
        spec = getattr(main, "__spec__", None)
        if spec is not None and spec.name not in ("__main__", None):
            main_name = spec.name
        else:
            main_path = getattr(main, "__file__", None)
            main_path = os.path.abspath(main_path) if main_path else None
    header = {
        "version": 1,
        "sys_path": list(sys.path),
        "main_name": main_name,
        "main_path": main_path,
        "blob": blob,
    }
    with open(path, "wb") as f:
        pickle.dump(header, f)


def _read_results(results: str, report: Dict[str, Any]) -> Dict[int, Any]:
    """The return values of this node's workers, keyed by global rank (those that finished)."""
    values: Dict[int, Any] = {}
    if report["state"] != WorkerState.SUCCEEDED.value:
        return values
    for rank in report.get("global_ranks") or []:
        path = os.path.join(results, f"{int(rank)}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                values[int(rank)] = pickle.load(f)
        else:
            values[int(rank)] = None
    return values


__all__ = ["LaunchConfig", "launch", "elastic_launch", "launch_agent", "entrypoint_name"]
