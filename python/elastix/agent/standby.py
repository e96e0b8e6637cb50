"""Warm standby workers (see rust/core/src/agent/workers/standby.rs): which worker command lines may
have one, and the variables that make such a command line a standby.

The agent starts the worker's own command line (``python -u script.py ...`` or
``python -u -m module ...``) ahead of a restart, with :data:`SITE_DIR` first on
``PYTHONPATH``. The interpreter starts up as a cold start does, site packages included; then
``sitecustomize`` in SITE_DIR waits for the activation: the worker's whole environment. It
takes that environment, takes itself off ``sys.path``, runs the ``sitecustomize`` a cold start
would have run, and the interpreter goes on to run the program itself. So the program sees a
cold start in everything: ``sys.argv``, ``sys.orig_argv``, ``sys.path``, ``__file__``,
``os.environ``, and ``/proc/<pid>/cmdline`` (what ``ps`` shows). One difference stays visible
from outside: /proc/<pid>/environ shows the environment the standby started with.
"""

import os
from typing import Dict, Mapping, Optional, Sequence

from .worker_site import SITE_DIR


def standby_env(args: Sequence[str], env: Mapping[str, str]) -> Optional[Dict[str, str]]:
    """The variables that make the worker command ``python *args`` (with the configured
    variables ``env``) a standby, or None when a standby cannot stand in for it: only the
    forms the launcher builds, whose interpreter options (``-u``) keep ``PYTHONPATH`` and
    ``sitecustomize`` in force."""
    module = len(args) >= 3 and args[1] == "-m"
    script = len(args) >= 2 and not args[1].startswith("-")
    if not (list(args[:1]) == ["-u"] and (module or script)):
        return None
    path = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    if path.split(os.pathsep)[0] == SITE_DIR:  # the worker's own PYTHONPATH has it first already
        return {"PYTHONPATH": path}
    return {"PYTHONPATH": SITE_DIR + (os.pathsep + path if path else "")}
