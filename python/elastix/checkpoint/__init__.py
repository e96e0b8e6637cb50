"""Checkpoints held in memory by the node's elastix agent.

::

    ckpt = elastix.checkpoint.open()
    state = ckpt.load()                # the newest step every rank has, or None on a first start
    start = 0 if state is None else ckpt.step + 1
    for step in range(start, steps):
        ...
        ckpt.save(step, {"model": weights, "optimizer": moments, "step": step})

``save`` copies the state into shared memory that the agent owns and returns: training waits
for the copy only, never for a disk. ``save(..., block=False)`` does not wait for the copy
either (CheckFreq's pipelining): the copy runs on a thread of its own while the next step
computes, and ``wait()`` returns once it is done; the arrays must not change before then, so a
loop calls ``wait()`` before its optimizer updates them::

    ckpt.save(step, state, block=False)
    loss = forward_backward(batch)      # reads the weights while they are copied
    ckpt.wait()
    optimizer_step()                    # changes them

The agent persists the newest step to ``--checkpoint-dir`` in the background, and once more
when the run ends; a worker restarted on the same node restores from the agent's memory.
``load`` takes the newest step that every rank of the job can get (from memory, a copy a
peer's agent held, or disk), never mixing steps.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Set

from ..worker import progress
from .errors import CheckpointError
from .storage import Disk, Memory
from .tree import first_difference, flatten, rebuild

__all__ = ["Checkpoint", "CheckpointError", "open"]

MEMORY_VAR = "ELASTIX_CHECKPOINT_MEMORY"
DIR_VAR = "ELASTIX_CHECKPOINT_DIR"
#: The world size the newest step was saved in, as the agent found it when the round formed.
SAVED_WORLD_VAR = "ELASTIX_CHECKPOINT_SAVED_WORLD"
#: The newest step every rank's state was held for in the agents' memory when the round formed.
HELD_STEP_VAR = "ELASTIX_CHECKPOINT_HELD_STEP"
#: Whose state each rank restores, where the agent chose (``rank:source,...``): a rank new to
#: the job takes a replica its node holds.
SOURCES_VAR = "ELASTIX_CHECKPOINT_SOURCES"


class Checkpoint:
    """This rank's checkpoints: see the module's documentation."""

    def __init__(
        self,
        memory: str,
        directory: Optional[str],
        rank: int,
        world_size: int,
        saved_world: Optional[int] = None,
        source_rank: Optional[int] = None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        #: The rank whose saved state this one restores: itself, unless the world grew since
        #: the save (then a replica's: the one the agent chose, or ``rank % saved world size``).
        self.source_rank = source_rank if source_rank is not None else rank % saved_world if saved_world else rank
        self._memory = Memory(memory, rank, self.source_rank)
        self._disk = Disk(directory, self.source_rank)
        self._loads = 0
        #: The step of what :meth:`load` returned (None before, or when nothing was saved).
        self.step: Optional[int] = None
        #: Where it came from: "memory" (the agent's), "peer" (a copy another node's agent held)
        #: or "disk" (``--checkpoint-dir``).
        self.source: Optional[str] = None
        # the copy of a save(block=False) in flight, on the one thread that copies
        self._copier: Optional[ThreadPoolExecutor] = None
        self._copying: Optional[Future] = None
        #: Called with the step of each save once it is under way: where elastix.elastic
        #: stops the training function when the job re-forms for a joining node.
        self.after_save: Optional[Callable[[int], None]] = None

    def save(self, step: int, state: Any, *, block: bool = True) -> None:
        """Copies ``state`` (its step ``step``) into the agent's memory, and returns. With
        ``block=False`` it returns at once and the copy goes on beside the caller: ``state``'s
        arrays must not change until :meth:`wait` returns (a save still copying when the
        process dies is not used: the step before is). A save waits for the one before."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be an int >= 0, got {step!r}")
        self.wait()
        structure, flat = flatten(state)
        progress.checkpoint_saved(step)
        if block:
            self._memory.save(step, self.world_size, structure, flat)
        else:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastix-checkpoint")
            self._copying = self._copier.submit(self._memory.save, step, self.world_size, structure, flat)
            # the slot the next save takes, faulted in while the loop goes on if it is fresh
            self._copier.submit(self._memory.own.prepare, flat.size)
        if self.after_save is not None:
            self.after_save(step)

    def wait(self) -> None:
        """Returns once the copy of the last ``save(block=False)`` is done (at once when none is
        in flight); raises what made it fail (shared memory too small, for one)."""
        copying, self._copying = self._copying, None
        if copying is not None:
            copying.result()

    def close(self) -> None:
        """Waits for a save in flight, then lets go of the shared memory this rank's saves keep
        mapped (a later save maps it again); also at the end of a ``with`` block. The head start
        on the next save's slot is given up: there is no next save here."""
        self._memory.own.stop_preparing()
        try:
            self.wait()
        finally:
            if self._copier is not None:
                self._copier.shutdown()
                self._copier = None
            self._memory.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def load(self, like: Any = None) -> Any:
        """The newest state every rank can restore, or None when there is none. With ``like``
        (a state as the program builds it now), a saved state of another structure is refused,
        naming the first difference."""
        self.wait()
        self._loads += 1
        exchange = self._exchanger()
        available = sorted(set(self._memory.steps()) | set(self._disk.steps()))
        refused: Set[int] = set()
        # every attempt refuses the newest common step, which all ranks see alike: they run out
        # of steps together, within one attempt more than any rank has steps
        for attempt in range(1 + len(available)):
            mine = [step for step in available if step not in refused]
            every = exchange(f"{attempt}/steps", mine)
            step = max(set(every[0]).intersection(*every[1:]), default=None)
            if step is None:
                self._nothing_held()
                self.step = self.source = None
                progress.checkpoint_saved(None)
                return None
            held = self._memory.read(step)
            found = held[1:] if held else self._disk.read(step)
            source = held[0] if held else "disk"
            # a torn or corrupt file anywhere: the step before, everywhere
            if not all(exchange(f"{attempt}/read", found is not None)):
                refused.add(step)
                continue
            assert found is not None
            manifest, read = found
            if like is not None:
                difference = first_difference(manifest["structure"], flatten(like)[0])
                if difference:
                    raise CheckpointError(f"the checkpoint of step {step} does not fit the state now: {difference}")
            self.step, self.source = step, source
            state = rebuild(manifest["structure"], read)
            self._memory.restored(step, source)
            progress.checkpoint_saved(step)  # the state is at this step again, whatever was saved since
            return state
        raise CheckpointError(f"no saved step could be read by every rank (refused: {sorted(refused)})")

    def _nothing_held(self) -> None:
        """Refuses to start afresh where the agents found a step held for every rank: a copy
        this node's agent could not take (its log says why) would otherwise lose the job's work."""
        held = os.environ.get(HELD_STEP_VAR)
        if held is not None:
            raise CheckpointError(
                f"the job holds step {held} of every rank in its agents' memory, but not every rank can read it "
                f"(rank {self.rank} restores rank {self.source_rank}'s state); the agent's log says which copy it "
                "could not take. Refusing to start afresh"
            )

    def _exchanger(self) -> Callable[[str, Any], List[Any]]:
        """What gives every rank's value for a question, in rank order: alone, its own; with
        several, through the job's store (MASTER_ADDR, MASTER_PORT), one connection per load."""
        if self.world_size == 1:
            return lambda what, value: [value]
        from ..store import TCPStore

        try:
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except (KeyError, ValueError) as err:
            raise CheckpointError(f"the ranks agree on a step through the job's store, but {err} is not set") from None
        # one attempt's keys: a round re-formed after a member's loss or join charges no restart,
        # and may find the keys of the round before in the store
        attempt = "{}/{}".format(
            os.environ.get("ELASTIX_ROUND", "0"),
            os.environ.get("ELASTIX_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )
        store = TCPStore(host, port, is_master=False)

        def exchange(what: str, value: Any) -> List[Any]:
            prefix = f"elastix/checkpoint/{attempt}/{self._loads}/{what}"
            store.set(f"{prefix}/{self.rank}", json.dumps(value))
            keys = [f"{prefix}/{rank}" for rank in range(self.world_size)]
            return [json.loads(got) for got in store.multi_get(keys)]

        return exchange


def open(memory: Optional[str] = None, directory: Optional[str] = None) -> Checkpoint:
    """This rank's checkpoints: in the memory its agent holds (``elastix run`` says where), or
    in ``memory`` (a directory of your own, for a program run without the agent), with the
    persisted steps in ``directory`` (default: the agent's ``--checkpoint-dir``)."""
    memory = memory or os.environ.get(MEMORY_VAR)
    if not memory:
        raise CheckpointError(
            "elastix.checkpoint keeps checkpoints in the memory of the node's elastix agent: run the program with "
            "`elastix run`, or give elastix.checkpoint.open(memory=DIR) a directory of your own"
        )
    directory = directory or os.environ.get(DIR_VAR)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    saved_world = int(os.environ.get(SAVED_WORLD_VAR, "0")) or None
    return Checkpoint(memory, directory, rank, world_size, saved_world, _source_of(rank))


def _source_of(rank: int) -> Optional[int]:
    """The rank whose state ``rank`` restores, if the agent chose it."""
    for pair in os.environ.get(SOURCES_VAR, "").split(","):
        mine, _, source = pair.partition(":")
        if mine.strip() == str(rank) and source.strip().isdigit():
            return int(source)
    return None
