"""`elastix run` under a real Slurm (tests/slurm_cluster.py: two namespace hosts n1 and n2, each
with its own slurmd): `srun -N 2 elastix run --nproc-per-node 2 worker.py` with no rendezvous
flag forms one job of 4 ranks across the hosts, whose workers all-reduce; and a preemption
signal sent with `scancel --signal=USR1` reaches every worker, which checkpoints, and the job
ends with the status of an interrupted one (128 + 10), not of a failure (1); the example batch
script then requeues itself and the requeued job resumes from the checkpoint; an elastic job
re-forms without a host that died."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from agents import assert_nothing_left, wait_for
from conftest import REPO
from slurm_cluster import slurm_for_tests

# Records its environment and an all-reduce over the job; with "preempt", then waits for
# SIGUSR1 and writes a checkpoint before exiting 0, as a training script under Slurm does.
WORKER = r"""
import json, os, signal, socket, sys, time
import numpy as np
import elastix.collectives as ec

out, mode = sys.argv[1], sys.argv[2]
preempted = []
signal.signal(signal.SIGUSR1, lambda *_: preempted.append(time.monotonic()))
ec.init_process_group()
rank = int(os.environ["RANK"])
total = np.array([rank + 1.0])
ec.all_reduce(total)
keys = ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "SLURM_NODEID")
record = {key: os.environ.get(key) for key in keys}
record.update(host=socket.gethostname(), total=float(total[0]))
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
if mode == "preempt":
    deadline = time.monotonic() + 60
    while not preempted and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # writing the checkpoint
    with open(os.path.join(out, f"checkpoint{rank}"), "w") as f:
        f.write(str(len(preempted)))
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from slurm_for_tests(tmp_path_factory.mktemp("slurm"), nodes=2)


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    return str(path), out


def records(out):
    return sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: int(r["RANK"]))


def elastix_run(*argv):
    # `elastix run` as a user types it under srun: no rendezvous flag at all
    return ("-N", "2", "--ntasks-per-node=1", "elastix", "run", "--nproc-per-node", "2", *argv)


def test_srun_elastix_run_forms_the_job_from_slurms_environment(slurm, marker, worker):
    script, out = worker
    done = slurm.srun(*elastix_run(script, str(out), "train"), timeout=120, env={"ELASTIX_TEST_MARKER": marker})
    assert done.returncode == 0, done.stdout + done.stderr
    found = records(out)
    assert [r["RANK"] for r in found] == ["0", "1", "2", "3"], done.stderr
    job = found[0]["TORCHELASTIC_RUN_ID"]
    assert job.startswith("slurm-") and job.endswith(".0"), job
    for r in found:
        assert r["WORLD_SIZE"] == "4" and r["total"] == 10.0, r  # one all-reduce over both hosts
        assert r["GROUP_RANK"] == r["SLURM_NODEID"], r  # group ranks follow Slurm's node order
        assert r["host"] == f"n{int(r['GROUP_RANK']) + 1}", r
        assert r["MASTER_ADDR"] == "n1" and r["TORCHELASTIC_RUN_ID"] == job, r
    # one line says what was derived, and from where
    assert done.stderr.count("under Slurm job") == 2, done.stderr
    assert "--nnodes 2 (SLURM_" in done.stderr and "(the first host of SLURM_" in done.stderr, done.stderr
    assert_nothing_left(marker)


