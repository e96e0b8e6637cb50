"""``elastix.rpc``: remote calls and remote references (RRefs) between the workers of a job,
with torch.distributed.rpc's API, for NumPy arrays and any picklable Python object.

    import elastix.rpc as rpc
    rpc.init_rpc(f"worker{rank}")                 # rank, world size, store: from elastix run
    rpc.rpc_sync("worker1", pow, args=(2, 10))    # 1024
    rref = rpc.remote("worker1", make_model)      # the value stays on worker1
    rref.rpc_sync().forward(batch)                # runs there
    rpc.shutdown()

Transport and RRef bookkeeping are in Rust (``rust/core/src/rpc``).
"""

from .api import _get_debug_info, get_worker_info, init_rpc, remote, rpc_async, rpc_sync, shutdown
from .errors import RemoteError, RpcError, RpcTimeoutError, WorkerGoneError
from .futures import Future, wait_all
from .options import (
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
    DEFAULT_SHUTDOWN_TIMEOUT,
    UNSET_RPC_TIMEOUT,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
)
from .rref import RRef
from .worker_info import WorkerInfo

__all__ = [
    "init_rpc",
    "shutdown",
    "get_worker_info",
    "rpc_sync",
    "rpc_async",
    "remote",
    "RRef",
    "WorkerInfo",
    "Future",
    "wait_all",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "RpcError",
    "RpcTimeoutError",
    "WorkerGoneError",
    "RemoteError",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "UNSET_RPC_TIMEOUT",
    "_get_debug_info",
]
