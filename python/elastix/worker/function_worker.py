"""A worker that runs a Python function (``elastix.launch`` with a function entrypoint) or a
script with runpy (``elastix run --run-path``), under ``@record`` so a failure always leaves its
error file.

    python -u -m elastix.worker.function_worker PAYLOAD RESULTS_DIR
    python -u -m elastix.worker.function_worker --run-path SCRIPT [ARGS...]

PAYLOAD is written by ``elastix.agent.launcher.write_payload``; the return value is pickled to
``RESULTS_DIR/<RANK>.pkl`` (written whole, then renamed into place).
"""

from __future__ import annotations

import os
import pickle
import sys
import types
from typing import Any, Dict, List


def _load_main(header: Dict[str, Any]) -> None:
    """Makes the launcher's ``__main__`` importable here as spawn does: its module runs again
    under the name ``__mp_main__`` (so its ``if __name__ == "__main__"`` block does not)."""
    import runpy

    if header.get("main_name"):
        namespace = runpy.run_module(header["main_name"], run_name="__mp_main__", alter_sys=False)
    elif header.get("main_path"):
        namespace = runpy.run_path(header["main_path"], run_name="__mp_main__")
    else:
        return
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def run_payload(payload: str, results: str) -> None:
    from .record import record

    with open(payload, "rb") as f:
        header = pickle.load(f)  # plain types only: safe to load before any setup
    for entry in reversed(header.get("sys_path") or []):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    _load_main(header)

    def call() -> Any:
        fn, args = pickle.loads(header["blob"])
        return fn(*args)

    # unpickling inside record too: a function that cannot be imported here is a worker error
    value = record(call)()
    rank = os.environ.get("RANK", "0")
    tmp = os.path.join(results, f".{rank}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        pickle.dump(value, out)
    os.replace(tmp, os.path.join(results, f"{rank}.pkl"))


def run_path(script: str, args: List[str]) -> None:
    import runpy

    from .record import record

    sys.argv = [script, *args]
    # as `python script.py` does: the script's directory first on sys.path
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    record(runpy.run_path)(script, run_name="__main__")


def main(argv: List[str]) -> None:
    if argv[:1] == ["--run-path"] and len(argv) >= 2:
        run_path(argv[1], argv[2:])
    elif len(argv) == 2:
        run_payload(argv[0], argv[1])
    else:
        sys.exit(
            "usage: python -m elastix.worker.function_worker PAYLOAD RESULTS_DIR\n"
            "       python -m elastix.worker.function_worker --run-path SCRIPT [ARGS...]"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
