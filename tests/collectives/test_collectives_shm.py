"""Shared-memory segments: mapped by several processes, and gone when they are, even when
they are killed: memfd segments have no name at all, and /dev/shm files are unlinked once every
rank attached (a creator that crashed before that leaves a file the next creator removes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import collectives_harness as harness
from elastix.collectives import shm_segment
from elastix.collectives.shm_segment import PREFIX, SHM_DIR, sweep_stale


def ours():
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)}
    except OSError:
        return set()


@pytest.mark.parametrize("method", ["memfd", "file"])
def test_a_segment_is_shared_and_its_name_released(method):
    seg = shm_segment.create(10_000, method)
    other = shm_segment.attach(seg.encode().encode())  # as read back from the store
    mine, theirs = np.frombuffer(seg, np.uint8), np.frombuffer(other, np.uint8)
    mine[:5] = [1, 2, 3, 4, 5]
    assert list(theirs[:5]) == [1, 2, 3, 4, 5]
    assert seg.size % 4096 == 0 and seg.size >= 10_000 and seg.kind == method
    path = json.loads(seg.encode()).get("path")
    if method == "file":
        assert os.path.exists(path)
    seg.release_name()
    if method == "file":
        assert not os.path.exists(path)
    theirs[7] = 9
    assert mine[7] == 9  # the mapping outlives the name
    other.close()
    seg.close()


def test_stale_files_of_dead_creators_are_swept(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    stale = tmp_path / f"{PREFIX}{child.pid}-deadbeef"
    stale.write_bytes(b"x")
    alive = tmp_path / f"{PREFIX}{os.getpid()}-cafe"
    alive.write_bytes(b"x")
    assert sweep_stale(str(tmp_path)) == 1
    assert not stale.exists() and alive.exists()


def hold_group():
    ec = harness.init()
    x = np.ones(100_000)
    ec.all_reduce(x)  # segments exist and every rank attached
    s, q = (
        ec.isend(x, (ec.get_rank() + 1) % ec.get_world_size()),
        ec.irecv(np.empty_like(x), (ec.get_rank() - 1) % ec.get_world_size()),
    )
    q.wait()
    s.wait()
    print("ready", flush=True)
    time.sleep(60)  # holds the group's segments until the test kills it


@pytest.mark.parametrize("method", ["memfd", "file"])
def test_killed_workers_leave_no_shared_memory_behind(method):
    before = ours()
    workers = harness.start(hold_group, 3, env={"ELASTIX_SHM": method}, timeout=60)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            outs = []
            for out_f, _ in workers.logs:
                out_f.seek(0)
                outs.append(out_f.read())
            if all("ready" in o for o in outs):
                break
            time.sleep(0.05)
        else:
            pytest.fail("workers did not get ready: " + "\n".join(r.describe() for r in workers.wait()))
        assert ours() - before == set(), "names are released once every rank attached"
        for r in range(3):
            workers.kill(r, signal.SIGKILL)
    finally:
        workers.wait()
    assert ours() - before == set()


SHM_JOB = """
import os
import numpy as np
import elastix.collectives as ec
from elastix.collectives import shm_segment
ec.init_process_group()
x = np.ones(1 << 16, np.float32)
for _ in range(20):
    x[:] = 1
    ec.all_reduce(x)
print(f"rank {ec.get_rank()} sum {x[0]:g} shm {shm_segment._method()}", flush=True)
"""


@pytest.mark.parametrize("secret", [True, False], ids=["with a secret", "without"])
def test_a_job_trains_on_shared_memory_with_and_without_a_secret(tmp_path, marker, monkeypatch, secret):
    """A worker that loaded the job secret is undumpable, so an ordinary user's peers cannot open
    its memfds through /proc: its segments are files in /dev/shm instead (readable by the user
    alone, unlinked once attached). CI runs this as a non-root user too (.ci/nonroot-tests),
    where the memfd way fails; root may open any process's descriptors."""
    from agents import assert_nothing_left, elastix_run, finish

    script = tmp_path / "shm_job.py"
    script.write_text(SHM_JOB)
    for name in ("ELASTIX_SHM", "ELASTIX_AUTH_TOKEN_FILE", "ELASTIX_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    if secret:
        secrets_dir = tmp_path / "secrets"
        secrets_dir.mkdir(mode=0o700)
        path = secrets_dir / "job.secret"
        subprocess.run([sys.executable, "-m", "elastix", "secret", str(path)], check=True, capture_output=True)
        monkeypatch.setenv("ELASTIX_AUTH_TOKEN_FILE", str(path))
    proc = elastix_run("--standalone", "--nproc-per-node", 2, script, out_dir=tmp_path, marker=marker)
    code, out, err = finish(proc)
    assert code == 0, err
    method = "file" if secret else "memfd"
    assert sorted(line for line in out.splitlines() if " sum " in line) == [
        f"rank 0 sum 2 shm {method}",
        f"rank 1 sum 2 shm {method}",
    ], out
    assert_nothing_left(marker)
