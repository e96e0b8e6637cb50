"""The one door to the Rust agent: an AgentConfig dict in, the result dict out."""

from __future__ import annotations

import json
from typing import Any, Dict

#: Every key the agent requires (it refuses unknown ones).
AGENT_CONFIG_KEYS = (
    "run_id", "role", "local_world_size", "entrypoint", "args", "env",
    "rdzv_backend", "rdzv_endpoint", "rdzv_conf", "min_nodes", "max_nodes", "node_rank",
    "local_addr", "master_addr", "master_port", "max_restarts", "signals_to_handle",
    "shutdown_timeout", "exit_barrier_timeout", "log_dir", "redirects", "tee",
    "local_ranks_filter", "line_prefix", "virtual_local_rank", "name", "standby",
)  # fmt: skip


class AgentUnavailableError(RuntimeError):
    """This build of the extension has no agent."""


def run_agent(config: Dict[str, Any]) -> Dict[str, Any]:
    """Runs the agent to the end (blocking; the GIL is released inside) and returns its result.
    Configuration errors found by the agent come back as ValueError."""
    from . import _core

    run = getattr(_core, "run_agent", None)
    if run is None:
        raise AgentUnavailableError(
            "this build of elastix._core has no agent (run_agent); rebuild it with `pip install -e .`"
        )
    missing = [key for key in AGENT_CONFIG_KEYS if key not in config]
    if missing:  # a bug on the Python side, not a user error
        raise AssertionError(f"AgentConfig lacks {missing}")
    # The agent owns SIGINT, SIGTERM and the signals to forward while it runs, and puts the
    # process's previous handlers back when it returns.
    return json.loads(run(json.dumps(config)))
