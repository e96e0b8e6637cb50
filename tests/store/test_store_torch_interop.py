"""Wire compatibility with real torch: torch's client against the elastix server, and the
elastix client against torch's servers. They need torch: CI runs them in its torch stage
(tests/torch_gate.py)."""

import threading
from datetime import timedelta

import pytest

import elastix
import torch_gate
from conftest import reserved_port

pytestmark = pytest.mark.torch
torch_dist = torch_gate.need()

TIMEOUT = timedelta(seconds=10)


def exercise(store, queues=True, barrier=True):
    """The same calls on either implementation; returns what they gave."""
    store.set("key0", "value0")
    store.set("bin", b"\x00\xff")
    results = [store.get("key0"), store.get("bin"), store.add("cnt", 5), store.add("cnt", -2)]
    results.append(store.compare_set("cs", "", "v1"))
    results.append(store.compare_set("cs", "wrong", "v2"))
    results.append(store.compare_set("cs", "v1", "v2"))
    results.append(store.compare_set("missing_cs", "x", "y"))
    results.append(store.check(["key0", "nokey"]))
    store.wait(["key0", "cnt"])
    store.append("app", "po")
    store.append("app", "tato")
    store.multi_set(["m1", "m2"], ["a", "bb"])
    results += [store.get("app"), store.multi_get(["m1", "m2"]), store.delete_key("m1")]
    try:
        store.wait(["nokey"], timedelta(milliseconds=200))
        results.append("no timeout")
    except RuntimeError as err:
        results.append(str(err).split(" after")[0])
    if queues:
        store.queue_push("q", "x1")
        store.queue_push("q", "x2")
        results += [store.queue_len("q"), store.queue_pop("q"), store.queue_pop("q", False)]
    results.append(sorted(store.list_keys()))
    if barrier:
        store.barrier("bar", 1)
    results.append(store.num_keys())
    return results


def test_torch_client_and_elastix_client_agree_on_an_elastix_server():
    server = elastix.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    with_elastix = exercise(elastix.PrefixStore("e", server))
    torch_client = torch_dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
    with_torch = exercise(torch_dist.PrefixStore("t", torch_client), barrier=False)
    assert with_torch[:-2] == with_elastix[:-2]


def test_torch_clients_count_into_an_elastix_master_and_see_its_data():
    store = elastix.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=TIMEOUT)
    workers = [
        torch_dist.TCPStore("127.0.0.1", store.port, world_size=3, is_master=False, timeout=TIMEOUT) for _ in range(2)
    ]
    assert store.num_keys() == 1  # only init/, which torch's clients incremented
    store.set("from_elastix", "hi")
    assert workers[0].get("from_elastix") == b"hi"
    workers[1].set("from_torch", "hello")
    assert store.get("from_torch") == b"hello"
    # a torch client blocked in get() is woken by an elastix set
    threading.Timer(0.1, lambda: store.set("late", "now")).start()
    assert workers[0].get("late") == b"now"
    workers[0].set_timeout(timedelta(milliseconds=200))
    with pytest.raises(RuntimeError, match="wait timeout"):
        workers[0].get("never")
    workers[0].set("after_timeout", "ok")
    assert workers[0].get("after_timeout") == b"ok"


@pytest.mark.parametrize("use_libuv", [True, False])
def test_elastix_client_against_torch_servers(use_libuv):
    server = torch_dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=use_libuv, timeout=TIMEOUT
    )
    client = elastix.TCPStore("127.0.0.1", server.port, timeout=TIMEOUT)
    results = exercise(client, queues=use_libuv, barrier=True)
    assert results[0] == b"value0" and results[2:4] == [5, 3]
    assert results[4:8] == [b"v1", b"v1", b"v2", b"x"]
    threading.Timer(0.1, lambda: server.set("late", "now")).start()
    assert client.get("late") == b"now"
    # with torch loaded, a timeout is torch's DistStoreError (and elastix's), as torch's store raises
    with pytest.raises(torch_dist.DistStoreError) as timed_out:
        client.barrier("never", 2, timedelta(milliseconds=100))
    assert isinstance(timed_out.value, elastix.DistStoreError) and not isinstance(timed_out.value, TimeoutError)
    assert client.get("key0") == b"value0"


