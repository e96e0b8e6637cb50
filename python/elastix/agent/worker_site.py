"""Where the worker site hook is, and the environment that puts it in every Python worker.

Hang detection for Python workers with no change to their code: the directory of elastix's
worker site hook (python/elastix/worker/site) goes first on their ``PYTHONPATH``, so that every
Python worker claims its heartbeat slot (the agent then watches its main thread through the
kernel: rust/core/src/agent/hangs/activity.rs) and arms stack dumps. The hook then runs the program's
own ``sitecustomize``, if any. (Warm standbys wait for their activation in the same hook.)"""

import os
from typing import Dict, Mapping

SITE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worker", "site")


def with_worker_site(env: Mapping[str, str]) -> Dict[str, str]:
    """The configured variables ``env`` with the site hook first on ``PYTHONPATH`` (which is
    otherwise the configured one, else the agent's own)."""
    path = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return {**env, "PYTHONPATH": SITE_DIR + (os.pathsep + path if path else "")}
