"""The process-group lifecycle: ``init_process_group`` joins this process to the job's default
group (its store from the init method: ``init_method.py``), ``new_group`` makes subgroups, the
queries (``get_rank``, ``get_world_size``, ...) read the world, and ``destroy_process_group``
ends groups. Re-exported by ``elastix.collectives``, where users find them."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, List, Optional

from . import folding
from . import group as _group_mod
from .group import ProcessGroup, World, _lock, normalize_backend, set_world, timeout_seconds

if TYPE_CHECKING:
    from ..store import Store


def init_process_group(
    backend: Optional[str] = None,
    init_method: Optional[str] = None,
    timeout: Optional[timedelta] = None,
    world_size: int = -1,
    rank: int = -1,
    store: Optional[Store] = None,
    group_name: str = "",
    device_id: Any = None,
) -> None:
    """Joins this process to the job's default group.

    Without arguments it reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (set by
    ``elastix run`` or torchrun) and uses the agent's store. ``init_method`` may be
    ``tcp://host:port`` or ``file:///path``; or pass a ``store`` with ``rank`` and
    ``world_size``. ``backend`` is "cpu" (alias "gloo"; the default) or "nccl"; ``timeout``
    (a timedelta, default 30 minutes) bounds every wait for a peer.
    """
    with _lock:
        if _group_mod._world is not None:
            raise RuntimeError("trying to initialize the default process group twice")
        name = normalize_backend(backend)
        seconds = timeout_seconds(timeout)
        rank_arg = None if rank is None or rank < 0 else int(rank)
        size_arg = None if world_size is None or world_size < 0 else int(world_size)
        if store is not None:
            if init_method is not None:
                raise ValueError("pass either store or init_method, not both")
            if rank_arg is None or size_arg is None:
                raise ValueError("with store=, rank= and world_size= are required")
            the_store, r, ws = store, rank_arg, size_arg
        else:
            from .init_method import rendezvous

            the_store, r, ws = rendezvous(init_method or "env://", rank_arg, size_arg, seconds)
        if not 0 <= r < ws:
            raise ValueError(f"rank {r} is not in [0, world_size={ws})")
        if name == "nccl":
            from .nccl_backend import require_cupy

            require_cupy()
        round_ = os.environ.get("ELASTIX_ROUND") if store is None else None
        set_world(World(the_store, r, ws, name, seconds, f"round{round_}" if round_ else ""))
        folding.install()


def is_initialized() -> bool:
    return _group_mod._world is not None


def _world() -> World:
    return _group_mod.world()


def new_group(
    ranks: Optional[List[int]] = None,
    timeout: Optional[timedelta] = None,
    backend: Optional[str] = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: Optional[str] = None,
) -> ProcessGroup:
    """A group of the given global ranks (all ranks when None). Every rank of the world must
    call new_group, in the same order, members or not (as with torch); on a non-member the
    group's ``rank()`` is -1 and collectives on it raise ``GroupError``."""
    with _lock:
        w = _world()
        members = list(range(w.size)) if ranks is None else sorted({int(r) for r in ranks})
        bad = [r for r in members if not 0 <= r < w.size]
        if bad:
            raise ValueError(f"new_group: ranks {bad} are not in the world (size {w.size})")
        if not members:
            raise ValueError("new_group needs at least one rank")
        seconds = w.timeout if timeout is None else timeout_seconds(timeout)
        return w.make(members, normalize_backend(backend) if backend else w.backend, seconds)


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank in ``group`` (the world by default); -1 if it is not a member."""
    w = _world()
    return w.rank if group is None else group.rank()


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """The number of ranks in ``group`` (the world by default); -1 if this rank is not a member."""
    w = _world()
    if group is None:
        return w.size
    return group.size() if group.rank() >= 0 else -1


def get_backend(group: Optional[ProcessGroup] = None) -> str:
    w = _world()
    return (group or w.default).backend_name


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    return group.group_rank(global_rank)


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    if not 0 <= group_rank < group.size():
        raise ValueError(f"group rank {group_rank} is not in group {group.name} (size {group.size()})")
    return group.ranks[group_rank]


def destroy_process_group(group: Optional[ProcessGroup] = None) -> None:
    """Destroys ``group``, or (by default) every group and the default one."""
    with _lock:
        w = _world()
        if group is None:
            for g in reversed(w.groups):
                g.close()
            set_world(None)
        else:
            group.close()


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
]
