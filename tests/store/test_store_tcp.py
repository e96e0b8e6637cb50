"""elastix.TCPStore: torch's API and semantics (the cases of torch's own test_store.py where
they apply), timeouts, GIL release, interruption, and concurrency."""

import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

import elastix
from conftest import blocked, closed_port, network_deadline, run_python, store_deadline


def test_set_get_check(master):
    for i in range(1, 4):
        master.add("key", i)
    master.set("key0", "value0")
    master.set("key1", b"value1")
    master.set("key2", "value2")
    for i in range(1, 7):
        master.add("key3", i)
    assert master.num_keys() == 5
    assert master.get("key") == b"6"
    assert master.get("key3") == b"21"
    assert master.get("key0") == b"value0"
    assert master.check(["key3"]) is True
    assert master.check(["Randomkey3"]) is False
    master.set("-key3", "7")
    assert master.get("-key3") == b"7"
    assert master.delete_key("-key3") is True
    assert master.delete_key("-key3") is False
    assert master.num_keys() == 5


def test_compare_set(master):
    assert master.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
    master.set("cs_key0", "value0")
    assert master.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert master.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert master.get("cs_key0") == b"new_value0"
    assert master.compare_set("cs_key1", "", "new_value1") == b"new_value1"


def test_values_are_bytes_and_keys_may_be_any_text(master):
    master.set("é", "é")
    master.set("bin", b"\x00\xff")
    master.set("ключ", b"v")
    assert master.get("é") == "é".encode()
    assert master.get(b"bin") == b"\x00\xff"
    assert sorted(master.list_keys()) == sorted(["é", "bin", "ключ"])
    master.set("empty", "")
    assert master.get("empty") == b""
    with pytest.raises(TypeError):
        master.set(1, "x")
    with pytest.raises(TypeError):
        master.set("k", 1)


def test_add_wraps_like_int64_and_refuses_text(master):
    master.set("big", str(2**63 - 1))
    assert master.add("big", 1) == -(2**63)
    master.set("text", "abc")
    with pytest.raises(elastix.DistNetworkError):
        master.add("text", 1)  # the server drops the connection, as torch's does


def test_append_multi_and_queues(master):
    master.set("foo", "po")
    master.append("foo", "tato")
    master.append("bar", "po")
    master.append("bar", "tato")
    assert master.get("foo") == master.get("bar") == b"potato"
    master.multi_set(["m1", "m2"], ["po", "tato"])
    assert master.multi_get(["m1", "m2"]) == [b"po", b"tato"]
    assert master.multi_get([]) == []
    with pytest.raises(elastix.DistStoreError, match="same length"):
        master.multi_set(["a", "b"], ["only one"])

    assert master.check(["q"]) is False and master.queue_len("q") == 0
    master.queue_push("q", "1")
    master.queue_push("q", b"2")
    assert master.check(["q"]) is True and master.queue_len("q") == 2
    master.wait(["q"])
    assert master.queue_pop("q") == b"1"
    assert master.queue_pop("q", block=False) == b"2"
    with pytest.raises(elastix.QueueEmptyError, match="empty"):
        master.queue_pop("q", block=False)


def test_queues_between_two_clients(master):
    other = master.clone()

    def side_b():
        assert other.queue_pop("a") == b"a1"
        other.queue_push("b", "b1")

    thread = threading.Thread(target=side_b)
    thread.start()
    master.queue_push("a", "a1")
    assert master.queue_pop("b") == b"b1"
    thread.join(10)


def test_legacy_client_flag_refuses_queues_like_torch(master):
    legacy = elastix.TCPStore("127.0.0.1", master.port, use_libuv=False)
    assert legacy.libuvBackend is False
    with pytest.raises(NotImplementedError, match="legacy"):
        legacy.queue_push("q", "x")


def test_num_keys_counts_init_and_list_keys_hides_it():
    store = elastix.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    assert store.num_keys() == 1
    store.add("key", 1)
    store.set("key0", "v")
    assert store.num_keys() == 3
    assert sorted(store.list_keys()) == ["key", "key0"]


