"""elastix.PrefixStore over every kind of store."""

from datetime import timedelta

import pytest

import elastix
from conftest import store_deadline


@pytest.fixture(params=["tcp", "hash"])
def base(request, master):
    return master if request.param == "tcp" else elastix.HashStore()


def test_keys_are_namespaced(base):
    store = elastix.PrefixStore("pfx", base)
    store.set("a", "1")
    assert base.get("pfx/a") == b"1"
    assert store.get("a") == b"1"
    assert store.add("c", 2) == 2
    assert store.check(["a"]) is True
    assert store.compare_set("a", "1", "2") == b"2"
    store.multi_set(["x", "y"], ["1", "2"])
    assert store.multi_get(["x", "y"]) == [b"1", b"2"]
    store.append("x", "0")
    assert store.get("x") == b"10"
    assert store.delete_key("y") is True
    store.queue_push("q", "item")
    assert store.queue_len("q") == 1
    assert store.queue_pop("q") == b"item"
    store.wait(["a", "c"])
    assert store.num_keys() == base.num_keys()  # the whole underlying store, as torch counts
    base.set("other", "z")
    assert sorted(store.list_keys()) == ["a", "c", "x"]


def test_nesting_and_underlying_store(base):
    inner = elastix.PrefixStore("p", base)
    outer = elastix.PrefixStore("p", inner)
    outer.set("k", "v")
    assert base.get("p/p/k") == b"v"
    assert outer.underlying_store is inner
    assert outer._underlying_non_prefix_store is base


def test_barrier_uses_add_set_wait_under_the_prefix(base):
    store = elastix.PrefixStore("pfx", base)
    store.barrier("b", 1)
    assert base.get("pfx/b/num_members") == b"1"
    assert base.get("pfx/b/last_member") == b"1"
    store.set_timeout(timedelta(milliseconds=100))
    with pytest.raises(store_deadline()):
        store.barrier("never", 2)


def test_timeout_is_the_underlying_stores(base):
    store = elastix.PrefixStore("pfx", base)
    store.set_timeout(timedelta(seconds=3))
    assert base.timeout == timedelta(seconds=3)
    assert store.timeout == timedelta(seconds=3)
    with pytest.raises(store_deadline(), match="wait timeout"):
        store.wait(["missing"], timedelta(milliseconds=50))


def test_bad_arguments():
    with pytest.raises(ValueError, match="store argument cannot be None"):
        elastix.PrefixStore("p", None)
    with pytest.raises(TypeError):
        elastix.PrefixStore("p", object())


def test_clone_keeps_the_prefix(base):
    store = elastix.PrefixStore("pfx", base)
    store.clone().set("k", "v")
    assert store.get("k") == b"v"


def test_a_store_subclass_with_only_set_and_get_has_torchs_defaults():
    """torch's Store builds multi_get, multi_set, append (on compare_set), barrier's parts and
    the timeout on what a subclass implements; the rest say what is missing."""
    from datetime import timedelta

    from elastix import Store

    class Dict(Store):
        def __init__(self):
            self.data = {}

        def set(self, key, value):
            self.data[key if isinstance(key, str) else key.decode()] = (
                value if isinstance(value, bytes) else value.encode()
            )

        def get(self, key):
            return self.data[key if isinstance(key, str) else key.decode()]

    store = Dict()
    store.multi_set(["a", "b"], ["1", b"2"])
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]
    assert store.has_extended_api() is False
    assert store.timeout == timedelta(seconds=300)
    store.set_timeout(timedelta(seconds=3))
    assert store.timeout == timedelta(seconds=3)
    with pytest.raises(RuntimeError, match=r"Dict does not implement Store\.add"):
        store.add("n", 1)
    with pytest.raises(NotImplementedError, match="queue support is not implemented"):
        store.queue_push("q", "x")
    with pytest.raises(NotImplementedError, match="listKeys support is not implemented"):
        store.list_keys()

    class WithCompareSet(Dict):
        def compare_set(self, key, expected, desired):
            current = self.data.get(key)
            expected = expected if isinstance(expected, bytes) else expected.encode()
            if (current is None and expected == b"") or current == expected:
                self.data[key] = desired
                return desired
            return expected if current is None else current

    appending = WithCompareSet()
    appending.append("log", b"po")
    appending.append("log", b"tato")
    assert appending.get("log") == b"potato"
