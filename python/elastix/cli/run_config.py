"""``elastix run``'s parsed flags -> the agent's configuration, with torchrun's derived rules
(standalone, static endpoint, worker command line, OMP_NUM_THREADS) and clear errors for flags
that contradict each other or that elastix does not implement."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from .._logging import LOGGER
from ..agent import config as agent_config
from ..agent.logs_specs import masks_per_rank, parse_ranks_filter, translate_torch_prefix
from ..agent.nproc import resolve_nproc
from ..agent.numa import agent_binding
from . import scheduler_flags
from .envargs import is_given, source_of

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
# torchrun's advice, in one line, said once the configuration holds (never before a usage error)
OMP_NOTE = (
    "setting OMP_NUM_THREADS=1 for every worker (it was unset, and --nproc-per-node > 1) so that "
    "they do not overload the machine; set it yourself to tune it"
)


def config_from_args(args: argparse.Namespace, warn: Callable[[str], None] = agent_config.warn) -> Dict[str, Any]:
    """The AgentConfig dict for parsed ``elastix run`` flags; ValueError on bad input."""
    _refuse_unimplemented(args)
    derived = scheduler_flags.derive(args, os.environ, warn)
    if derived:
        LOGGER.info("%s", derived)
    min_nodes, max_nodes = agent_config.parse_nnodes(args.nnodes)
    backend, endpoint, run_id = _rendezvous(args, min_nodes, max_nodes, warn)
    master_addr, master_port = _master(args, backend, endpoint, warn)

    if agent_config.parse_seconds("--monitor-interval", args.monitor_interval) <= 0:
        raise ValueError(f"--monitor-interval must be > 0, got {args.monitor_interval}")
    nproc = resolve_nproc(args.nproc_per_node)
    entrypoint, worker_args = _command(args, warn)

    env: Dict[str, str] = {}
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        env["OMP_NUM_THREADS"] = "1"

    config = agent_config.build(
        run_id=run_id,
        role=args.role,
        local_world_size=nproc,
        entrypoint=entrypoint,
        args=worker_args,
        env=env,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_conf=args.rdzv_conf,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_rank=args.node_rank,
        # a standalone job is reachable from this machine alone: its stores listen on loopback
        local_addr=args.local_addr or ("127.0.0.1" if endpoint == STANDALONE_ENDPOINT else None),
        master_addr=master_addr,
        master_port=master_port,
        max_restarts=args.max_restarts,
        signals_to_handle=args.signals_to_handle,
        shutdown_timeout=agent_config.shutdown_timeout_from_env(args.shutdown_timeout),
        exit_barrier_timeout=agent_config.exit_barrier_timeout_from_env(args.exit_barrier_timeout),
        worker_timeout=args.worker_timeout,
        event_log=args.event_log,
        event_log_stderr=args.event_log_handler == "jsonl",
        log_dir=args.log_dir or None,
        redirects=masks_per_rank(args.redirects, nproc, "--redirects"),
        tee=masks_per_rank(args.tee, nproc, "--tee"),
        local_ranks_filter=parse_ranks_filter(args.local_ranks_filter),
        line_prefix=_line_prefix(args),
        virtual_local_rank=args.virtual_local_rank,
        duplicate_stdout_filters=args.duplicate_stdout_filters,
        duplicate_stderr_filters=args.duplicate_stderr_filters,
        name=args.training_script if args.run_path else None,
        python_workers=not args.no_python or args.run_path,
        standby_workers=not args.no_standby_workers,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        checkpoints={
            "directory": args.checkpoint_dir,
            "keep": args.checkpoint_keep,
            "copy_rate": args.checkpoint_copy_rate,
        },
        numa_binding=agent_binding(args.numa_binding, nproc, what="--numa-binding", warn=warn),
        slow_nodes={"preflight": args.preflight, "exclude_stragglers": args.exclude_stragglers},
        warn=warn,
    )
    if env:
        LOGGER.info("%s", OMP_NOTE)
    return config


def _rendezvous(
    args: argparse.Namespace, min_nodes: int, max_nodes: int, warn: Callable[[str], None]
) -> Tuple[str, str, str]:
    """The rendezvous backend, endpoint and run ID the flags mean (torchrun's rules for
    --standalone and a one-node static job, and c10d where static could not form the job)."""
    given = lambda dest: is_given(args, dest)  # noqa: E731
    on_cli = lambda dest: source_of(args, dest) == "cli"  # noqa: E731
    backend, endpoint, run_id = args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id
    if args.standalone:
        flags = ("rdzv_backend", "rdzv_endpoint", "rdzv_id")
        ignored = [f"--{d.replace('_', '-')}" for d in flags if on_cli(d)]
        if ignored:
            warn(f"--standalone ignores {', '.join(ignored)}")
        if min_nodes > 1:
            raise ValueError(f"--standalone runs a single node, but --nnodes asks for at least {min_nodes}")
        backend, endpoint, run_id = _standalone()
    elif (backend == "static" and not endpoint and max_nodes == 1
          and not (given("master_port") or given("master_addr"))):  # fmt: skip
        # newer torchrun: a one-node static job with nothing to meet at is standalone, which
        # avoids a fixed port 29500 colliding between jobs on one host (torch checks the port
        # only; a master address given on purpose also keeps the static rendezvous here)
        backend, endpoint, run_id = _standalone()
    elif backend == "static" and endpoint and not given("rdzv_backend") and not given("node_rank"):
        # torchrun's static default needs --node-rank on every node; with an endpoint to meet
        # at and no rank, c10d forms the job by itself
        LOGGER.info(
            "--rdzv-endpoint %s without --node-rank: the nodes meet there with the c10d rendezvous "
            "(torchrun's default, static, would need --node-rank on each node)",
            endpoint,
        )
        backend = "c10d"
    return backend, endpoint, run_id


def _master(args: argparse.Namespace, backend: str, endpoint: str, warn: Callable[[str], None]) -> Tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT for a static rendezvous; a warning for each flag that the
    chosen rendezvous ignores."""
    on_cli = lambda dest: source_of(args, dest) == "cli"  # noqa: E731
    master_addr = args.master_addr if args.master_addr is not None else DEFAULT_MASTER_ADDR
    master_port = args.master_port if args.master_port is not None else DEFAULT_MASTER_PORT
    if backend != "static":
        for dest in ("master_addr", "master_port", "node_rank"):
            if on_cli(dest):
                warn(f"--{dest.replace('_', '-')} only applies to --rdzv-backend static; ignored")
    elif endpoint:
        for dest in ("master_addr", "master_port"):
            if on_cli(dest):
                warn(f"--{dest.replace('_', '-')} is ignored: --rdzv-endpoint {endpoint} is given")
    return master_addr, master_port


