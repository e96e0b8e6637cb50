"""The cpu backend across "hosts": ranks given different host identities talk TCP (rings and
direct transfers), and groups that mix ranks on one host with ranks on others use the
hierarchy (shared memory inside a host, TCP between hosts' leaders). Same checks as
test_collectives_cpu; float results may differ from the rank-order reference in the last bits
(ring order), so they are compared with a tolerance."""

from __future__ import annotations

import numpy as np
import pytest
from test_collectives_cpu import TINY, async_and_p2p, layouts, matrix, subgroups

import collectives_harness as harness

SMALL_MATRIX = {
    "sizes": [0, 3, 1003, 20_000],
    "dtypes": ["bool", "int8", "uint64", "int32", "float16", "float32", "float64", "bfloat16", "complex64"],
    "exact": False,
}


def topology():
    ec = harness.init()
    from elastix.collectives import group

    backend = group.resolve(None).backend
    mode = backend.mode
    ec.destroy_process_group()
    return mode


@pytest.mark.parametrize(
    "hosts,mode",
    [
        (["a", "b"], "tcp"),
        (["a", "b", "c"], "tcp"),
        (["a", "a", "b", "b"], "hier"),
        (["a", "b", "a"], "hier"),
    ],
)
def test_mode_follows_membership(hosts, mode):
    assert harness.run(topology, len(hosts), hosts=hosts, timeout=60) == [mode] * len(hosts)


@pytest.mark.parametrize("hosts", [["a", "b"], ["a", "b", "c"], ["a", "a", "b", "b"], ["a", "b", "a"]])
def test_every_collective_across_hosts(hosts):
    for bad in harness.run(matrix, len(hosts), hosts=hosts, timeout=120, kwargs=SMALL_MATRIX):
        assert bad == []


@pytest.mark.parametrize("hosts", [["a", "b", "c"], ["a", "b", "b"]])
def test_rings_stream_in_pieces(hosts):
    kwargs = dict(SMALL_MATRIX, sizes=[0, 7, 5001], dtypes=["int32", "float64", "bfloat16"])
    for bad in harness.run(matrix, len(hosts), hosts=hosts, timeout=120, env=TINY, kwargs=kwargs):
        assert bad == []


@pytest.mark.parametrize("hosts", [["a", "b", "a"], ["a", "b", "c", "d"]])
def test_subgroups_layouts_async_p2p_across_hosts(hosts):
    for fn in (subgroups, layouts, async_and_p2p):
        for bad in harness.run(fn, len(hosts), hosts=hosts, timeout=90):
            assert bad == [], fn.__name__


def big_all_reduce(n=3_000_000):
    ec = harness.init()
    r, p = ec.get_rank(), ec.get_world_size()
    x = np.full(n, r + 1, np.float32)
    ec.all_reduce(x)
    ok = bool(np.all(x == sum(range(1, p + 1))))
    ec.destroy_process_group()
    return ok


def test_large_ring_all_reduce():
    assert harness.run(big_all_reduce, 3, hosts=["a", "b", "c"], timeout=90) == [True] * 3
