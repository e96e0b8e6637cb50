"""A sample of the fault matrix (tests/faults/matrix.py): one cell per fault, across the phases
and backends, each judged by the matrix's invariants. benches/fault_matrix.py runs every cell."""

from __future__ import annotations

import pytest

from matrix import FAULTS, run_cell
from requirements import need_etcd

SAMPLE = [
    ("worker-kill", "training", "c10d"),
    ("agent-kill", "rendezvous", "c10d"),
    ("host-kill", "training", "etcd"),
    ("host-kill", "exit-barrier", "sites"),
    ("host-kill", "exit-barrier", "etcd"),  # the workers' store goes with the host
    ("agent-stop", "training", "sites"),
    ("short-cut", "training", "c10d"),
    ("long-cut", "training", "sites"),
    ("long-cut", "exit-barrier", "etcd"),  # the cut node's lease expires; it serves the workers' store
    ("store-restart", "training", "store"),
    ("store-host-stop", "training", "c10d"),  # no restart charged to the other nodes' workers
    ("store-host-cut", "training", "c10d"),
    ("etcd-leader-kill", "training", "etcd"),
]
assert {fault for fault, _, _ in SAMPLE} == set(FAULTS), "one cell per fault"


@pytest.mark.parametrize("fault,phase,backend", SAMPLE, ids=["/".join(cell) for cell in SAMPLE])
def test_a_cell_of_the_fault_matrix(tmp_path, marker, hosts, fault, phase, backend):
    if backend == "etcd":
        need_etcd()
    verdict = run_cell(fault, phase, backend, tmp_path, hosts, marker)
    print(verdict.describe())
    if verdict.outcome != "survived":
        logs = "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}" for path in sorted(tmp_path.glob("h*.log")))
        pytest.fail(f"{verdict.describe()}\n{logs}")
