"""elastix: a fast, PyTorch-free elastic launcher.

``elastix.TCPStore`` and friends have torch.distributed's signatures and speak torch's TCPStore
wire protocol, so torch code and elastix code can share one store.

What ``import elastix`` does besides defining names (tests/test_import.py checks it):

* it loads the extension ``elastix._core``, which registers one ``atexit`` hook (it closes the
  extension's calls into Python before the interpreter finalises: rust/python/src/exit_gate.rs)
  and routes the extension's log events to Python's ``logging`` (loggers ``elastix.*``; no
  handler or level is set; importing ``logging`` registers logging's own ``atexit`` flush);
* it makes ``elastix.timer`` importable under that name (``sys.modules``), as
  ``torch.distributed.elastic.timer`` is;
* in a worker of ``elastix run`` only (``ELASTIX_HEARTBEAT_FILE`` set), it claims the worker's
  heartbeat slot, as the worker site hook does for programs that never import elastix
  (``elastix.worker.progress``): it maps the agent's page (the mapping keeps a descriptor of
  it), registers ``faulthandler`` on a real-time signal writing to ``ELASTIX_STACKS_FILE``
  (kept open) unless the site hook did already, so the agent can have the worker dump its
  stacks, and adds an ``os.register_at_fork`` hook so that forked children do not beat for
  the worker.

Otherwise it starts no thread, installs no signal handler, changes no environment variable and
opens no file. The launcher API (``elastix.launch`` and friends) loads on first use.
"""

import sys as _sys

from ._core import __version__, reset_log_cache
from .errors import (
    AuthenticationError,
    ChildFailedError,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    NetworkTimeoutError,
    QueueEmptyError,
    StoreTimeoutError,
)
from .store import FileStore, HashStore, PrefixStore, Store, TCPStore
from .worker import progress as _progress
from .worker import timer
from .worker.progress import expect_progress, heartbeat
from .worker.record import record  # a light module; imported eagerly so `elastix.record` is the decorator

# `from elastix.timer import expires`, as torch.distributed.elastic.timer is imported
_sys.modules[__name__ + ".timer"] = timer

# a worker of `elastix run` finds its heartbeat slot and arms stack dumps at once (nothing
# happens outside `elastix run`: see the module's docstring)
_progress.arm()

# The launcher API loads on first use, keeping `import elastix` (and so `elastix run`) fast.
_LAZY = {
    "launch": "agent.launcher",
    "elastic_launch": "agent.launcher",
    "LaunchConfig": "agent.launcher",
    "RunResult": "agent.spec",
    "WorkerSpec": "agent.spec",
    "WorkerState": "agent.spec",
    "ProcessFailure": "agent.failures",
}


# Subpackages that load on first use too: `elastix.checkpoint.open()` after `import elastix`.
_LAZY_MODULES = {"checkpoint", "elastic"}


def __getattr__(name: str) -> object:
    import importlib

    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastix' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> "list[str]":
    return sorted(set(globals()) | set(_LAZY) | _LAZY_MODULES)


__all__ = [
    "__version__",
    "Store",
    "TCPStore",
    "PrefixStore",
    "HashStore",
    "FileStore",
    "DistError",
    "DistStoreError",
    "DistNetworkError",
    "DistBackendError",
    "QueueEmptyError",
    "StoreTimeoutError",
    "NetworkTimeoutError",
    "AuthenticationError",
    "record",
    "heartbeat",
    "expect_progress",
    "timer",
    "launch",
    "elastic_launch",
    "LaunchConfig",
    "RunResult",
    "WorkerSpec",
    "WorkerState",
    "ProcessFailure",
    "ChildFailedError",
    "reset_log_cache",
    "checkpoint",
    "elastic",
]
