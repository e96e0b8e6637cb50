"""Functions that RPC tests run on other workers (importable by name, as RPC targets must be),
and helpers for the scenarios in test_rpc.py."""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref

import elastix.rpc as rpc

# RRefs a worker was asked to keep, by key
kept: dict = {}
# keys of the chains that ended here (forward)
arrivals: list = []
released = threading.Event()
# weak references to values this worker owns, to see them go
alive: "weakref.WeakSet" = weakref.WeakSet()


class Box:
    """A value that can be weakly referenced (to see an OwnerRRef's value deleted)."""

    def __init__(self, n):
        self.n = n
        alive.add(self)

    def get(self):
        return self.n

    def add(self, k):
        self.n += k
        return self.n


class CustomError(Exception):
    def __init__(self, message, code):
        super().__init__(message, code)
        self.code = code


class UnpicklableError(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()  # cannot be pickled


def add(a, b=0):
    return a + b


def noop():
    return None


def ident(x):
    return x


def make_box(n):
    return Box(n)


def raise_custom(code):
    raise CustomError("custom failure", code)


def raise_unpicklable():
    raise UnpicklableError("cannot travel as itself")


def sleep(seconds):
    time.sleep(seconds)
    return seconds


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def wait_for_release():
    released.wait(60)
    return "released"


def release():
    released.set()


def keep(key, rref):
    kept[key] = rref
    return rref.is_owner()


def drop(key):
    kept.pop(key, None)


def drop_all():
    kept.clear()


def value_of(key):
    return kept[key].to_here()


def forward(rref, hops, key, count=None, delay=0.0):
    """Sends rref on to the next hop without waiting, and lets go of its own at once. The last
    hop adds 1 to the store key `count`, if given, so a test can wait for every chain. Each
    hop first waits `delay` seconds."""
    time.sleep(delay)
    if not hops:
        kept[key] = rref
        arrivals.append(key)
        if count:
            rpc.api.current_agent().store.add(count, 1)
        return
    rpc.rpc_async(hops[0], forward, args=(rref, hops[1:], key, count, delay))


def nested(peer, a, b):
    """A call that makes calls: rpc_sync, and remote + to_here, to another worker."""
    total = rpc.rpc_sync(peer, add, args=(a, b))
    return total + rpc.remote(peer, add, args=(a, b)).to_here()


def remote_chain(peer, n):
    """An RRef created here on `peer`, returned to the caller (an RRef as a result)."""
    return rpc.remote(peer, make_box, args=(n,))


def debug_info():
    return rpc._get_debug_info()


def describe_refs():
    return rpc.api.current_agent().endpoint.describe_refs()


def live_values():
    return len(alive)


def settle(workers, timeout=30.0):
    """Waits until every worker has no RRef message or call in flight; returns their counts."""
    deadline = time.monotonic() + timeout
    while True:
        infos = [rpc.rpc_sync(w, debug_info) for w in workers]
        busy = [i for i in infos if i["num_pending_control"] or i["num_pending_users"] or i["num_pending_children"]]
        if not busy or time.monotonic() > deadline:
            return infos
        time.sleep(0.01)


def wait_until(check, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
