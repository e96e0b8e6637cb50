"""elastix.HashStore: the in-process store."""

import threading
from datetime import timedelta

import pytest

import elastix
from conftest import store_deadline


def test_operations():
    store = elastix.HashStore()
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert store.add("n", 5) == 5
    assert store.compare_set("k", "v", "w") == b"w"
    assert store.compare_set("missing", "x", "y") == b"x"
    assert store.check(["k", "n"]) and not store.check(["nope"])
    store.append("k", "!")
    assert store.get("k") == b"w!"
    store.multi_set(["a", "b"], ["1", "2"])
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]
    assert sorted(store.list_keys()) == ["a", "b", "k", "n"]
    assert store.num_keys() == 4
    assert store.delete_key("a") and not store.delete_key("a")
    store.queue_push("q", "x")
    assert store.queue_len("q") == 1 and store.queue_pop("q") == b"x"
    with pytest.raises(elastix.QueueEmptyError):
        store.queue_pop("q", block=False)
    store.set("text", "abc")
    with pytest.raises(elastix.DistStoreError):
        store.add("text", 1)


def test_waits_across_threads_and_clones():
    store = elastix.HashStore()
    store.set_timeout(timedelta(seconds=60))  # a wait that is never woken fails, not hangs
    other = store.clone()
    threading.Timer(0.1, lambda: other.set("late", "x")).start()
    assert store.get("late") == b"x"
    threading.Timer(0.1, lambda: other.queue_push("q", "item")).start()
    assert store.queue_pop("q") == b"item"


def test_timeouts():
    store = elastix.HashStore()
    store.set_timeout(timedelta(milliseconds=100))
    with pytest.raises(store_deadline(), match="wait timeout after 100ms, keys: missing"):
        store.get("missing")
    with pytest.raises(store_deadline()):
        store.wait(["missing"], timedelta(milliseconds=30))
    store.barrier("b", 1)


def test_bad_input_is_refused_with_a_clear_error():
    store = elastix.HashStore()
    with pytest.raises(elastix.DistStoreError, match="multi_set got 2 keys but 1 values"):
        store.multi_set(["a", "b"], ["only one"])
    assert store.num_keys() == 0  # nothing half-written
    # the native handle's TCP-only members say so on the other stores
    with pytest.raises(TypeError, match="only a TCPStore has one"):
        store._core.ping()
    with pytest.raises(TypeError, match="only a TCPStore has one"):
        _ = store._core.host


def test_a_clone_keeps_the_timeout_and_shares_the_data():
    store = elastix.HashStore()
    store.set_timeout(timedelta(seconds=42))
    other = store.clone()
    assert other.timeout == timedelta(seconds=42)
    other.set_timeout(timedelta(seconds=7))
    assert store.timeout == timedelta(seconds=42)  # each handle its own timeout
    other.set("shared", "yes")
    assert store.get("shared") == b"yes"
