"""elastix: a fast, PyTorch-free elastic launcher.

``elastix.TCPStore`` and friends have torch.distributed's signatures and speak torch's TCPStore
wire protocol, so torch code and elastix code can share one store.
"""

from ._core import __version__
from .errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    NetworkTimeoutError,
    QueueEmptyError,
    StoreTimeoutError,
)
from .store import FileStore, HashStore, PrefixStore, Store, TCPStore

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
]
