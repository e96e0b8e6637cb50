"""One file store shared by torch and elastix processes: elastix.FileStore writes and reads
torch's FileStore format. Each side runs in a process of its own (a torch process imports no
elastix, an elastix process no torch), driven line by line from the test, so that the test
orders their operations. They need torch: CI runs them in its torch stage (tests/torch_gate.py)."""

import json
import os
import queue
import struct
import subprocess
import sys
import threading
from typing import Any, List

import pytest

import torch_gate

pytestmark = pytest.mark.torch
torch_gate.need()

REPLY_TIMEOUT = 60  # seconds; every reply, and so every wait, is bounded

PEER = r"""
import json, sys
from datetime import timedelta
impl, path, world_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
if impl == "torch":
    from torch.distributed import FileStore
else:
    from elastix import FileStore

def plain(value):
    if isinstance(value, bytes):
        return value.decode("latin-1")
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value

store = None
for line in sys.stdin:
    op, *args = json.loads(line)
    try:
        if op == "open":
            store = FileStore(path, world_size)
            store.set_timeout(timedelta(seconds=30))
            result = None
        elif op == "close":
            del store
            store = result = None
        elif op == "add_many":
            key, times = args
            result = [store.add(key, 1) for _ in range(times)]
        elif op == "wait":
            result = store.wait(args[0], timedelta(seconds=args[1]))
        else:
            result = getattr(store, op)(*args)
        reply = {"ok": plain(result)}
    except Exception as err:
        reply = {"error": type(err).__name__, "message": str(err)}
    print(json.dumps(reply), flush=True)
"""


class Peer:
    """A torch or an elastix process with one FileStore handle on `path`."""

    def __init__(self, impl: str, path: str, world_size: int = -1) -> None:
        self.impl = impl
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER, impl, path, str(world_size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.replies: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.replies.put(line)

    def send(self, op: str, *args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([op, *args]) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> Any:
        try:
            answer = json.loads(self.replies.get(timeout=REPLY_TIMEOUT))
        except queue.Empty:
            self.proc.kill()
            stderr = self.proc.stderr.read() if self.proc.stderr else ""
            pytest.fail(f"the {self.impl} process did not answer within {REPLY_TIMEOUT} s; stderr: {stderr}")
        assert "ok" in answer, f"{self.impl}: {answer}"
        return answer["ok"]

    def __call__(self, op: str, *args: Any) -> Any:
        self.send(op, *args)
        return self.reply()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=REPLY_TIMEOUT)


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "store")


@pytest.fixture
def peers():
    """Makes peers; kills whatever is left of them at the end."""
    made: List[Peer] = []

    def make(impl: str, path: str, world_size: int = -1) -> Peer:
        peer = Peer(impl, path, world_size)
        made.append(peer)
        peer("open")
        return peer

    yield make
    for peer in made:
        peer.stop()


def test_elastix_reads_what_torch_writes(path, peers):
    torch_side = peers("torch", path)
    elastix_side = peers("elastix", path)
    torch_side("set", "k", "v")
    assert torch_side("add", "n", 5) == 5
    torch_side("append", "a", "po")
    torch_side("append", "a", "tato")
    torch_side("multi_set", ["m1", "m2"], ["1", "2"])
    assert torch_side("compare_set", "k", "v", "w") == "w"
    torch_side("set", "gone", "x")
    torch_side("delete_key", "gone")
    assert elastix_side("multi_get", ["k", "n", "a", "m1", "m2"]) == ["w", "5", "potato", "1", "2"]
    assert elastix_side("check", ["k", "n"]) and not elastix_side("check", ["gone"])
    assert elastix_side("add", "n", 1) == 6
    assert torch_side("get", "n") == "6"
    assert sorted(elastix_side("list_keys")) == ["a", "k", "m1", "m2", "n"]
    assert elastix_side("num_keys") == torch_side("num_keys") == 6, "five keys and torch's refcount"


