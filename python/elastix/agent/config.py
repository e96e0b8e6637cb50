"""Builds the AgentConfig the Rust agent takes (one JSON object), for both ``elastix run`` and
``elastix.launch``, from torchrun's derivation rules. The schema and its checks are the agent's
(rust/core/src/agent/config.rs): ``build`` has them run before anything starts, so a bad value
is a ValueError that names its flag."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from .rdzv_conf import rdzv_conf_values
from .signals import parse_signals
from .standby import standby_env

DEFAULT_SHUTDOWN_TIMEOUT = 30.0
DEFAULT_EXIT_BARRIER_TIMEOUT = 300.0


def warn(message: str) -> None:
    from .._logging import warn as log_warning

    log_warning(message)


def parse_nnodes(spec: str) -> "tuple[int, int]":
    """``"N"`` or ``"MIN:MAX"``, with ``1 <= MIN <= MAX``."""
    parts = str(spec).strip().split(":")
    try:
        if len(parts) in (1, 2):
            low, high = int(parts[0]), int(parts[-1])
            check_nnodes(low, high, f"--nnodes {spec}")
            return low, high
    except ValueError as err:
        if str(err).startswith("--nnodes"):
            raise
    raise ValueError(f"--nnodes: {spec!r} is not N or MIN:MAX (e.g. 2 or 1:4)")


def check_nnodes(low: int, high: int, what: str = "--nnodes") -> None:
    if low < 1:
        raise ValueError(f"{what}: a job has at least one node")
    if low > high:
        raise ValueError(f"{what}: MIN ({low}) is greater than MAX ({high})")


def parse_seconds(flag: str, value: Any) -> float:
    """A finite number of seconds from a number, or a flag's or a variable's text with or
    without a unit as ``--rdzv-conf`` takes them (``30``, ``30s``, ``500ms``, ``2m``); the agent
    checks the range."""
    shown = value if isinstance(value, str) else repr(value)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        if not isinstance(value, str):
            raise ValueError(f"{flag}: {value!r} is not a number of seconds") from None
        from .. import _core

        try:
            seconds = _core.parse_duration(value)
        except ValueError:
            raise ValueError(
                f"{flag}: {shown} is not a duration (a number of seconds, or with a unit: 500ms, 30s, 2m, 1h)"
            ) from None
    if not math.isfinite(seconds):
        raise ValueError(f"{flag}: {shown} is not a finite number of seconds")
    return seconds


def whole_number(flag: str, value: Any, low: int = 0, high: Optional[int] = None) -> int:
    """An integer flag's value, from ``low`` to ``high``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{flag}: {value!r} is not a whole number")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{flag}: {value!r} is not a whole number") from None
    if number < low or (high is not None and number > high):
        span = f"at least {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"{flag}: must be {span}, got {number}")
    return number


