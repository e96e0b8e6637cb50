"""examples/train_digits.py, started the way `elastix run` starts workers (the env contract,
the agent's store): two ranks reach the accuracy one process reaches, and a worker killed in
the middle of the run leads (here the harness plays the agent) to a restart that resumes from
the last checkpoint and finishes. A checkpoint of another run is resumed only with --resume.
The same under `elastix run` itself at the end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

import collectives_harness as harness

SCRIPT = os.path.join(harness.REPO, "examples", "train_digits.py")
ARGS = ["--dataset", "synthetic", "--epochs", "6"]


def accuracy(text: str) -> float:
    m = re.search(r"final test accuracy: ([0-9.]+)", text)
    assert m, text
    return float(m.group(1))


def one_process(*extra, code=0, env=None) -> str:
    launcher = ("WORLD_SIZE", "MASTER_ADDR", "RANK", "TORCHELASTIC_RUN_ID")
    env = {**{k: v for k, v in os.environ.items() if k not in launcher}, **(env or {})}
    out = subprocess.run([sys.executable, SCRIPT, *ARGS, *extra], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == code, out.stderr
    return out.stdout if code == 0 else out.stderr


def ranks(n: int, *extra, **options):
    results = harness.start(None, n, argv=[SCRIPT, *ARGS, *extra], timeout=120, **options).wait()
    assert all(r.returncode == 0 for r in results), "\n".join(r.describe() for r in results)
    return results


def test_two_ranks_reach_the_accuracy_of_one_process():
    single = accuracy(one_process())
    assert single > 0.8
    results = ranks(2)
    assert abs(accuracy(results[0].stdout) - single) <= 0.005
    assert "2 rank(s)" in results[0].stdout


def test_three_ranks_too():
    assert abs(accuracy(ranks(3)[0].stdout) - accuracy(one_process())) <= 0.005


def test_a_killed_worker_restarts_from_the_checkpoint(tmp_path):
    ckpt = str(tmp_path / "digits.npz")
    extra = ["--checkpoint", ckpt, "--checkpoint-every", "10", "--step-delay", "0.01"]
    store = harness.make_store()  # one store for the job, as `elastix run` keeps; rounds apart
    job = {"TORCHELASTIC_RUN_ID": "job42"}  # the job's run ID: its restarts resume by themselves
    first = harness.start(
        None, 2, argv=[SCRIPT, *ARGS, *extra], timeout=120, store=store, env={**job, "ELASTIX_ROUND": "1"}
    )
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(ckpt):
            assert time.monotonic() < deadline, "no checkpoint written"
            assert all(p.poll() is None for p in first.procs), "\n".join(r.describe() for r in first.wait())
            time.sleep(0.02)
        first.kill(1, signal.SIGKILL)
    finally:
        results = first.wait()
    assert results[1].returncode == -signal.SIGKILL
    assert results[0].returncode != 0, "the survivor must fail, not hang"
    assert "rank 1" in results[0].stderr and "PeerError" in results[0].stderr
    # the "agent" restarts the whole group in the next rendezvous round
    second = ranks(2, *extra, restart=1, store=store, env={**job, "ELASTIX_ROUND": "2"})
    m = re.search(
        rf"resuming from {re.escape(ckpt)} at step (\d+) \(written by this job, run ID job42", second[0].stdout
    )
    assert m and int(m.group(1)) >= 10, second[0].stdout
    assert abs(accuracy(second[0].stdout) - accuracy(one_process())) <= 0.005


def test_resume_with_a_different_world_size(tmp_path):
    ckpt = str(tmp_path / "digits.npz")
    one_process("--checkpoint", ckpt, "--epochs", "3")
    results = ranks(2, "--checkpoint", ckpt, "--resume")
    assert "at step 114 (--resume; written with 1 rank(s), now 2)" in results[0].stdout
    assert abs(accuracy(results[0].stdout) - accuracy(one_process())) <= 0.005


def test_a_checkpoint_of_another_run_is_left_alone_without_resume(tmp_path):
    ckpt = tmp_path / "digits.npz"
    one_process("--checkpoint", ckpt, "--epochs", "1")
    before = ckpt.read_bytes()
    err = one_process("--checkpoint", ckpt, code=2)
    assert f"{ckpt} holds step 38 of another run (no run ID); pass --resume to continue from it" in err
    assert "training on" not in err and ckpt.read_bytes() == before
    # torchrun's default run ID "none" names no job: every job without --rdzv-id has it
    none = {"TORCHELASTIC_RUN_ID": "none"}
    one_process("--checkpoint", ckpt, "--resume", env=none)
    err = one_process("--checkpoint", ckpt, code=2, env=none)
    assert "(a job started with --rdzv-id resumes its own checkpoint by itself)" in err


def test_a_job_resumes_its_own_checkpoint_and_only_that(tmp_path):
    ckpt = tmp_path / "digits.npz"
    one_process("--checkpoint", ckpt, "--epochs", "1", env={"TORCHELASTIC_RUN_ID": "job7"})
    out = one_process("--checkpoint", ckpt, env={"TORCHELASTIC_RUN_ID": "job7"})  # e.g. requeued by Slurm
    assert f"resuming from {ckpt} at step 38 (written by this job, run ID job7;" in out
    err = one_process("--checkpoint", ckpt, code=2, env={"TORCHELASTIC_RUN_ID": "job8"})
    assert "of another run (run ID job7)" in err


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    ckpt = tmp_path / "digits.npz"
    one_process("--checkpoint", ckpt, "--epochs", "1")
    err = one_process("--checkpoint", ckpt, "--resume", "--hidden", "32", code=2)
    assert "was written with hidden=64, this run has hidden=32: resume with the same options" in err
    out = one_process("--checkpoint", tmp_path / "new.npz", "--resume", "--epochs", "1")
    assert f"no checkpoint at {tmp_path / 'new.npz'} yet: starting at step 0" in out


def test_with_scikit_learn_digits():
    pytest.importorskip("sklearn", reason="scikit-learn is the example's optional dataset (elastix[examples])")
    out = one_process("--dataset", "sklearn")
    assert accuracy(out) > 0.9


# --- under `elastix run` itself -------------------------------------------------------------


def elastix_run(*args, env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "elastix", "run", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_running_the_main_job_again_neither_resumes_nor_overwrites_the_first(tmp_path, marker):
    ckpt = tmp_path / "digits.npz"
    job = ("--standalone", "--nproc-per-node", 2, SCRIPT, *ARGS, "--epochs", 1, "--checkpoint", ckpt)
    first = elastix_run(*job, env={"ELASTIX_TEST_MARKER": marker})
    out, err = first.communicate(timeout=180)
    assert first.returncode == 0, err
    before = ckpt.read_bytes()
    again = elastix_run(*job, env={"ELASTIX_TEST_MARKER": marker})  # a new launch: a new run ID
    out, err = again.communicate(timeout=180)
    assert again.returncode == 1 and "training on" not in out, out
    assert f"{ckpt} holds step 38 of another run (run ID " in err and "pass --resume" in err
    assert ckpt.read_bytes() == before
    more = elastix_run(*job[:-4], "--epochs", 2, "--checkpoint", ckpt, "--resume", env={"ELASTIX_TEST_MARKER": marker})
    out, err = more.communicate(timeout=180)
    assert more.returncode == 0, err
    assert f"resuming from {ckpt} at step 38 (--resume; written with 2 rank(s), now 2)" in out
    assert "epoch 2:" in out and "epoch 1:" not in out


def test_the_example_under_elastix_run_matches_one_process():
    proc = elastix_run("--standalone", "--nproc-per-node", 2, SCRIPT, *ARGS)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert "2 rank(s)" in out
    assert abs(accuracy(out) - accuracy(one_process())) <= 0.005


def worker_pids(marker: str):
    """Live workers of the job started with `marker` in their environment."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        # workers have RANK in their environment; the launcher does not
        if f"ELASTIX_TEST_MARKER={marker}".encode() in environ and any(v.startswith(b"RANK=") for v in environ):
            pids.append(int(pid))
    return pids


def test_killing_a_worker_under_elastix_run_restarts_and_the_run_finishes(tmp_path):
    marker = uuid.uuid4().hex
    ckpt = tmp_path / "digits.npz"
    proc = elastix_run(
        "--standalone",
        "--nproc-per-node",
        2,
        "--max-restarts",
        1,
        SCRIPT,
        *ARGS,
        "--checkpoint",
        ckpt,
        "--checkpoint-every",
        10,
        "--step-delay",
        0.01,
        env={"ELASTIX_TEST_MARKER": marker},
    )
    try:
        deadline = time.monotonic() + 60
        while not ckpt.exists():  # some progress was saved
            assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint written"
            time.sleep(0.05)
        victims = worker_pids(marker)
        assert victims, "no worker found"
        os.kill(victims[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    # the restarted workers resume from the step every rank held in the agent's memory
    assert re.search(r"resuming at step \d+ from the agent's memory", out), out
    assert f"resuming from {ckpt}" not in out
    assert "restart 1 of 1" in err
    assert abs(accuracy(out) - accuracy(one_process())) <= 0.01
