"""Slurm hostlist expressions, with the examples of Slurm's documentation (`scontrol show
hostnames`, sbatch --nodelist) and the mistakes users make."""

from __future__ import annotations

import pytest

from elastix.schedulers.hostlist import MAX_HOSTS, expand, first


@pytest.mark.parametrize(
    "expression, hosts",
    [
        ("lx10", ["lx10"]),
        ("lx[10-12]", ["lx10", "lx11", "lx12"]),
        ("lx[10-12,15]", ["lx10", "lx11", "lx12", "lx15"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("tux[8-10]", ["tux8", "tux9", "tux10"]),  # padding follows the lower bound
        ("n[001-003]", ["n001", "n002", "n003"]),
        ("linux[0-3],snoopy", ["linux0", "linux1", "linux2", "linux3", "snoopy"]),
        ("n1,n[3-4],gpu[1-2]-ib", ["n1", "n3", "n4", "gpu1-ib", "gpu2-ib"]),
        ("rack[1-2]-node[1-2]", ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"]),
        ("node-[9-11].cluster", ["node-9.cluster", "node-10.cluster", "node-11.cluster"]),
        (" a[1-2] , b ", ["a1", "a2", "b"]),
    ],
)
def test_expressions_expand_in_slurms_order(expression, hosts):
    assert expand(expression) == hosts
    assert first(expression) == hosts[0]


@pytest.mark.parametrize(
    "expression, says",
    [
        ("", "empty hostlist"),
        ("n[1-3", "'[' not closed"),
        ("n1-3]", "']' without '['"),
        ("n[[1-2]]", "nested '['"),
        ("n[3-1]", "runs backwards"),
        ("n[a-b]", "not a number or a range"),
        ("n[1-]", "not a number or a range"),
        ("n1,,n2", "an empty item"),
        (f"n[0-{MAX_HOSTS}]", "more than"),
        ("a[1-1000][1-1000][1-1000]", "more than"),  # a product too large is refused before it is built
    ],
)
def test_bad_expressions_say_what_is_wrong(expression, says):
    with pytest.raises(ValueError) as error:
        expand(expression)
    assert says in str(error.value)