def test_wait_and_get_timeouts_are_timeout_errors_and_keep_the_connection(master):
    start = time.monotonic()
    with pytest.raises(store_deadline(), match=r"wait timeout after 250ms, keys: /bad_key"):
        master.wait(["bad_key"], timedelta(milliseconds=250))
    assert time.monotonic() - start >= 0.25
    master.set_timeout(timedelta(milliseconds=100))
    assert master.timeout == timedelta(milliseconds=100)
    with pytest.raises(store_deadline(), match="wait timeout after 100ms, keys: /nonexistent key"):
        master.get("nonexistent key")
    with pytest.raises(elastix.DistStoreError, match="timeout"):
        master.queue_pop("non_existent")
    with pytest.raises(RuntimeError, match="barrier timeout after 100ms, key: bar2"):
        master.barrier("bar2", 2)
    master.set("the_key", "x")
    assert master.get("the_key") == b"x"
    master.add("good_key", 1)
    master.wait(["good_key"])


def count(store, key):
    """A barrier's arrival count, without blocking (its arrivals do not wake a GET)."""
    return int(store.get(key)) if store.check([key]) else 0


def until(predicate, what, timeout=30.0):
    """Polls `predicate` (something cheap: a store read, a /proc file) until it holds; bounded in time."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_barrier_releases_all_parties(master):
    others = [master.clone() for _ in range(3)]
    done = []

    def arrive(store):
        store.barrier("together", 4, timedelta(seconds=10))
        done.append(store)

    threads = [threading.Thread(target=arrive, args=(s,)) for s in others]
    for thread in threads:
        thread.start()
    until(lambda: count(master, "together") == 3, "the three arrivals")
    assert done == []
    master.barrier("together", 4)
    for thread in threads:
        thread.join(30)
    assert len(done) == 3


def test_blocking_calls_release_the_gil(master):
    ticks = 0
    stop = threading.Event()

    def spin():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        with pytest.raises(store_deadline()):
            master.wait(["never"], timedelta(milliseconds=300))
    finally:
        stop.set()
        thread.join()
    assert ticks > 1000, "another Python thread must run while wait() blocks"


def test_wait_wakes_on_a_set_from_another_thread(master, client):
    def later():
        time.sleep(0.2)  # the delay under test: the set comes while get() blocks
        client.set("late", "here")

    threading.Thread(target=later).start()
    assert master.get("late") == b"here"  # woken by the set, well before its 10 s timeout


def test_clone_shares_data_and_outlives_nothing_it_needs(master):
    copy = master.clone()
    master.set("foo", "bar")
    assert copy.get("foo") == b"bar"
    assert copy.timeout == master.timeout


def test_master_waits_for_workers_and_times_out_with_a_count(store_io):
    # on io_uring the master reads init/ as a client does, on epoll it waits in its server
    # the master serves on a socket bound here (torch's master_listen_fd), so the workers
    # know its port before it starts
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    results = {}

    def run_master():
        results["master"] = elastix.TCPStore(
            "127.0.0.1",
            port,
            world_size=3,
            is_master=True,
            timeout=timedelta(seconds=30),
            master_listen_fd=sock.fileno(),
        )

    thread = threading.Thread(target=run_master)
    thread.start()
    workers = [elastix.TCPStore("127.0.0.1", port, world_size=3, timeout=timedelta(seconds=30)) for _ in range(2)]
    thread.join(30)
    sock.close()  # the store serves on a duplicate of its own
    assert results["master"].num_keys() == 1  # init/
    results["master"].set("hello", "workers")
    assert [w.get("hello") for w in workers] == [b"workers", b"workers"]

    with pytest.raises(store_deadline(), match=r"waiting for clients. 1/2 clients joined"):
        elastix.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=timedelta(milliseconds=300))
    elastix.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False)


def test_constructor_argument_errors():
    with pytest.raises(ValueError, match="TCPStore world size cannot be 0"):
        elastix.TCPStore("127.0.0.1", 0, world_size=0, is_master=True)
    with pytest.raises(TypeError):
        elastix.TCPStore("127.0.0.1", 0, is_master=1)
    with pytest.raises(TypeError):
        elastix.TCPStore("127.0.0.1", 70000)
    negative = elastix.TCPStore("127.0.0.1", 0, world_size=-1, is_master=True)
    assert negative.num_keys() == 0  # -1 means "no world size"


def test_address_in_use_names_the_process_holding_the_port():
    holder = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys, time\ns = socket.create_server(('0.0.0.0', 0))\n"
         "print(s.getsockname()[1], flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = int(holder.stdout.readline())
        with pytest.raises(elastix.DistNetworkError) as error:
            elastix.TCPStore("127.0.0.1", port, is_master=True)
        said = str(error.value)
        assert f"; it is held by pid {holder.pid} ({sys.executable} -c import socket" in said, said
    finally:
        holder.kill()
        holder.wait()


def test_address_in_use_multitenancy_and_the_agent_store(master, monkeypatch):
    with pytest.raises(
        elastix.DistNetworkError, match=rf"^The server socket has failed to listen on any local .*{master.port}"
    ):
        elastix.TCPStore("127.0.0.1", master.port, is_master=True)
    a = elastix.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
    b = elastix.TCPStore("127.0.0.1", a.port, is_master=True, multi_tenant=True)
    a.set("shared", "1")
    assert b.get("shared") == b"1"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    worker = elastix.TCPStore("127.0.0.1", master.port, is_master=True)
    assert worker.port == master.port
    master.set("from_agent", "yes")
    assert worker.get("from_agent") == b"yes"


def test_connection_failures_are_clear_and_bounded():
    with closed_port() as sock:
        port = sock.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(network_deadline(), match=rf"127.0.0.1:{port}.*refused") as info:
            elastix.TCPStore("127.0.0.1", port, timeout=timedelta(milliseconds=500))
    assert isinstance(info.value, elastix.DistNetworkError)
    if "torch.distributed" not in sys.modules:  # elastix's own classes: every deadline is a TimeoutError
        assert isinstance(info.value, TimeoutError)
    assert 0.5 <= time.monotonic() - start < 30  # retried until its timeout, and no hang


def test_server_gone_mid_wait_is_a_network_error():
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True)
    client = elastix.TCPStore("127.0.0.1", store.port)
    errors = []

    def wait():
        try:
            # a barrier that cannot complete: its count shows the server holds the wait
            client.barrier("gate", 2, timedelta(seconds=30))
        except Exception as err:
            errors.append(err)

    thread = threading.Thread(target=wait)
    thread.start()
    observer = elastix.TCPStore("127.0.0.1", store.port)
    until(lambda: count(observer, "gate") == 1, "the waiting client")
    del store
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(errors[0], elastix.DistNetworkError)
    assert "closed the connection" in str(errors[0])


def test_ctrl_c_interrupts_a_blocking_wait_and_the_store_stays_usable():
    script = """