def test_a_preemption_signal_reaches_every_worker_which_checkpoints(slurm, marker, worker, tmp_path):
    script, out = worker
    with open(tmp_path / "srun.log", "w") as log:
        step = slurm.popen(
            *elastix_run(script, str(out), "preempt"),
            env={"ELASTIX_TEST_MARKER": marker},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    log_text = lambda: (tmp_path / "srun.log").read_text()  # noqa: E731
    try:
        wait_for(lambda: len(records(out)) == 4 or step.poll() is not None, 60, "4 workers training")
        assert step.poll() is None, log_text()
        jobs = slurm.jobs()
        assert len(jobs) == 1, jobs
        cancel = slurm.run("scancel", "--signal=USR1", jobs[0], timeout=10)
        assert cancel.returncode == 0, cancel.stderr
        code = step.wait(timeout=60)
    finally:
        if step.poll() is None:
            slurm.cancel_all()
            step.kill()
            step.wait()
    checkpoints = sorted(p.name for p in out.glob("checkpoint*"))
    assert checkpoints == [f"checkpoint{rank}" for rank in range(4)], log_text()
    # srun passes on the agents' status: interrupted by SIGUSR1, which a requeue script tells
    # from a failure
    assert code == 128 + 10, log_text()
    assert "SIGUSR1" in log_text(), log_text()
    assert_nothing_left(marker)


def test_the_example_checkpoints_when_preempted_and_resumes_after(slurm, marker, tmp_path):
    # examples/slurm/train_digits.sbatch's recipe, by hand: USR1 before the end, then again
    checkpoint = tmp_path / "digits.npz"
    train = ("examples/train_digits.py", "--checkpoint", str(checkpoint), "--epochs", "12", "--step-delay", "0.02")
    env = {"ELASTIX_TEST_MARKER": marker}
    with open(tmp_path / "first.log", "w") as log:
        step = slurm.popen(*elastix_run(*train), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    first = lambda: (tmp_path / "first.log").read_text()  # noqa: E731
    try:
        wait_for(lambda: "epoch 1:" in first() or step.poll() is not None, 60, "the first epoch")
        assert step.poll() is None, first()
        cancel = slurm.run("scancel", "--signal=USR1", *slurm.jobs(), timeout=10)
        assert cancel.returncode == 0, cancel.stderr
        assert step.wait(timeout=60) == 128 + 10, first()
    finally:
        if step.poll() is None:
            slurm.cancel_all()
            step.kill()
            step.wait()
    assert "preempted at step" in first() and checkpoint.exists(), first()
    stopped_at = int(first().split("preempted at step ")[1].split()[0])
    # the next run (another step of the allocation here; the same job ID once requeued)
    again = slurm.srun(*elastix_run(*train, "--resume"), timeout=120, env=env, cwd=REPO)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming from {checkpoint} at step {stopped_at}" in again.stdout, again.stdout
    assert "final test accuracy" in again.stdout
    assert_nothing_left(marker)


def test_an_elastic_job_re_forms_without_a_host_that_died(slurm, marker, tmp_path):
    # --nnodes 1:2 under `srun --no-kill`: host n2 dies mid-training (its slurmd and every
    # process on it); n1's agent re-forms the job alone and finishes it from the step its own
    # ranks held in its memory (elastix.checkpoint: the replicas are the same on every rank)
    checkpoint = tmp_path / "digits.npz"
    train = ("examples/train_digits.py", "--checkpoint", str(checkpoint), "--epochs", "12", "--step-delay", "0.02")
    argv = ("--no-kill", *elastix_run("--nnodes", "1:2", "--rdzv-conf", "last_call_timeout=1", *train))
    with open(tmp_path / "srun.log", "w") as log:
        step = slurm.popen(*argv, env={"ELASTIX_TEST_MARKER": marker}, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    text = lambda: (tmp_path / "srun.log").read_text()  # noqa: E731
    try:
        wait_for(lambda: "epoch 2:" in text() or step.poll() is not None, 60, "two epochs on 2 hosts")
        assert step.poll() is None and "4 rank(s)" in text(), text()
        slurm.kill_node(1)
        wait_for(lambda: "final test accuracy" in text() or step.poll() is not None, 90, "the job finished on n1")
        assert "final test accuracy" in text(), text()
        assert "from the agent's memory" in text() and "2 rank(s)" in text(), text()  # as 1 node of 2 ranks
    finally:
        # the step may still wait for the dead host: bring it back, so the job can end
        slurm.start_node(1)
        if step.poll() is None:
            step.kill()
            step.wait()
        slurm.cancel_all(timeout=60)
        slurm.wait_idle(timeout=60)
    assert_nothing_left(marker)


def test_the_batch_script_requeues_a_preempted_job_which_resumes(slurm, marker, tmp_path):
    # examples/slurm/train_digits.sbatch as written (its steps slowed down), submitted with sbatch
    script = Path(REPO, "examples", "slurm", "train_digits.sbatch").read_text()
    slowed = tmp_path / "job.sbatch"
    slowed.write_text(script.replace("--checkpoint-every 20", "--checkpoint-every 20 --step-delay 0.02"))
    env = {"ELASTIX_TEST_MARKER": marker, "HOME": str(tmp_path)}
    submitted = slurm.run("sbatch", "--output", str(tmp_path / "job.out"), str(slowed), env=env, cwd=REPO)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.split()[-1]
    out = tmp_path / "job.out"
    text = lambda: out.read_text() if out.exists() else ""  # noqa: E731
    try:
        wait_for(lambda: "epoch 1:" in text(), 60, "the first epoch")
        assert slurm.run("scancel", "--signal=USR1", job).returncode == 0
        # requeued, Slurm holds the job back until its old credential expires (BeginTime);
        # starting it sooner (`scontrol update StartTime=now`) has slurmd refuse it
        wait_for(lambda: "(BeginTime)" in slurm.run("squeue", "-h", "-j", job).stdout, 60, "the job requeued")
        wait_for(lambda: not slurm.jobs(), 120, "the requeued job to start and finish")
    finally:
        slurm.cancel_all()
    said = text()
    stopped_at = said.split("preempted at step ")[1].split()[0]
    assert f"preempted: requeueing job {job}" in said, said
    checkpoint = tmp_path / f"digits-{job}.npz"
    assert f"resuming from {checkpoint} at step {stopped_at} (written by this job, run ID slurm-{job}.0" in said, said
    assert "final test accuracy" in said, said
    assert_nothing_left(marker)
