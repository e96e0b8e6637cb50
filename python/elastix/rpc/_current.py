"""The process's RPC agent, once ``init_rpc`` has made it."""

from __future__ import annotations

import threading
from typing import Optional

from .errors import RpcError
from .rpc_agent import RpcAgent

agent: Optional[RpcAgent] = None
lock = threading.Lock()


def current_agent() -> RpcAgent:
    found = agent
    if found is None:
        raise RpcError("RPC is not running in this process: call elastix.rpc.init_rpc() first")
    return found


__all__ = ["current_agent", "lock"]
