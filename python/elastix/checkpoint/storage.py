"""Where a rank's saved steps are: the two slots in the agent's memory, and the steps the
agent persisted (the layout of rust/core/src/agent/checkpoints/layout.rs)."""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
import zlib
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .errors import CheckpointError
from .tree import Flat

FORMAT_VERSION = 1
#: A rank's slots: the newest step, the one being written, and the steps the agent pins while
#: it copies them to a peer (``pinned.json``: at most two).
SLOTS = (0, 1, 2, 3)
PINNED = "pinned.json"
#: Bytes a slot's head start faults in between looks at whether it should stop.
_PREPARE_CHUNK = 16 << 20


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            manifest: Dict[str, Any] = json.load(f)
        return manifest if manifest.get("v") == FORMAT_VERSION else None
    except (OSError, ValueError):
        return None


def _write_json(path: str, manifest: Dict[str, Any]) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump(manifest, f)
    os.replace(temporary, path)


def _array(buffer: Any, leaf: Dict[str, Any]) -> np.ndarray:
    """A copy of the array ``leaf`` describes, out of ``buffer``."""
    dtype = np.dtype(leaf["dtype"])
    count = leaf["nbytes"] // dtype.itemsize if dtype.itemsize else 0
    view = np.frombuffer(buffer, dtype=dtype, count=count, offset=leaf["offset"])
    return view.reshape(leaf["shape"]).copy()


