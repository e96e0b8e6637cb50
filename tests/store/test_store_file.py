"""elastix.FileStore: a store shared through a file, also by separate processes."""

import os
import struct
import subprocess
import sys
import threading
from datetime import timedelta

import pytest

import elastix
from conftest import store_deadline


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "store")


def test_operations(path):
    store = elastix.FileStore(path)
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("k", "v", "w") == b"w"
    assert store.check(["k", "n"]) and not store.check(["x"])
    store.append("k", "!")
    store.multi_set(["a", "b"], ["1", "2"])
    assert store.multi_get(["k", "a", "b"]) == [b"w!", b"1", b"2"]
    assert sorted(store.list_keys()) == ["a", "b", "k", "n"]
    assert store.num_keys() == 5, "the four keys and torch's refcount counter"
    assert store.delete_key("a") and not store.delete_key("a")
    store.queue_push("q", "x")
    assert store.queue_len("q") == 1 and store.queue_pop("q") == b"x"
    with pytest.raises(elastix.QueueEmptyError):
        store.queue_pop("q", block=False)
    store.barrier("b", 1)


def test_handles_see_each_other_and_waits_wake(path):
    first, second = elastix.FileStore(path), elastix.FileStore(path)
    threading.Timer(0.1, lambda: second.set("late", "x")).start()
    assert first.get("late") == b"x"
    first.set_timeout(timedelta(milliseconds=100))
    with pytest.raises(store_deadline(), match="wait timeout after 100ms"):
        first.get("never")


ADDER = """
import sys, elastix
store = elastix.FileStore(sys.argv[1], 4)
for _ in range(100):
    store.add("n", 1)
store.barrier("done", 4)
print(store.get("n").decode())
"""


def test_processes_add_concurrently_and_the_file_is_removed_at_the_end(path):
    procs = [subprocess.Popen([sys.executable, "-c", ADDER, path], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [proc.communicate(timeout=60)[0].strip() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert outs == ["400"] * 4
    assert not os.path.exists(path), "the last of world_size handles deletes the file"


def test_the_file_is_kept_without_a_world_size(path):
    store = elastix.FileStore(path)
    store.set("k", "v")
    del store
    assert elastix.FileStore(path).get("k") == b"v"


def test_the_file_is_torchs_format(path):
    store = elastix.FileStore(path)
    store.set("k", "v")
    assert store.add("n", 7) == 7
    del store

    def entry(key: bytes, value: bytes) -> bytes:
        return struct.pack("<I", len(key)) + key + struct.pack("<I", len(value)) + value

    with open(path, "rb") as file:
        written = file.read()
    assert written == b"".join(
        [
            entry(b"refcount/", b"1"),
            entry(b"/k", b"v"),
            entry(b"/n", b"7"),
            entry(b"cleanup/", b"1"),
            entry(b"refcount/", b"0"),
        ]
    )


def test_clones_are_handles_of_their_own(path):
    store = elastix.FileStore(path, 1)
    clone = store.clone()
    clone.set("k", "v")
    assert store.get("k") == b"v"
    del store
    assert os.path.exists(path), "the clone is still open"
    del clone
    assert not os.path.exists(path)


def test_world_size_0_deletes_the_file_when_no_handle_is_open(path):
    store = elastix.FileStore(path, 0)
    store.set("k", "v")
    del store
    assert not os.path.exists(path)


def test_errors_are_clear(tmp_path, path):
    with pytest.raises(elastix.DistStoreError, match="does not exist"):
        elastix.FileStore(str(tmp_path / "missing" / "store"))
    with open(path, "wb") as junk:
        junk.write(b"not a store at all")
    with pytest.raises(elastix.DistStoreError, match="not a FileStore file"):
        elastix.FileStore(path)
    with open(path, "rb") as junk:
        assert junk.read() == b"not a store at all", "left alone"
    with pytest.raises(TypeError):
        elastix.FileStore(str(tmp_path / "other"), "2")  # type: ignore[arg-type]
