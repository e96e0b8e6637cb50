"""The one door to the Rust agent: an AgentConfig dict in, the result dict out."""

from __future__ import annotations

import json
from typing import Any, Dict


class AgentUnavailableError(RuntimeError):
    """This build of the extension has no agent."""


def run_agent(config: Dict[str, Any]) -> Dict[str, Any]:
    """Runs the agent to the end (blocking; the GIL is released inside) and returns its result.
    Configuration errors found by the agent come back as ValueError."""
    from .. import _core

    run = getattr(_core, "run_agent", None)
    if run is None:
        raise AgentUnavailableError(
            "this build of elastix._core has no agent (run_agent); rebuild it with `pip install -e .`"
        )
    # The agent owns SIGINT, SIGTERM and the signals to forward while it runs, and puts the
    # process's previous handlers back when it returns.
    result: Dict[str, Any] = json.loads(run(json.dumps(config)))  # the agent's outcome: a JSON object
    return result