class Slots:
    """A rank's two slots in a directory (``<memory>/rank-<r>``, or a peer's copies in
    ``<memory>/peers/rank-<r>``)."""

    def __init__(self, directory: str, rank: int, pinned: Optional[str] = None) -> None:
        self.dir = directory
        self.rank = rank
        self._pinned = pinned
        # each slot's data file stays mapped between saves: a save into pages already mapped
        # and touched is a plain memory copy (a fresh mapping pays a fault per page, in the
        # copy, which NumPy makes without the GIL: MAP_POPULATE would fault them in mmap(),
        # which Python calls holding the GIL, and a pipelined save's first copy into a slot
        # would stall the training loop for as long, 0.2-1.3 s per 256 MB here)
        self._maps: Dict[int, Tuple[int, mmap.mmap]] = {}
        # set while the slots close: a head start in progress (prepare) gives up
        self._closing = threading.Event()

    def stop_preparing(self) -> None:
        """Ends a :meth:`prepare` in progress at its next chunk: the process leaves its group
        (a re-form: the next save may be another rank's, into other slots), and closing would
        wait for faults no save of this rank here will use."""
        self._closing.set()

    def close(self) -> None:
        """Unmaps the slots (the next save maps them again)."""
        self._closing.clear()
        for _, memory in self._maps.values():
            memory.close()
        self._maps.clear()

    def _mapped(self, slot: int, data: str, size: int) -> mmap.mmap:
        held = self._maps.get(slot)
        if held is not None and held[0] == size and os.path.exists(data):
            return held[1]
        if held is not None:
            held[1].close()
        fd = os.open(data, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._maps[slot] = (size, memory)
        return memory

    def prepare(self, size: int) -> None:
        """Faults in the slot the next save will write into, if no step was ever written to it
        (zeros over zeros), so that the save copies at memory speed. Runs beside the loop, on
        the thread that copies pipelined saves, after each: a fresh slot's faults had doubled a
        save's copy while the node's agent filled fresh memory of its own (the copies it sends
        and receives), and the loop waited for it. Only the slots saves use are touched: two,
        or up to four while the agent pins steps it copies to a peer."""
        try:
            slot = self._slot_to_write()
            data = self._paths(slot)[0]
            if slot in self._maps or (os.path.exists(data) and os.stat(data).st_blocks * 512 >= size):
                return  # written before (or prepared whole): its pages are in
            try:
                self._check_room(data, size)
            except CheckpointError:
                return  # a page fault past the room would kill the process; the save says why
            pages = np.frombuffer(self._mapped(slot, data, max(size, 1)), dtype=np.uint8)
            # one write per page, a chunk at a time; NumPy lets go of the GIL for each
            for start in range(0, pages.size, _PREPARE_CHUNK):
                if self._closing.is_set():
                    return
                pages[start : start + _PREPARE_CHUNK : mmap.PAGESIZE] = 0
        except OSError:
            pass  # only a head start: the save into the slot meets the error and names it

    def _paths(self, slot: int) -> tuple[str, str]:
        base = os.path.join(self.dir, f"slot-{slot}")
        return base + ".data", base + ".json"

    def manifests(self) -> Dict[int, Dict[str, Any]]:
        """The whole slots: slot -> manifest."""
        found = {slot: _read_json(self._paths(slot)[1]) for slot in SLOTS}
        return {slot: manifest for slot, manifest in found.items() if manifest and manifest["rank"] == self.rank}

    def steps(self) -> Dict[int, int]:
        """step -> slot of the whole slots."""
        return {manifest["step"]: slot for slot, manifest in self.manifests().items()}

    def _slot_to_write(self) -> int:
        """The slot holding the oldest step that is neither the newest nor pinned by the agent;
        a new slot only when there is none (the agent pins the steps it copies to a peer)."""
        held = self.manifests()
        newest = max((manifest["step"] for manifest in held.values()), default=None)
        keep = {newest, *self._pinned_steps()}
        free = sorted((manifest["step"], slot) for slot, manifest in held.items() if manifest["step"] not in keep)
        if free:
            return free[0][1]
        unused = [slot for slot in SLOTS if slot not in held]
        return unused[0] if unused else min(held, key=lambda slot: held[slot]["step"])

    def _pinned_steps(self) -> List[int]:
        pinned = _read_json(self._pinned) if self._pinned else None
        return list(pinned.get("steps", [])) if pinned else []

    def save(self, step: int, world_size: int, structure: Any, flat: Flat) -> None:
        """Writes into a slot that holds neither the newest step nor a pinned one: the
        manifest goes first (the slot is not whole while it is written) and comes back last."""
        started = time.perf_counter()
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        slot = self._slot_to_write()
        data, manifest = self._paths(slot)
        if os.path.exists(manifest):
            os.unlink(manifest)
        self._check_room(data, flat.size)
        memory = self._mapped(slot, data, max(flat.size, 1))
        for offset, array in flat.arrays:
            target = np.frombuffer(memory, dtype=np.uint8, count=array.nbytes, offset=offset)
            target[...] = array.reshape(-1).view(np.uint8)
            del target
        _write_json(manifest, {
            "v": FORMAT_VERSION, "step": int(step), "rank": self.rank, "world_size": int(world_size),
            "size": flat.size, "generation": time.time_ns(), "saved": time.time(),
            "took": time.perf_counter() - started, "structure": structure,
        })  # fmt: skip

    def _check_room(self, data: str, size: int) -> None:
        """Refuses a state the shared memory cannot hold (writing it would kill the process)."""
        have = os.path.getsize(data) if os.path.exists(data) else 0
        stats = os.statvfs(self.dir)
        free = stats.f_bavail * stats.f_frsize
        if size - have > free:
            raise CheckpointError(
                f"shared memory too small for this checkpoint: {size} bytes needed, {free + have} available in "
                f"{os.path.dirname(self.dir)}; raise it (mount -o remount,size=<bytes> /dev/shm; in a container: "
                "docker run --shm-size, or a memory-backed emptyDir on Kubernetes)"
            )

    def read(self, step: int) -> Optional[tuple[Dict[str, Any], Any]]:
        """The manifest of ``step`` and a function that copies an array out, if a slot holds it."""
        for slot, manifest in self.manifests().items():
            if manifest["step"] == step:
                with open(self._paths(slot)[0], "rb") as f:
                    if os.fstat(f.fileno()).st_size < manifest["size"]:
                        return None
                    # the arrays are copied straight out of the agent's memory: one copy
                    contents = mmap.mmap(f.fileno(), max(manifest["size"], 1), prot=mmap.PROT_READ)
                return manifest, _reader(contents)
        return None


class Memory:
    """What the agent's memory holds for a rank: its own slots, where it saves, and, to
    restore from, the slots of its source rank (itself, unless the world grew since the save)
    and the copies of them a peer's agent sent (``peers/``)."""

    def __init__(self, root: str, rank: int, source: int) -> None:
        self.root = root
        self.own = Slots(os.path.join(root, f"rank-{rank}"), rank, os.path.join(root, PINNED))
        self.places = (
            ("memory", Slots(os.path.join(root, f"rank-{source}"), source)),
            ("peer", Slots(os.path.join(root, "peers", f"rank-{source}"), source)),
        )

    def save(self, step: int, world_size: int, structure: Any, flat: Flat) -> None:
        self.own.save(step, world_size, structure, flat)

    def close(self) -> None:
        self.own.close()

    def steps(self) -> List[int]:
        return sorted({step for _, slots in self.places for step in slots.steps()})

    def read(self, step: int) -> Optional[tuple[str, Dict[str, Any], Any]]:
        """Where ``step`` is ("memory" or "peer"), its manifest and its reader, if held."""
        for where, slots in self.places:
            found = slots.read(step)
            if found is not None:
                return (where, *found)
        return None

    def restored(self, step: int, source: str) -> None:
        """Tells the agent what this rank restored (``elastix status`` shows it)."""
        os.makedirs(self.own.dir, mode=0o700, exist_ok=True)
        _write_json(os.path.join(self.own.dir, "restored.json"), {"step": step, "source": source, "at": time.time()})


def _reader(contents: Any) -> Any:
    return lambda leaf: _array(contents, leaf)


class Disk:
    """A rank's steps persisted by the agent under the job's checkpoint directory."""

    def __init__(self, run_dir: Optional[str], rank: int) -> None:
        self.run_dir = run_dir
        self.rank = rank

    def _paths(self, step: int) -> tuple[str, str]:
        base = os.path.join(self.run_dir or "", f"step-{step:012d}", f"rank-{self.rank}")
        return base + ".data", base + ".json"

    def steps(self) -> List[int]:
        if not self.run_dir or not os.path.isdir(self.run_dir):
            return []
        steps = []
        for name in os.listdir(self.run_dir):
            if name.startswith("step-") and name[5:].isdigit() and os.path.exists(self._paths(int(name[5:]))[1]):
                steps.append(int(name[5:]))
        return sorted(steps)

    def read(self, step: int) -> Optional[tuple[Dict[str, Any], Any]]:
        """Like :meth:`Memory.read`; None for a file whose checksum or size is wrong."""
        data, manifest_path = self._paths(step)
        manifest = _read_json(manifest_path)
        if manifest is None or manifest.get("rank") != self.rank:
            return None
        try:
            with open(data, "rb") as f:
                contents = f.read()
        except OSError:
            return None
        if len(contents) != manifest["size"] or zlib.crc32(contents) != manifest["crc32"]:
            return None
        return manifest, _reader(contents)
