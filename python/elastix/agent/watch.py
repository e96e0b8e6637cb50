"""Hang detection for Python workers with no change to their code: the directory of elastix's
site hook (python/elastix/worker/watch_site) goes first on their ``PYTHONPATH``, so that every
Python worker arms stack dumps and, with ``--worker-timeout``, reports when its main thread last
moved (see rust/core/src/agent/heartbeats.rs). The hook then runs the program's own
``sitecustomize``, if any."""

import os
from typing import Dict, Mapping

WATCH_SITE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worker", "watch_site")


def watched_env(env: Mapping[str, str]) -> Dict[str, str]:
    """The configured variables ``env`` with the site hook first on ``PYTHONPATH`` (which is
    otherwise the configured one, else the agent's own)."""
    path = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return {**env, "PYTHONPATH": WATCH_SITE_DIR + (os.pathsep + path if path else "")}
