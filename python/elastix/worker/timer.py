"""torch.distributed.elastic.timer's ``expires``, for elastix workers: a block that must
finish in time, or its worker counts as hung (its stacks are dumped, it is killed and the
job restarts it). No timer server or client is needed: the agent reads the deadline from the
worker's heartbeat slot (see ``elastix.worker.progress``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ContextManager, Optional, Union

from .progress import _expires


def expires(after: Union[float, timedelta], scope: Optional[str] = None, client: Any = None) -> ContextManager[None]:
    """``with elastix.timer.expires(after=60): ...``: the block must end within ``after``
    seconds. Timers nest; the earliest deadline applies. ``scope`` and ``client`` are taken
    for torch's signature and not needed here."""
    del scope, client
    return _expires(after)


__all__ = ["expires"]
