"""Rendezvous: how the agents of a job find each other and agree on ranks (torch's
``RendezvousHandler`` API, over elastix's Rust implementation).

``c10d`` is elastic (``min_nodes`` to ``max_nodes`` nodes; late nodes wait and the job re-forms
with them; dead nodes are dropped); ``static`` has fixed ranks. The rendezvous state is
versioned JSON in the store, and every wait is pushed by the store, never polled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Union

from .. import _core
from ..store import PrefixStore, Store, TCPStore
from .rdzv_conf import rdzv_conf_json

#: The backends elastix provides.
BACKENDS = _core.RENDEZVOUS_BACKENDS


@dataclass(frozen=True)
class RendezvousStoreInfo:
    """Where the round's workers find their store (served by rank 0's agent)."""

    master_addr: str
    master_port: int


@dataclass(frozen=True)
class RendezvousInfo:
    """torch's RendezvousInfo, plus the round number and run id."""

    store: Store
    rank: int
    world_size: int
    bootstrap_store_info: RendezvousStoreInfo
    round: int
    run_id: str


class RendezvousHandler:
    """One node's handle on a job's rendezvous.

    ``conf`` takes torch's ``--rdzv-conf`` keys (as ``"k=v,k=v"`` or a dict); unknown keys are
    an error, and durations accept units (``30s``, ``500ms``, ``2m``).
    """

    def __init__(
        self,
        backend: str = "c10d",
        endpoint: str = "",
        run_id: str = "none",
        min_nodes: int = 1,
        max_nodes: int = 1,
        local_addr: Optional[str] = None,
        conf: Union[str, Mapping[str, object], None] = None,
        node_rank: Optional[int] = None,
    ) -> None:
        self._core = _core.RendezvousCore(
            backend,
            endpoint,
            run_id,
            int(min_nodes),
            int(max_nodes),
            local_addr=local_addr,
            conf_json=rdzv_conf_json(conf),
            node_rank=node_rank,
        )

    def get_backend(self) -> str:
        return self._core.backend

    def get_run_id(self) -> str:
        return self._core.run_id

    @property
    def use_agent_store(self) -> bool:
        """Workers' MASTER_ADDR:MASTER_PORT is a store the agent already serves."""
        return True

    @property
    def hosted_port(self) -> Optional[int]:
        """The rendezvous store's port when this handler serves it."""
        return self._core.hosted_port

    def next_rendezvous(self) -> RendezvousInfo:
        """Joins the next round and returns this node's place in it."""
        info = self._core.next_rendezvous()
        store = PrefixStore(info["store_prefix"], TCPStore(info["store_host"], info["store_port"]))
        return RendezvousInfo(
            store=store,
            rank=info["rank"],
            world_size=info["world_size"],
            bootstrap_store_info=RendezvousStoreInfo(info["master_addr"], info["master_port"]),
            round=info["round"],
            run_id=info["run_id"],
        )

    def num_nodes_waiting(self) -> int:
        return self._core.num_nodes_waiting()

    def is_closed(self) -> bool:
        return self._core.is_closed()

    def set_closed(self) -> None:
        """Ends the job's rendezvous for every node."""
        self._core.set_closed()

    def shutdown(self) -> bool:
        """Stops this node's heartbeats and the workers' store it serves. Unlike torch, this
        does not close the rendezvous for the other nodes; ``set_closed`` does."""
        self._core.shutdown()
        return True

    def wait_for_change(self, timeout: Optional[float] = None) -> Optional[str]:
        """Blocks until the current round should end; returns why ("nodes_waiting",
        "node_lost:RANK[:NODE]", "round_superseded:ROUND", "store_reset", "store_unreachable:STORE",
        "store_moved:STORE", "minority:SITES", "closed"), or None on timeout."""
        return self._core.wait_for_change(timeout)

    def record_restart(self) -> int:
        """Counts a restart after a failure, job-wide; returns the total."""
        return self._core.record_restart()

    def restart_count(self) -> int:
        return self._core.restart_count()


def create_handler(
    backend: str,
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    local_addr: Optional[str] = None,
    **conf: object,
) -> RendezvousHandler:
    """torch-style construction from RendezvousParameters-like arguments."""
    node_rank = conf.pop("rank", None)
    return RendezvousHandler(
        backend,
        endpoint,
        run_id,
        min_nodes,
        max_nodes,
        local_addr=local_addr,
        conf=conf,
        node_rank=None if node_rank is None else int(str(node_rank)),
    )