def build(
    *,
    run_id: str,
    role: str,
    local_world_size: int,
    entrypoint: str,
    args: Sequence[str],
    env: Optional[Dict[str, str]] = None,
    rdzv_backend: str,
    rdzv_endpoint: str,
    rdzv_conf: Union[str, Mapping[str, object], None],
    min_nodes: int,
    max_nodes: int,
    node_rank: Optional[int],
    local_addr: Optional[str],
    master_addr: Optional[str],
    master_port: Optional[int],
    max_restarts: int,
    signals_to_handle: Any,
    shutdown_timeout: float,
    exit_barrier_timeout: float,
    log_dir: Optional[str],
    redirects: List[int],
    tee: List[int],
    local_ranks_filter: Optional[List[int]],
    line_prefix: Optional[str],
    virtual_local_rank: bool,
    worker_timeout: Optional[float] = None,
    event_log: Optional[str] = None,
    event_log_stderr: bool = False,
    duplicate_stdout_filters: Optional[Sequence[str]] = None,
    duplicate_stderr_filters: Optional[Sequence[str]] = None,
    name: Optional[str] = None,
    python_workers: bool = False,
    standby_workers: bool = True,
    metrics_port: Optional[int] = None,
    metrics_addr: Optional[str] = None,
    checkpoints: Optional[Mapping[str, Any]] = None,
    numa_binding: Optional[Dict[str, Any]] = None,
    slow_nodes: Optional[Mapping[str, bool]] = None,
    warn: Callable[[str], None] = warn,
) -> Dict[str, Any]:
    """``python_workers``: the entrypoint is the launcher's Python, with the arguments it built.
    ``standby_workers``: warm interpreters ready for the next restart, when one can happen.
    ``numa_binding``: each local rank's CPUs (``elastix.agent.numa.agent_binding``)."""
    worker_env = _worker_env(env or {}, python_workers)
    config = {
        "run_id": str(run_id),
        "role": str(role),
        "local_world_size": int(local_world_size),
        "entrypoint": str(entrypoint),
        "args": [str(arg) for arg in args],
        "env": worker_env,
        **_rendezvous(rdzv_backend, rdzv_endpoint, rdzv_conf, min_nodes, max_nodes, node_rank, warn),
        **_static_master(rdzv_backend, local_addr, master_addr, master_port),
        "max_restarts": whole_number("--max-restarts", max_restarts),
        "signals_to_handle": parse_signals(signals_to_handle),
        "shutdown_timeout": parse_seconds("--shutdown-timeout", shutdown_timeout),
        "exit_barrier_timeout": parse_seconds("--exit-barrier-timeout", exit_barrier_timeout),
        "worker_timeout": None if worker_timeout is None else parse_seconds("--worker-timeout", worker_timeout),
        "event_log": _event_log_path(event_log),
        "event_log_stderr": bool(event_log_stderr),
        **_output(log_dir, redirects, tee, local_ranks_filter, line_prefix),
        "duplicate_stdout_filters": _duplicate_filters(duplicate_stdout_filters, tee, 1, "stdout", warn),
        "duplicate_stderr_filters": _duplicate_filters(duplicate_stderr_filters, tee, 2, "stderr", warn),
        "virtual_local_rank": bool(virtual_local_rank),
        "name": name,  # what the failure summary calls the job (else the program's name)
        "metrics_port": None if metrics_port is None else _port("--metrics-port", metrics_port),
        "metrics_addr": metrics_addr or None,
        **_checkpoints(**(checkpoints or {})),
        "numa_binding": numa_binding,
        **_slow_nodes(**(slow_nodes or {})),
        "standby": _standby(
            python_workers and standby_workers, args, worker_env, rdzv_backend, int(max_nodes), int(max_restarts)
        ),
    }
    from .. import _core

    _core.check_agent_config(json.dumps(config))
    return config


def _rendezvous(
    backend: str,
    endpoint: str,
    conf: Union[str, Mapping[str, object], None],
    min_nodes: int,
    max_nodes: int,
    node_rank: Optional[int],
    warn: Callable[[str], None],
) -> Dict[str, Any]:
    """How the node meets the others: a static rendezvous has a node rank (0 by default) and
    is not elastic; the others have none."""
    check_nnodes(int(min_nodes), int(max_nodes))
    if backend == "static":
        node_rank = 0 if node_rank is None else int(node_rank)
        if min_nodes != max_nodes:
            warn(f"the static rendezvous is not elastic: it waits for all {max_nodes} nodes")
    else:
        node_rank = None
    return {
        "rdzv_backend": backend,
        "rdzv_endpoint": str(endpoint),
        "rdzv_conf": rdzv_conf_values(conf),
        "min_nodes": int(min_nodes),
        "max_nodes": int(max_nodes),
        "node_rank": None if node_rank is None else whole_number("--node-rank", node_rank),
    }


def _output(
    log_dir: Optional[str],
    redirects: List[int],
    tee: List[int],
    local_ranks_filter: Optional[List[int]],
    line_prefix: Optional[str],
) -> Dict[str, Any]:
    """Where the workers' output goes: log files (an absolute directory; torch's /dev/null
    means none), redirected and tee'd streams per local rank, the console's ranks and prefix."""
    if log_dir is not None and log_dir != os.devnull:
        log_dir = os.path.abspath(os.path.expanduser(log_dir))
    return {
        "log_dir": log_dir,
        "redirects": [int(mask) for mask in redirects],
        "tee": [int(mask) for mask in tee],
        "local_ranks_filter": local_ranks_filter,
        "line_prefix": line_prefix,
    }


