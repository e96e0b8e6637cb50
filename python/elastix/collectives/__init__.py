"""Collective communication for elastix workers, without PyTorch.

    import elastix.collectives as ec
    ec.init_process_group()            # reads the environment set by `elastix run` (or torchrun)
    ec.all_reduce(grad)                # a numpy (or cupy) array, summed in place over all ranks
    ec.all_reduce(grad, ec.ReduceOp.AVG)

Backends: ``cpu`` (shared memory between ranks of a host, TCP rings between hosts; NumPy
arrays, and CuPy arrays staged through host memory) and ``nccl`` (CuPy arrays, through
``cupy.cuda.nccl``; ``pip install elastix[cuda]``). The functions keep torch.distributed's
names and signatures. The process-group lifecycle (``init_process_group``, ``new_group``, the
rank queries, ``destroy_process_group``) is in ``lifecycle.py``, the init methods (``env://``,
``tcp://``, ``file://``) in ``init_method.py``; see python/elastix/collectives/README.md for the
design.
"""

from __future__ import annotations

from .api import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)
from .errors import (
    AuthenticationError,
    BackendUnavailableError,
    CollectiveError,
    CollectiveTimeoutError,
    GroupError,
    MismatchError,
    NotInitializedError,
    PeerError,
)
from .group import DEFAULT_TIMEOUT, ProcessGroup
from .lifecycle import _world as _world  # the world, for code that inspects its backends
from .lifecycle import (
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)
from .memory import shared_empty
from .reduce_op import ReduceOp
from .work import Work

__all__ = [
    "init_process_group",
    "is_initialized",
    "new_group",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_group_rank",
    "get_global_rank",
    "destroy_process_group",
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "shared_empty",
    "CollectiveError",
    "MismatchError",
    "PeerError",
    "CollectiveTimeoutError",
    "AuthenticationError",
    "NotInitializedError",
    "GroupError",
    "BackendUnavailableError",
    "DEFAULT_TIMEOUT",
]