STANDALONE_ENDPOINT = "localhost:0"


def _standalone() -> "tuple[str, str, str]":
    import uuid

    return "c10d", STANDALONE_ENDPOINT, str(uuid.uuid4())  # torchrun's form


def _command(args: argparse.Namespace, warn: Callable[[str], None]) -> "tuple[str, List[str]]":
    """The program each worker executes and its arguments (before ${local_rank} substitution)."""
    script, rest = args.training_script, list(args.training_script_args)
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    if args.run_path:
        if args.module:
            raise ValueError("--run-path runs a script file; it cannot be combined with -m/--module")
        if args.start_method != "spawn":
            warn(f"--start-method {args.start_method}: elastix always starts workers as new processes (spawn)")
        _check_script(script)
        return python, ["-u", "-m", "elastix.worker.function_worker", "--run-path", script, *rest]
    if args.no_python:
        if args.module:
            raise ValueError("--no-python and -m/--module cannot be used together")
        return script, rest
    if args.module:
        return python, ["-u", "-m", script, *rest]
    _check_script(script)
    return python, ["-u", script, *rest]


def _check_script(script: str) -> None:
    # one clear error here rather than N workers failing with "can't open file"
    if not os.path.exists(script):
        raise ValueError(f"program {script!r} not found (to run a module, add -m)")


def _line_prefix(args: argparse.Namespace) -> Optional[str]:
    """--line-prefix (elastix syntax) or --log-line-prefix-template / its env / the variable
    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (torch syntax, translated); None: torch's default."""
    ours, torchs = source_of(args, "line_prefix"), source_of(args, "log_line_prefix_template")
    if ours == "cli" and torchs == "cli":
        raise ValueError("give --line-prefix or --log-line-prefix-template, not both")
    if ours == "cli" or (args.line_prefix is not None and torchs != "cli"):
        return args.line_prefix
    template = args.log_line_prefix_template or os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    return translate_torch_prefix(template) if template else None


def _refuse_unimplemented(args: argparse.Namespace) -> None:
    """torchrun flags elastix accepts only at their defaults: anything else would silently do
    nothing, so it is an error that names the flag."""
    refused: List[str] = []
    if args.logs_specs not in (None, "default"):
        refused.append(f"--logs-specs {args.logs_specs} (log layout plugins; 'default' is the layout elastix writes)")
    if refused:
        raise ValueError("elastix does not implement " + "; ".join(refused))


__all__ = ["config_from_args", "DEFAULT_MASTER_ADDR", "DEFAULT_MASTER_PORT"]
