"""Training nodes on namespace hosts, and what their workers' step logs say
(tests/worker_programs/train_loop.py writes one line per step: "<unix time> <step>")."""

from __future__ import annotations

import glob
import os
import sys

from agents import WORKERS, agent, node_args

TRAIN = os.path.join(WORKERS, "train_loop.py")


def train_node(
    tmp_path,
    marker,
    hosts,
    i,
    nnodes,
    endpoint,
    conf,
    run_id,
    max_restarts=0,
    backend="c10d",
    env=(),
    flags=(),
    wrap=(),
):
    """`elastix run` of train_loop.py on host i. Namespaces share the host name: a collectives
    host id per node keeps the nodes' ranks on TCP, as on real machines. `env`: more
    NAME=value settings for the node; `flags`: more `elastix run` flags; `wrap`: a command the
    node runs under (such as prlimit)."""
    python = hosts.command(i, *wrap, "env", f"ELASTIX_COLLECTIVES_HOST_ID=host{i}", *env, sys.executable)
    args = node_args(
        nnodes, endpoint, hosts.addr(i), conf, TRAIN, run_id=run_id, max_restarts=max_restarts, backend=backend
    )
    return agent(tmp_path, marker, f"h{i}", "run", *flags, *args, python=python)


def steps(tmp_path, start=0.0, end=float("inf")):
    """Steps trained between two wall-clock times: {(round, rank): count}."""
    found = {}
    for path in glob.glob(str(tmp_path / "steps_*_*.txt")):
        round_, rank = os.path.basename(path)[len("steps_") : -len(".txt")].split("_")
        with open(path) as f:
            count = sum(1 for line in f if line.strip() and start < float(line.split()[0]) < end)
        if count:
            found[(int(round_), int(rank))] = count
    return found


def steps_in(tmp_path, round_, start=0.0):
    """Steps trained in `round_` after `start`, by any rank."""
    return sum(count for (r, _), count in steps(tmp_path, start).items() if r == round_)


def first_step_time(tmp_path, round_):
    times = [
        float(line.split()[0])
        for path in glob.glob(str(tmp_path / f"steps_{round_}_*.txt"))
        for line in open(path)
        if line.strip()
    ]
    return min(times) if times else None