def _static_master(
    backend: str, local_addr: Optional[str], master_addr: Optional[str], master_port: Optional[int]
) -> Dict[str, Any]:
    """This node's address, and the master's that a static rendezvous meets at (torch uses
    them for static only)."""
    static = backend == "static"
    return {
        "local_addr": local_addr or None,
        "master_addr": master_addr if static else None,
        "master_port": _port("--master-port", master_port) if static and master_port is not None else None,
    }


def _checkpoints(directory: Optional[str] = None, keep: int = 2, copy_rate: int = 1000) -> Dict[str, Any]:
    """The ``--checkpoint-*`` flags: where the agent persists the workers' checkpoints
    (absolute; none: memory only), how many steps it keeps there, and how fast it copies them
    to its buddy (MB/s, 0: unlimited)."""
    return {
        "checkpoint_dir": None if directory is None else os.path.abspath(os.path.expanduser(directory)),
        "checkpoint_keep": whole_number("--checkpoint-keep", keep),
        "checkpoint_copy_rate": whole_number("--checkpoint-copy-rate", copy_rate),
    }


def _slow_nodes(preflight: bool = False, exclude_stragglers: bool = False) -> Dict[str, Any]:
    """``--preflight``: check the nodes before the first round trains (elastix.preflight, run
    by this Python whatever the workers are); ``--exclude-stragglers``: a straggler's node
    leaves at the next re-form."""
    return {
        "preflight": [sys.executable, "-m", "elastix.preflight"] if preflight else None,
        "exclude_stragglers": bool(exclude_stragglers),
    }


def _worker_env(env: Mapping[str, str], python_workers: bool) -> Dict[str, str]:
    """The variables the workers get on top of the agent's: the configured ones, and, for
    Python workers, elastix's worker site on ``PYTHONPATH``."""
    if python_workers:
        from .worker_site import with_worker_site

        env = with_worker_site(dict(env))
    return {str(k): str(v) for k, v in env.items()}


def _event_log_path(path: Optional[str]) -> Optional[str]:
    """The event log's absolute path; its directory must exist (the agent creates the file)."""
    if not path:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(os.path.dirname(path)):
        raise ValueError(f"--event-log {path}: no directory {os.path.dirname(path)}")
    return path


def _duplicate_filters(
    filters: Optional[Sequence[str]], tee: List[int], mask: int, stream: str, warn: Callable[[str], None]
) -> List[str]:
    """torchrun's duplicate filters: empty ones match nothing; they see tee'd lines only, so
    filters without a tee'd stream would do nothing, which is said once."""
    kept = [str(f) for f in filters or () if f]
    if kept and not any(int(m) & mask for m in tee):
        warn(f"--duplicate-{stream}-filters copies tee'd lines only, and no rank tees {stream} (see --tee)")
    return kept


def _standby(
    wanted: bool, args: Sequence[str], env: Mapping[str, str], backend: str, max_nodes: int, max_restarts: int
) -> Optional[Dict[str, str]]:
    """The standby variables, when standbys are wanted and a restart can happen at all: after
    a failure (a restart budget), or after a membership change (an elastic multi-node job)."""
    can_restart = max_restarts > 0 or (backend != "static" and max_nodes > 1)
    if not (wanted and can_restart):
        return None
    return standby_env([str(arg) for arg in args], env)


def _port(flag: str, value: Any) -> int:
    """A TCP port number (0: any free one)."""
    return whole_number(flag, value, 0, 65535)


def shutdown_timeout_from_env(value: Optional[float]) -> float:
    """An explicit value, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s (torch main's rule)."""
    return _seconds_or_env("--shutdown-timeout", value, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT)


def exit_barrier_timeout_from_env(value: Optional[float]) -> float:
    """An explicit value, else TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT (the name torch's open PR
    #195543 proposes), else 300 s."""
    return _seconds_or_env(
        "--exit-barrier-timeout", value, "TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT", DEFAULT_EXIT_BARRIER_TIMEOUT
    )


def _seconds_or_env(flag: str, value: Optional[float], variable: str, default: float) -> float:
    """``value`` when given, else the variable when set and not empty, else ``default``; a bad
    value is an error that names its flag or variable."""
    if value is not None:
        return parse_seconds(flag, value)
    env = os.environ.get(variable)
    if env:
        return parse_seconds(variable, env)
    return default