import sys, time, elastix
from datetime import timedelta
store = elastix.TCPStore("127.0.0.1", 0, is_master=True)
start = time.monotonic()
try:
    print("ready", flush=True)  # in the try: a signal that comes early is caught too
    store.wait(["never"], timedelta(seconds=60))
except KeyboardInterrupt:
    store.set("after", "ok")
    print("interrupted", round(time.monotonic() - start, 1), store.get("after").decode(), flush=True)
    sys.exit(0)
sys.exit(3)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        # its main thread blocked inside wait(), where the signal is meant to land (a signal
        # that came earlier would be caught all the same)
        until(lambda: blocked(proc.pid), "the script blocked in wait()")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=45)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    words = out.split()
    # interrupted, not ended by the wait's own 60 s timeout
    assert words[0] == "interrupted" and float(words[1]) < 30 and words[2] == "ok"


def test_a_client_killed_mid_wait_leaves_the_server_serving(master):
    script = f"""
import elastix
s = elastix.TCPStore("127.0.0.1", {master.port})
s.set("waiter_ready", "1")
s.wait(["never"])
"""
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        master.wait(["waiter_ready"], timedelta(seconds=20))
        until(lambda: blocked(proc.pid), "the client blocked in its wait()")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    survivor = master.clone()
    threading.Timer(0.1, lambda: master.set("never", "now")).start()
    survivor.wait(["never"], timedelta(seconds=30))
    assert master.get("never") == b"now"


