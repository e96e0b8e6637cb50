"""`elastix dump` on a running job: every worker's stacks (or one rank's), the job goes on;
bad input gets a clear error and its own exit status."""

import subprocess
import sys
import textwrap

import pytest

from agents import assert_nothing_left, elastix_run, finish, wait_for
from conftest import closed_port

# rank 0 imports elastix; rank 1 never does (elastix's site hook arms its stack dumps anyway)
WORKER = textwrap.dedent(
    """
    import os, time
    rank = os.environ["RANK"]
    if rank == "0":
        import elastix
    def train_step_forever():
        stop = os.path.join(os.environ["OUT_DIR"], "stop")
        deadline = time.monotonic() + 120
        while not os.path.exists(stop) and time.monotonic() < deadline:
            time.sleep(0.05)
    open(os.path.join(os.environ["OUT_DIR"], f"ready_{rank}"), "w").close()
    train_step_forever()
    open(os.path.join(os.environ["OUT_DIR"], f"done_{rank}"), "w").close()
    """
)


def dump(port, *args, run_id="dumpjob"):
    command = [sys.executable, "-m", "elastix", "dump", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]
    return subprocess.run([*command, *map(str, args)], capture_output=True, text=True, timeout=60)


@pytest.fixture
def running_job(tmp_path, marker, rdzv_port):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = elastix_run(
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", "dumpjob",
        "--rdzv-conf", "is_host=false",
        "--nproc-per-node", 2, script, out_dir=tmp_path, marker=marker,
    )  # fmt: skip
    try:
        wait_for(lambda: all((tmp_path / f"ready_{r}").exists() for r in (0, 1)), what="both workers")
        yield rdzv_port
    finally:
        (tmp_path / "stop").touch()
        code, _out, err = finish(proc)
        assert code == 0, err
        assert (tmp_path / "done_0").exists() and (tmp_path / "done_1").exists(), "the job went on after the dumps"
        assert_nothing_left(marker)


def test_dump_shows_the_stacks_of_a_running_job_and_it_goes_on(running_job):
    one = dump(running_job, "--rank", 0)
    shown = f"stdout:\n{one.stdout}\nstderr:\n{one.stderr}"
    assert one.returncode == 0, shown
    assert "=== rank 0 (local rank 0, pid" in one.stdout and "in train_step_forever" in one.stdout, shown
    assert "=== rank 1" not in one.stdout, shown
    every = dump(running_job)
    shown = f"stdout:\n{every.stdout}\nstderr:\n{every.stderr}"
    # rank 1 never imported elastix: a plain script's stacks come too
    assert every.returncode == 0, shown
    assert every.stdout.count("in train_step_forever") == 2 and "=== rank 1 (local rank 1, pid" in every.stdout, shown
    again = dump(running_job, "--rank", 0, "--json")
    assert again.returncode == 0 and '"stacks"' in again.stdout, again.stderr


def test_bad_input_gets_a_clear_error_and_its_own_exit_status(running_job):
    out_of_range = dump(running_job, "--rank", 7)
    assert out_of_range.returncode == 2, out_of_range.stderr
    assert "--rank 7: job dumpjob has no such worker (its 2 workers have ranks 0 to 1)" in out_of_range.stderr
    unknown = dump(running_job, run_id="nosuchjob")
    assert unknown.returncode == 4 and "no job with run ID 'nosuchjob'" in unknown.stderr
    with closed_port() as refused:
        unreachable = dump(refused.getsockname()[1], "--timeout", 1)
    assert unreachable.returncode == 1 and "cannot reach the rendezvous store" in unreachable.stderr
    static = dump(running_job, "--rdzv-backend", "static")
    assert static.returncode == 2 and "elastix dump asks c10d and etcd jobs" in static.stderr, static.stderr
    for result in (out_of_range, unknown, unreachable, static):
        assert "Traceback" not in result.stderr


def test_dump_asks_an_etcd_job_through_its_workers_store(tmp_path, marker, etcd):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    where = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "etcddump"]
    proc = elastix_run(*where, "--nproc-per-node", 2, script, out_dir=tmp_path, marker=marker)
    try:
        wait_for(lambda: all((tmp_path / f"ready_{r}").exists() for r in (0, 1)), what="both workers")
        asked = subprocess.run(
            [sys.executable, "-m", "elastix", "dump", *where], capture_output=True, text=True, timeout=60
        )
        shown = f"stdout:\n{asked.stdout}\nstderr:\n{asked.stderr}"
        assert asked.returncode == 0, shown
        assert asked.stdout.count("in train_step_forever") == 2, shown
    finally:
        (tmp_path / "stop").touch()
        code, _out, err = finish(proc)
    assert code == 0, err
    assert_nothing_left(marker)