def test_torch_master_waits_for_an_elastix_worker():
    holder = {}

    def master():
        holder["m"] = torch_dist.TCPStore("127.0.0.1", port, world_size=2, is_master=True, timeout=TIMEOUT)

    with reserved_port() as port:  # torch's server binds it; the worker retries until it does
        thread = threading.Thread(target=master)
        thread.start()
        worker = elastix.TCPStore("127.0.0.1", port, world_size=2, timeout=TIMEOUT)
        thread.join(30)
    assert "m" in holder
    holder["m"].set("k", "v")
    assert worker.get("k") == b"v"


GLOO_RANK = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist  # loaded first: elastix's stores are then torch Stores too
import elastix
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = elastix.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=60))
# either PrefixStore over an elastix store
prefixed = elastix.PrefixStore("job", store) if rank == 0 else dist.PrefixStore("job", store)
dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=2)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
dist.barrier()
print(f"sum {t.item()}", flush=True)
dist.destroy_process_group()
"""


def test_torch_init_process_group_takes_elastix_stores_and_prefix_stores_over_them():
    import subprocess
    import sys

    with reserved_port() as port:
        ranks = [
            subprocess.Popen([sys.executable, "-c", GLOO_RANK, str(rank), str(port)], stdout=subprocess.PIPE, text=True)
            for rank in range(2)
        ]
        outputs = [proc.communicate(timeout=120)[0] for proc in ranks]
    assert [proc.returncode for proc in ranks] == [0, 0], outputs
    assert all("sum 3.0" in out for out in outputs), outputs


def test_an_elastix_store_is_a_torch_store_once_torch_is_loaded():
    store = elastix.HashStore()
    assert isinstance(store, torch_dist.Store)
    assert isinstance(store, elastix.Store)
    store.set("a", "1")
    assert torch_dist.PrefixStore("p", store).add("n", 2) == 2
    assert store.get("p/n") == b"2"
    copy = store.clone()  # a clone is one too
    assert isinstance(copy, torch_dist.Store)
    torch_dist.PrefixStore("q", copy).set("x", "y")
    assert store.get("q/x") == b"y"


CATCHERS = ("DistError", "DistStoreError", "DistNetworkError", "QueueEmptyError")
BUILTINS = (RuntimeError, TimeoutError, ValueError, OSError, KeyError)


def caught_by(call):
    """Which torch and builtin classes the error `call` raises is an instance of."""
    try:
        call()
    except Exception as err:
        return {name for name in CATCHERS if isinstance(err, getattr(torch_dist, name))} | {
            cls.__name__ for cls in BUILTINS if isinstance(err, cls)
        }
    raise AssertionError("no error")


def test_store_errors_are_caught_exactly_as_torchs_stores_errors_are():
    import socket

    short = timedelta(seconds=1)
    with reserved_port() as port:
        torch_store = torch_dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=short)
        ours = elastix.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=short)
        for name, call in [
            ("wait timeout", lambda s: s.get("missing")),
            ("empty queue", lambda s: s.queue_pop("q", block=False)),
        ]:
            assert caught_by(lambda call=call: call(ours)) == caught_by(lambda call=call: call(torch_store)), name
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        mine = caught_by(lambda: elastix.TCPStore("127.0.0.1", port, timeout=short))
        theirs = caught_by(lambda: torch_dist.TCPStore("127.0.0.1", port, timeout=short))
        assert mine == theirs, "connect timeout"
    err = None
    try:
        elastix.TCPStore("127.0.0.1", port, timeout=short)
    except torch_dist.DistNetworkError as caught:
        err = caught
    assert err is not None and "The client socket has timed out after" in str(err), err
