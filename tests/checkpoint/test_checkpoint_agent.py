"""elastix.checkpoint under `elastix run`: a worker that dies is restarted and both ranks
resume from the step they both hold in the agent's memory; the agent persists the newest steps
(checksummed, the newest --checkpoint-keep kept) and removes its memory at the end; a new run
of the same job ID restores from disk."""

import glob
import json
import os
import textwrap
import zlib

import pytest

from agents import assert_nothing_left, elastix_run, finish
from conftest import reserved_port

STEPS = 20

TRAIN = textwrap.dedent(
    f"""
    import json, os
    import numpy as np
    import elastix
    import elastix.collectives as ec

    ckpt = elastix.checkpoint.open()
    state = ckpt.load()
    ec.init_process_group("cpu")
    rank, restart, out = ec.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["OUT_DIR"]
    with open(os.path.join(out, f"start_{{restart}}_{{rank}}.json"), "w") as f:
        json.dump({{"step": ckpt.step, "source": ckpt.source, "memory": os.environ["ELASTIX_CHECKPOINT_MEMORY"]}}, f)
    w = np.zeros(256, dtype=np.float32) if state is None else state["w"]
    for step in range(0 if state is None else ckpt.step + 1, {STEPS}):
        grad = np.ones_like(w)
        ec.all_reduce(grad)  # the ranks move in step, as data-parallel training does
        w += grad
        ckpt.save(step, {{"w": w, "step": step}})
        if restart == "0" and rank == 1 and step == 8:
            os._exit(3)  # dies right after a save
    ec.barrier()
    with open(os.path.join(out, f"end_{{restart}}_{{rank}}.json"), "w") as f:
        json.dump({{"w": float(w[0]), "same": bool((w == w[0]).all())}}, f)
    ec.destroy_process_group()
    """
)


def read(path):
    with open(path) as f:
        return json.load(f)


def run(tmp_path, marker, checkpoints, job, *extra):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    with reserved_port() as port:
        proc = elastix_run(
            "--nnodes", 1, "--nproc-per-node", 2, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", job, "--max-restarts", 1, "--checkpoint-dir", checkpoints, *extra, script,
            out_dir=tmp_path, marker=marker,
        )  # fmt: skip
        code, _out, err = finish(proc, timeout=120)
    assert code == 0, err
    return err


def test_a_restarted_worker_resumes_from_the_agents_memory_and_nothing_is_lost(tmp_path, marker):
    checkpoints = tmp_path / "checkpoints"
    run(tmp_path, marker, checkpoints, "ckpt-job", "--checkpoint-keep", 2)
    first = [read(tmp_path / f"start_0_{rank}.json") for rank in (0, 1)]
    assert [start["step"] for start in first] == [None, None]
    resumed = [read(tmp_path / f"start_1_{rank}.json") for rank in (0, 1)]
    # both ranks took the same step, the newest they both held, from memory
    assert resumed[0]["step"] == resumed[1]["step"] in (7, 8), resumed
    assert {start["source"] for start in resumed} == {"memory"}
    # every step counted once: each adds 2 (the two ranks' gradients)
    for rank in (0, 1):
        assert read(tmp_path / f"end_1_{rank}.json") == {"w": 2.0 * STEPS, "same": True}
    # the agent persisted the newest step, checksummed, and kept at most two
    run_dir = checkpoints / "ckpt-job"
    steps = sorted(os.listdir(run_dir))
    assert steps[-1] == f"step-{STEPS - 1:012d}" and len(steps) <= 2, steps
    for rank in (0, 1):
        manifest = read(run_dir / steps[-1] / f"rank-{rank}.json")
        data = (run_dir / steps[-1] / f"rank-{rank}.data").read_bytes()
        assert manifest["step"] == STEPS - 1 and manifest["rank"] == rank
        assert zlib.crc32(data) == manifest["crc32"] and len(data) == manifest["size"]
    assert not glob.glob(str(run_dir / "*" / "*.tmp"))
    # the memory went with the agent
    assert not os.path.exists(resumed[0]["memory"])
    assert_nothing_left(marker)