def test_a_thousand_concurrent_clients(master):
    n = 1000
    clients = [elastix.TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=60)) for _ in range(n)]
    released = []
    lock = threading.Lock()

    def wait(store, i):
        store.add("arrived", 1)
        store.wait(["go"])
        with lock:
            released.append(i)

    threads = [threading.Thread(target=wait, args=(c, i)) for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while master.get("arrived") != str(n).encode():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert released == []
    master.set("go", "")
    for thread in threads:
        thread.join(60)
    assert sorted(released) == list(range(n))


def test_torch_like_repr(master, client):
    assert repr(master) == (
        f"TCPStore(client=TCPClient(addr={master._core.local_addr}, remote={master._core.remote_addr}), "
        f"server=TCPServer(port={master.port}))"
    )
    assert repr(client).endswith("server=<nullptr>)")


def test_watch_key_is_deprecated(master):
    with pytest.raises(NotImplementedError, match="deprecated"):
        master.watch_key("k", lambda *a: None)
    assert master.has_extended_api() is True


def test_the_store_runs_in_a_fresh_interpreter():
    result = run_python(
        "import elastix; s = elastix.TCPStore('127.0.0.1', 0, is_master=True); s.set('a', 'b'); print(s.get('a'))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "b'b'"


def server_threads(name: str) -> int:
    """Threads of this process named `name` (as the kernel shortens it, to 15 bytes)."""
    count = 0
    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(comm) as f:
                count += f.read().strip() == name[:15]
        except OSError:
            pass  # a thread that ended meanwhile
    return count


URING_THREAD, EPOLL_THREAD = "elastix-store-uring", "elastix-store"


@pytest.mark.parametrize(
    ("io", "secret", "thread"),
    [(None, False, URING_THREAD), ("epoll", False, EPOLL_THREAD), (None, True, EPOLL_THREAD)],
    ids=["auto", "epoll", "auto-with-a-secret"],
)
def test_a_master_serves_on_io_uring_unless_told_otherwise_or_given_a_secret(io, secret, thread, monkeypatch):
    """A master's server is io_uring's unless ELASTIX_STORE_IO says epoll, or the job has a
    secret (whose handshake runs on epoll); either serves, and its thread ends with it."""
    monkeypatch.delenv("ELASTIX_AUTH_TOKEN_FILE", raising=False)
    monkeypatch.delenv("ELASTIX_AUTH_TOKEN", raising=False)
    if io:
        monkeypatch.setenv("ELASTIX_STORE_IO", io)
    else:
        monkeypatch.delenv("ELASTIX_STORE_IO", raising=False)
    if secret:
        monkeypatch.setenv("ELASTIX_AUTH_TOKEN", "a-long-enough-job-secret-0123456789")
    before = server_threads(thread)
    master = elastix.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    client = elastix.TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=10))
    master.set("k", "v")
    assert client.get("k") == b"v"
    assert server_threads(thread) == before + 1
    del client, master
    assert server_threads(thread) == before


def test_a_server_that_cannot_be_had_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("ELASTIX_AUTH_TOKEN_FILE", raising=False)
    monkeypatch.setenv("ELASTIX_STORE_IO", "iouring")
    with pytest.raises(RuntimeError, match=r"ELASTIX_STORE_IO.*expected one of auto, uring, epoll"):
        elastix.TCPStore("127.0.0.1", 0, is_master=True)
    monkeypatch.setenv("ELASTIX_STORE_IO", "uring")
    monkeypatch.setenv("ELASTIX_AUTH_TOKEN", "a-long-enough-job-secret-0123456789")
    with pytest.raises(RuntimeError, match=r"io_uring store server: the job secret's handshake runs on epoll"):
        elastix.TCPStore("127.0.0.1", 0, is_master=True)
