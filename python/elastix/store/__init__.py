"""Key-value stores with torch.distributed's API."""

from .base import Store
from .local import FileStore, HashStore
from .prefix import PrefixStore
from .tcp import TCPStore

__all__ = ["Store", "TCPStore", "PrefixStore", "HashStore", "FileStore"]
