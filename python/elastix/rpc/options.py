"""``RpcBackendOptions`` and the defaults torch users know."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_NUM_WORKER_THREADS = 16
DEFAULT_INIT_METHOD = "env://"
# 0: wait as long as it takes (torch's default for shutdown)
DEFAULT_SHUTDOWN_TIMEOUT = 0.0
# a timeout argument left out: the agent's rpc_timeout applies
UNSET_RPC_TIMEOUT = -1.0


@dataclass
class RpcBackendOptions:
    """``num_worker_threads``: threads that run incoming calls. ``rpc_timeout``: seconds a call
    waits for its answer by default (0: no limit). ``init_method``: where workers find each
    other (``env://``, ``tcp://host:port``, ``file:///path``, as for init_process_group)."""

    num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC
    init_method: str = DEFAULT_INIT_METHOD

    def __post_init__(self) -> None:
        if self.num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be at least 1, got {self.num_worker_threads}")
        if self.rpc_timeout < 0:
            raise ValueError(f"rpc_timeout must be >= 0 seconds (0: no limit), got {self.rpc_timeout}")


# torch's name for the same options
TensorPipeRpcBackendOptions = RpcBackendOptions

__all__ = [
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_INIT_METHOD",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "UNSET_RPC_TIMEOUT",
]