def test_a_new_run_of_the_job_restores_from_disk_and_another_job_sees_nothing(tmp_path, marker):
    checkpoints = tmp_path / "checkpoints"
    run(tmp_path, marker, checkpoints, "ckpt-disk")
    for path in glob.glob(str(tmp_path / "start_*.json")) + glob.glob(str(tmp_path / "end_*.json")):
        os.unlink(path)
    run(tmp_path, marker, checkpoints, "ckpt-disk")
    again = [read(tmp_path / f"start_0_{rank}.json") for rank in (0, 1)]
    assert [(start["step"], start["source"]) for start in again] == [(STEPS - 1, "disk")] * 2
    # another job ID, the same directory: its own checkpoints only (none)
    run(tmp_path, marker, checkpoints, "ckpt-other")
    assert [read(tmp_path / f"start_0_{rank}.json")["step"] for rank in (0, 1)] == [None, None]
    assert_nothing_left(marker)


@pytest.mark.parametrize("keep", [0])
def test_a_bad_checkpoint_keep_is_refused_before_anything_starts(tmp_path, marker, keep):
    script = tmp_path / "nothing.py"
    script.write_text("")
    proc = elastix_run("--standalone", "--checkpoint-keep", keep, script, out_dir=tmp_path, marker=marker)
    code, _out, err = finish(proc)
    assert code != 0 and "--checkpoint-keep must be at least 1" in err, err


SAVES_UNTIL_STOPPED = textwrap.dedent(
    """
    import json, os, signal
    import numpy as np
    import elastix

    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    ckpt = elastix.checkpoint.open()
    out, step = os.environ["OUT_DIR"], 0
    while not stopped:
        ckpt.save(step, {"w": np.full(1024, step, dtype=np.float32)})
        if step == 200:
            open(os.path.join(out, "running"), "w").close()
        step += 1
    with open(os.path.join(out, "last_saved.json"), "w") as f:
        json.dump(step - 1, f)
    """
)


def test_a_stop_signal_persists_the_newest_step_before_the_agent_exits(tmp_path, marker):
    """The agent persists every half second; a worker saving every few hundred microseconds is
    always ahead of that, so only the flush at the end can put its very last step on disk."""
    import signal
    import time

    script = tmp_path / "saves.py"
    script.write_text(SAVES_UNTIL_STOPPED)
    checkpoints = tmp_path / "checkpoints"
    proc = elastix_run("--standalone", "--checkpoint-dir", checkpoints, script, out_dir=tmp_path, marker=marker)
    deadline = time.monotonic() + 60
    while not (tmp_path / "running").exists():
        assert time.monotonic() < deadline and proc.poll() is None, finish(proc)
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code, _out, err = finish(proc)
    assert code == 128 + signal.SIGTERM, err
    last = read(tmp_path / "last_saved.json")
    (run_dir,) = checkpoints.iterdir()
    newest = sorted(run_dir.iterdir())[-1]
    assert newest.name == f"step-{last:012d}", (newest.name, last)
    assert read(newest / "rank-0.json")["step"] == last
    assert_nothing_left(marker)


RESUMES_AND_SAVES = textwrap.dedent(
    """
    import json, os, time
    import numpy as np
    import elastix

    ckpt = elastix.checkpoint.open()
    state = ckpt.load()
    out = os.environ["OUT_DIR"]
    exact = state is None or bool((state["w"] == ckpt.step).all())
    with open(os.path.join(out, f"start_{os.getpid()}.json"), "w") as f:
        json.dump({"step": ckpt.step, "source": ckpt.source, "exact": exact}, f)
    step, saved = 0 if state is None else ckpt.step + 1, 0
    while not os.path.exists(os.path.join(out, "stop")):
        ckpt.save(step, {"w": np.full(64 * 1024, step, dtype=np.float32)})
        saved += 1
        if saved == 30:
            open(os.path.join(out, "running"), "w").close()
        step += 1
        time.sleep(0.02)
    """
)


