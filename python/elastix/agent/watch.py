"""Hang detection for Python workers with no change to their code: the directory of elastix's
worker site hook (python/elastix/worker/site) goes first on their ``PYTHONPATH``, so that every
Python worker arms stack dumps and, with ``--worker-timeout``, reports when its main thread last
moved (see rust/core/src/agent/heartbeats.rs). The hook then runs the program's own
``sitecustomize``, if any. (Warm standbys wait for their activation in the same hook.)"""

import os
from typing import Dict, Mapping

SITE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worker", "site")


def watched_env(env: Mapping[str, str]) -> Dict[str, str]:
    """The configured variables ``env`` with the site hook first on ``PYTHONPATH`` (which is
    otherwise the configured one, else the agent's own)."""
    path = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return {**env, "PYTHONPATH": SITE_DIR + (os.pathsep + path if path else "")}
