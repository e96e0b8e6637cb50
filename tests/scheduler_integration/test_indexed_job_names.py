"""Kubernetes' Indexed Job, as its pods meet, on two namespace hosts of tests/slurm_cluster.py
(each with its own host name and /etc/hosts; no slurmd is involved): every pod is given the
endpoint `n1.train:PORT`, a name no host can resolve yet, as a headless service's record
before it is published. The pod named n1 serves the store under it; the other retries the name,
saying so, until the record appears; group ranks follow JOB_COMPLETION_INDEX."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from agents import assert_nothing_left, wait_for
from conftest import REPO
from slurm_cluster import slurm_for_tests

WORKER = os.path.join(REPO, "tests", "worker_programs", "report_env.py")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    yield from slurm_for_tests(tmp_path_factory.mktemp("hosts"), nodes=2)


def test_pods_meet_at_a_name_published_late_and_rank_in_index_order(hosts, marker, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # the second pod gets index 0: only the node order puts it first
    argv = ("elastix", "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "n1.train:29411")
    argv += ("--rdzv-id", "indexed", "--rdzv-conf", "join_timeout=60", WORKER)
    logs = [tmp_path / f"pod{i}.log" for i in range(2)]
    pods = []
    try:
        for i, log in enumerate(logs):
            env = {**hosts.env, "ELASTIX_TEST_MARKER": marker, "OUT_DIR": str(out), "JOB_COMPLETION_INDEX": str(1 - i)}
            with open(log, "w") as f:
                pods.append(subprocess.Popen(hosts.host_command(i, *argv), env=env, stdout=f, stderr=subprocess.STDOUT))
        waiting = lambda: "cannot connect to the store at n1.train:29411" in logs[1].read_text()  # noqa: E731
        wait_for(lambda: waiting() or pods[1].poll() is not None, 30, "pod n2 retrying the unpublished name")
        assert pods[1].poll() is None, logs[1].read_text()
        with open(os.path.join(hosts.dir, "hosts"), "a") as f:  # the record is published (in place)
            f.write(f"{hosts.addr(0)} n1.train\n")
        for pod, log in zip(pods, logs):
            assert pod.wait(timeout=60) == 0, log.read_text()
    finally:
        for pod in pods:
            if pod.poll() is None:
                pod.kill()
                pod.wait()
    records = [json.loads(p.read_text()) for p in out.glob("*.json")]
    by_host = {r["MASTER_ADDR"] for r in records}
    assert by_host == {"n2"}, records  # rank 0 is index 0's pod, on n2
    assert sorted((r["GROUP_RANK"], r["WORLD_SIZE"]) for r in records) == [("0", "2"), ("1", "2")], records
    assert "cannot resolve" in logs[1].read_text() and "JOB_COMPLETION_INDEX" in logs[1].read_text()
    assert_nothing_left(marker)
