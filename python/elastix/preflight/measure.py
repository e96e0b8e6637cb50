"""What the pre-flight check measures: the node's compute (a fixed matrix product, on one
thread, so that nodes are compared core for core and a check on a shared machine does not
measure its own threads' contention) and a link between two nodes, through elastix's
collectives (a process group of the pair, as training would make).

Both ends of a link take the same steps: each decision to go on is an all_reduce of the two
ends' wishes, so neither waits for a collective the other never starts."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Dict

import numpy as np

MATRIX = 384
# a product's best time over this many tries (a busy moment of the machine is not the node)
COMPUTE_TRIES = 7
LATENCY_TRIES = 20
# the latency tests stop early once they took this long (a link of 50 ms takes a few)
LATENCY_BUDGET_S = 0.5
# bandwidth: 1 MiB, then the best of BANDWIDTH_TRIES of 16 MiB where the first took under
# BANDWIDTH_BUDGET_S (a throttled link is not held up for seconds)
SMALL_BYTES = 1 << 20
LARGE_BYTES = 16 << 20
BANDWIDTH_BUDGET_S = 0.05
BANDWIDTH_TRIES = 3


def compute_ms() -> float:
    """The best time of one MATRIX x MATRIX float32 product, in ms."""
    a = np.random.default_rng(0).random((MATRIX, MATRIX), dtype=np.float32)
    a @ a  # warm: pages touched, code loaded
    best = float("inf")
    for _ in range(COMPUTE_TRIES):
        began = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - began)
    return best * 1e3


def link(store: Any, rank: int, timeout_s: float) -> Dict[str, float]:
    """Latency (median all_reduce of 8 bytes, ms) and bandwidth (MB/s of the largest
    all_reduce) between this process (``rank`` 0 or 1 in the pair) and its peer, which meet
    in ``store``. Raises whatever the collectives raise when the peer never comes or fails."""
    import elastix.collectives as ec

    ec.init_process_group(store=store, rank=rank, world_size=2, timeout=timedelta(seconds=timeout_s))
    try:
        ec.barrier()  # both ends connected: the first latency is not the connection's set-up
        times = []
        flag = np.zeros(1)
        began = time.perf_counter()
        for _ in range(LATENCY_TRIES):
            flag[0] = float(time.perf_counter() - began > LATENCY_BUDGET_S)
            at = time.perf_counter()
            ec.all_reduce(flag, op=ec.ReduceOp.MAX)
            times.append(time.perf_counter() - at)
            if flag[0] > 0:
                break
        mbps = _bandwidth(ec)
    finally:
        ec.destroy_process_group()
    return {"latency_ms": float(np.median(times)) * 1e3, "mbps": mbps}


def _bandwidth(ec: Any) -> float:
    size, taken = SMALL_BYTES, _all_reduce_s(ec, SMALL_BYTES)
    more = np.array([float(taken < BANDWIDTH_BUDGET_S)])
    ec.all_reduce(more, op=ec.ReduceOp.MIN)
    if more[0] > 0:
        size, taken = LARGE_BYTES, min(_all_reduce_s(ec, LARGE_BYTES) for _ in range(BANDWIDTH_TRIES))
    return size / max(taken, 1e-9) / 1e6


def _all_reduce_s(ec: Any, size: int) -> float:
    data = np.ones(size // 4, dtype=np.float32)
    began = time.perf_counter()
    ec.all_reduce(data)
    return time.perf_counter() - began