def test_torch_reads_what_elastix_writes(path, peers):
    elastix_side = peers("elastix", path)
    torch_side = peers("torch", path)
    elastix_side("set", "k", "v")
    assert elastix_side("add", "n", 5) == 5
    elastix_side("append", "a", "po")
    elastix_side("append", "a", "tato")
    elastix_side("multi_set", ["m1", "m2"], ["1", "2"])
    assert elastix_side("compare_set", "k", "v", "w") == "w"
    assert elastix_side("compare_set", "k", "v", "x") == "w"
    elastix_side("set", "gone", "x")
    assert elastix_side("delete_key", "gone")
    # elastix's queue entries are invisible to torch, and do not disturb its reader
    elastix_side("queue_push", "q", "item")
    assert torch_side("multi_get", ["k", "n", "a", "m1", "m2"]) == ["w", "5", "potato", "1", "2"]
    assert torch_side("check", ["k", "n"]) and not torch_side("check", ["gone"])
    assert torch_side("add", "n", 1) == 6
    assert elastix_side("get", "n") == "6"
    assert elastix_side("queue_pop", "q") == "item"
    assert torch_side("num_keys") == elastix_side("num_keys") == 6, "five keys and torch's refcount"


SEQUENCE = [
    ("add", "key", 1),
    ("add", "key", 2),
    ("set", "key0", "value0"),
    ("compare_set", "key1", "", "new"),
    ("compare_set", "key1", "wrong", "newer"),
    ("compare_set", "missing", "x", "y"),
    ("set", "-key3", "7"),
    ("delete_key", "-key3"),
    ("append", "ap", "po"),
    ("append", "ap", "tato"),
    ("multi_set", ["m1", "m2"], ["a", "b"]),
    ("set", "empty", ""),
    ("add", "empty", 4),
]


def test_the_same_operations_write_the_same_file_and_count_the_same_keys(tmp_path, peers):
    files = {impl: str(tmp_path / impl) for impl in ("torch", "elastix")}
    sides = {impl: peers(impl, file) for impl, file in files.items()}
    for op, *args in SEQUENCE:
        answers = {impl: side(op, *args) for impl, side in sides.items()}
        assert answers["torch"] == answers["elastix"], (op, args)
        counts = {impl: side("num_keys") for impl, side in sides.items()}
        assert counts["torch"] == counts["elastix"], (op, args, counts)
    for side in sides.values():
        side("close")
    contents = {}
    for impl, file in files.items():
        with open(file, "rb") as written:
            contents[impl] = written.read()
    assert contents["elastix"] == contents["torch"]
    # and each reads the other's file alike
    readers = {impl: peers(impl, files["torch" if impl == "elastix" else "elastix"]) for impl in files}
    assert readers["torch"]("num_keys") == readers["elastix"]("num_keys") == 9


def test_concurrent_adds_from_torch_and_elastix_sum_exactly(path, peers):
    sides = [peers("torch", path), peers("elastix", path)]
    for side in sides:
        side.send("add_many", "n", 300)
    seen = [total for side in sides for total in side.reply()]
    assert sorted(seen) == list(range(1, 601)), "every add saw a distinct total"
    assert sides[0]("get", "n") == sides[1]("get", "n") == "600"


@pytest.mark.parametrize("waiter_impl", ["elastix", "torch"])
def test_a_wait_is_woken_by_a_set_from_the_other_side(path, peers, waiter_impl):
    setter_impl = "torch" if waiter_impl == "elastix" else "elastix"
    waiter, setter = peers(waiter_impl, path), peers(setter_impl, path)
    waiter.send("wait", ["late"], 30)
    waiter.send("get", "late")  # queued behind the wait
    setter("set", "late", "here")
    assert waiter.reply() is None
    assert waiter.reply() == "here"


@pytest.mark.parametrize("last", ["elastix", "torch"])
def test_the_last_of_world_size_handles_deletes_the_file_whichever_side_it_is(path, peers, last):
    first = peers("torch" if last == "elastix" else "elastix", path, 2)
    final = peers(last, path, 2)
    first("set", "k", "v")
    first("close")
    assert os.path.exists(path), "one handle is still open"
    assert final("get", "k") == "v"
    final("close")
    assert not os.path.exists(path)


def test_an_entry_cut_short_is_cut_off_by_elastix_so_that_torch_can_read_the_file(path, peers):
    # torch's reader would spin forever at such an entry (its writer killed mid-write)
    def entry(key: bytes, value: bytes) -> bytes:
        return struct.pack("<I", len(key)) + key + struct.pack("<I", len(value)) + value

    with open(path, "wb") as file:
        file.write(entry(b"refcount/", b"1") + entry(b"/kept", b"v") + entry(b"/torn", b"0123456789")[:-4])
    elastix_side = peers("elastix", path)
    assert elastix_side("get", "kept") == "v" and not elastix_side("check", ["torn"])
    torch_side = peers("torch", path)
    assert torch_side("get", "kept") == "v"
    assert torch_side("num_keys") == elastix_side("num_keys") == 2