def test_an_agent_killed_outright_is_resumed_from_disk_by_the_next_run(tmp_path, marker):
    """SIGKILL gives the agent no flush: the next run of the job restores the newest step the
    background persisting completed, whole and checked, and never a torn one."""
    import signal
    import time

    script = tmp_path / "resumes.py"
    script.write_text(RESUMES_AND_SAVES)
    checkpoints = tmp_path / "checkpoints"
    with reserved_port() as port:
        endpoint = f"127.0.0.1:{port}"
    # (--standalone would name each run anew: the job's ID is what finds its checkpoints)
    flags = ("--nnodes", 1, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "killed")
    flags += ("--checkpoint-dir", checkpoints)
    proc = elastix_run(*flags, script, out_dir=tmp_path, marker=marker)
    deadline = time.monotonic() + 60
    while not (tmp_path / "running").exists():
        assert time.monotonic() < deadline and proc.poll() is None, finish(proc)
        time.sleep(0.05)
    time.sleep(1)  # a persisting pass or two
    proc.send_signal(signal.SIGKILL)
    finish(proc)
    assert_nothing_left(marker)  # its workers went with it
    # nothing removed the killed agent's memory: the next agent on the machine does
    left = glob.glob("/dev/shm/elastix-ckpt-killed-*")
    assert left, "the killed agent's checkpoint memory"
    (run_dir,) = checkpoints.iterdir()
    persisted = max(int(path.name[5:]) for path in run_dir.iterdir() if (path / "rank-0.json").exists())
    (tmp_path / "running").unlink()
    again = elastix_run(*flags, script, out_dir=tmp_path, marker=marker)
    while not (tmp_path / "running").exists():
        assert time.monotonic() < deadline + 60 and again.poll() is None, finish(again)
        time.sleep(0.05)
    (tmp_path / "stop").touch()
    code, _out, err = finish(again)
    assert code == 0, err
    resumed = [read(path) for path in tmp_path.glob("start_*.json") if read(path)["step"] is not None]
    assert resumed == [{"step": persisted, "source": "disk", "exact": True}], (resumed, persisted)
    assert not [path for path in left if os.path.exists(path)], left
    assert "removed the checkpoint memory of an agent that died" in err


FILLS_THE_DISK = textwrap.dedent(
    """
    import json, os
    import numpy as np
    import elastix

    ckpt = elastix.checkpoint.open()
    state = ckpt.load()
    restart, out = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["OUT_DIR"]
    with open(os.path.join(out, f"start_{restart}.json"), "w") as f:
        json.dump({"step": ckpt.step, "source": ckpt.source}, f)
    for step in range(0 if state is None else ckpt.step + 1, 200):
        ckpt.save(step, {"w": np.full(32 * 1024, step, dtype=np.float32)})  # 128 KiB
        if restart == "0" and step == 100:
            os._exit(5)
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs as the full disk needs root")
def test_a_full_disk_is_said_once_and_training_goes_on_from_memory(tmp_path, marker):
    import subprocess

    script = tmp_path / "fills.py"
    script.write_text(FILLS_THE_DISK)
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], check=True)
    try:
        proc = elastix_run(
            "--standalone", "--max-restarts", 1, "--checkpoint-dir", full, script, out_dir=tmp_path, marker=marker
        )
        code, _out, err = finish(proc)
        assert code == 0, err
        warnings = [line for line in err.splitlines() if "WARN" in line and "cannot write rank 0's step" in line]
        # said when the disk first refused, and once more at the end (the last flush); never a flood
        assert 1 <= len(warnings) <= 3 and "No space left on device" in warnings[0], err
        assert "the copy in memory is kept and training goes on" in warnings[0]
        assert read(tmp_path / "start_1.json") == {"step": 100, "source": "memory"}
        assert not list(full.rglob("*.tmp")), "no half-written file is left on the full disk"
    finally:
        subprocess.run(["umount", str(full)], check=True)
    assert_nothing_left(marker)
