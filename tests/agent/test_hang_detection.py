"""Hang detection end to end: a worker whose heartbeat, progress window or timer lapses is
found hung by its agent, its threads' stacks are dumped into the failure summary, it is
killed, and the job restarts it like a failed worker."""

import json
import os
import re
import shutil
import sys
import textwrap

import pytest

from agents import assert_nothing_left, elastix_run, finish

# MODE: heartbeat (beats, then stops in a function the stack must show), window (inside
# expect_progress), timer (inside elastix.timer.expires), fine (beats and finishes). A
# restarted worker (TORCHELASTIC_RESTART_COUNT > 0) finishes at once.
WORKER = textwrap.dedent(
    """
    import os, threading, time
    from datetime import timedelta
    import elastix

    def stuck_in_data_loader():
        time.sleep(600)

    def side_thread_waits():
        threading.Event().wait()

    open(os.path.join(os.environ["OUT_DIR"], f"start_{os.environ['TORCHELASTIC_RESTART_COUNT']}"), "w").close()
    if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
        raise SystemExit(0)
    threading.Thread(target=side_thread_waits, name="side", daemon=True).start()
    mode = os.environ["MODE"]
    for _ in range(5):
        elastix.heartbeat()
        time.sleep(0.01)
    if mode == "heartbeat":
        stuck_in_data_loader()
    elif mode == "window":
        with elastix.expect_progress(within=timedelta(seconds=1)):
            stuck_in_data_loader()
    elif mode == "timer":
        with elastix.timer.expires(after=1):
            stuck_in_data_loader()
    """
)


@pytest.fixture
def worker(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return script


def run(tmp_path, marker, worker, mode, *flags):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MODE", mode)
        proc = elastix_run("--standalone", *flags, worker, out_dir=tmp_path, marker=marker)
    return finish(proc, timeout=120)


@pytest.mark.parametrize(
    "mode, flags, reason",
    [
        ("heartbeat", ["--worker-timeout", "2"], r"no heartbeat for (\d+\.\d+)s \(--worker-timeout 2\.00s\)"),
        ("window", [], r"no progress for (\d+\.\d+)s in a window of 1\.00s"),
        ("timer", [], r"its timer expired (\d+\.\d+)s ago"),
    ],
)
def test_a_hung_worker_is_named_with_its_stacks_and_the_job_fails(tmp_path, marker, worker, mode, flags, reason):
    code, _out, err = run(tmp_path, marker, worker, mode, *flags)
    assert code == 1, err
    found = re.search(r"hung      : " + reason + r"; last heartbeat: \d{4}-", err)
    assert found, err
    # found within a second of the lapse, as the agent measured it
    assert float(found.group(1)) < {"heartbeat": 2 + 1, "window": 1 + 1, "timer": 1}[mode], err
    assert re.search(r"exitcode  : -9 \(pid: \d+\) \(SIGKILL\)", err), err
    # every thread's stack, the stuck frame included
    assert "stacks when it was found hung:" in err
    assert "in stuck_in_data_loader" in err and "in side_thread_waits" in err
    assert_nothing_left(marker)


def test_a_hung_worker_is_restarted_like_a_failed_one(tmp_path, marker, worker):
    code, _out, err = run(tmp_path, marker, worker, "heartbeat", "--worker-timeout", "1", "--max-restarts", "1")
    assert code == 0, err
    assert (tmp_path / "start_1").exists(), "the restarted attempt ran"
    assert re.search(r"worker rank 0 \(local rank 0, pid \d+\) is hung: no heartbeat for", err), err
    # its stacks come with the warning, though no summary follows a job that goes on, and stay
    # in the attempt's log directory: a temporary one outlives the job's success, which says so
    kept = re.search(r"killing it\. Its stacks \(kept in (\S+)\):\n(.*)", err, re.S)
    assert kept and "in stuck_in_data_loader" in kept.group(2), err
    run_dir = re.search(r"succeeded after 1 restart\(s\); the logs of every attempt .* are kept in (\S+)", err)
    assert run_dir and kept.group(1).startswith(run_dir.group(1) + "/attempt_0/"), err
    try:
        assert "in stuck_in_data_loader" in open(kept.group(1)).read()
    finally:
        shutil.rmtree(run_dir.group(1))
    assert_nothing_left(marker)


# Plain programs that never import elastix: the site hook watches their main thread.
BLOCKED = textwrap.dedent(
    """
    import threading

    def wait_for_a_peer_that_never_comes():
        threading.Event().wait()

    wait_for_a_peer_that_never_comes()
    """
)
# One C call that burns about 8 s of CPU (sized on this machine first), then done.
BUSY = textwrap.dedent(
    """
    import hashlib, time

    start = time.perf_counter()
    hashlib.pbkdf2_hmac("sha256", b"x", b"salt", 20_000)
    rounds = int(20_000 * 8 / max(time.perf_counter() - start, 1e-6))
    hashlib.pbkdf2_hmac("sha256", b"x", b"salt", rounds)
    print("done")
    """
)


def run_program(tmp_path, marker, source, *flags):
    """`elastix run --standalone FLAGS` of the program `source`: (exit code, stdout, stderr)."""
    script = tmp_path / "program.py"
    script.write_text(source)
    proc = elastix_run("--standalone", *flags, script, out_dir=tmp_path, marker=marker)
    return finish(proc, timeout=120)


def test_a_plain_worker_blocked_forever_is_hung_with_its_stack(tmp_path, marker):
    code, _out, err = run_program(tmp_path, marker, BLOCKED, "--worker-timeout", "2")
    assert code == 1, err
    reason = r"its main thread has not run and its processes used no CPU for (\d+\.\d+)s \(--worker-timeout 2\.00s\)"
    found = re.search(r"hung      : " + reason, err)
    assert found, err
    print(f"a blocked plain worker declared hung after {found.group(1)} s (--worker-timeout 2)")
    assert float(found.group(1)) < 2 + 1, err  # as the agent measured it: within a second of the timeout
    # its stack, shown with the warning (and where it is kept) and in the summary
    assert re.search(r"is hung: its main thread has not run.*killing it\. Its stacks \(kept in \S+\):", err), err
    assert err.count("in wait_for_a_peer_that_never_comes") >= 2, err
    assert_nothing_left(marker)


def test_a_plain_worker_restarted_from_a_warm_standby_is_watched_too(tmp_path, marker):
    code, _out, err = run_program(tmp_path, marker, BLOCKED, "--worker-timeout", "1", "--max-restarts", "1")
    assert code == 1, err
    # both attempts found hung: the second one (started from the standby the agent keeps warm
    # for a restart) goes through the site hook after its activation, as a cold start does
    assert len(re.findall(r"is hung: its main thread has not run", err)) == 2, err
    assert_nothing_left(marker)


def test_a_worker_busy_in_one_long_c_call_is_not_hung(tmp_path, marker):
    code, out, err = run_program(tmp_path, marker, BUSY, "--worker-timeout", "2")
    assert code == 0 and "done" in out and "hung" not in err, err


HOLDUP = textwrap.dedent(
    """
    import threading
    import numpy as np
    import elastix.collectives as ec

    def stuck_before_collective():
        threading.Event().wait()

    ec.init_process_group()
    x = np.ones(16)
    for _ in range(4):
        ec.all_reduce(x)
    if ec.get_rank() == 1:
        stuck_before_collective()
    ec.all_reduce(x)  # the others' fifth, which rank 1 never enters
    """
)


def test_the_rank_that_never_enters_a_collective_is_named_not_the_ones_that_wait(tmp_path, marker):
    events = tmp_path / "events.jsonl"
    flags = ("--nproc-per-node", "3", "--worker-timeout", "2", "--event-log", str(events))
    code, _out, err = run_program(tmp_path, marker, HOLDUP, *flags)
    assert code == 1, err
    named = r"ranks 0,2 wait in all_reduce #5 \(group 0\) for rank 1; rank 1 is in stuck_before_collective \(\S+:\d+\)"
    assert re.search(r"is hung: .*" + named, err), err  # with the warning
    assert re.search(r"hung      : .*" + named, err), err  # and in the summary
    # the root cause is rank 1, whichever rank was found hung first: in the summary...
    root = err.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root, err
    # ...in the event log, and in the job's end there
    logged = [json.loads(line) for line in events.read_text().splitlines()]
    hung = {e["global_rank"]: e for e in logged if e["event"] == "worker_hung"}
    assert [rank for rank, e in hung.items() if e["root_cause"]] == [1], logged
    assert "stuck_before_collective" in hung[1]["message"], hung[1]
    (end,) = [e for e in logged if e["event"] == "job_finished"]
    assert end["state"] == "FAILED" and end["root_cause"].startswith("rank 1 (host "), end
    assert_nothing_left(marker)


CROSS_NODE = HOLDUP.replace("if ec.get_rank() == 1:", "if ec.get_rank() == 2:")


@pytest.fixture
def hosts():
    from netns import hosts_for_a_test

    yield from hosts_for_a_test(2)


def test_across_hosts_the_rank_that_never_enters_is_named_by_the_other_nodes(tmp_path, marker, hosts):
    """Two namespace hosts, two ranks each; rank 2 (host 1) never enters the fifth all_reduce.
    Host 0's ranks 0 and 1 wait inside it with nobody missing on host 0: its agent asks the
    other agent for its flight records through the store and names rank 2, with where it is.
    (Host 1 waits longer before calling a worker hung, so that host 0 finds the hang first.)"""
    from agents import agent

    script = tmp_path / "program.py"
    script.write_text(CROSS_NODE)
    endpoint = f"{hosts.addr(0)}:29400"
    conf = "keep_alive_interval=250ms,keep_alive_max_attempt=8,join_timeout=60s"
    nodes = [
        agent(
            tmp_path,
            marker,
            f"n{i}",
            "run",
            *("--nnodes", 2, "--nproc-per-node", 2, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint),
            *("--rdzv-id", "crossnode", "--local-addr", hosts.addr(i), "--rdzv-conf", conf),
            *("--worker-timeout", 2 + 8 * i, "--event-log", tmp_path / f"events{i}.jsonl", script),
            python=tuple(hosts.python(i)),
        )
        for i in range(2)
    ]
    try:
        codes = [node.finish(timeout=120) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    outputs = [node.output() for node in nodes]
    assert codes == [1, 1], outputs
    named = (
        r"ranks 0,1,3 wait in all_reduce #5 \(group 0\) for rank 2; rank 2 is in stuck_before_collective \(\S+:\d+\)"
    )
    assert re.search(r"is hung: .*" + named, outputs[0]), outputs[0]  # with the warning
    assert re.search(r"hung      : .*" + named, outputs[0]), outputs[0]  # and in the summary
    # which closes the job: host 1 shows it
    assert "the job was closed after a failure on another node" in outputs[1], outputs[1]
    assert re.search(r"hung      : .*" + named, outputs[1]), outputs[1]
    assert_nothing_left(marker)


SPAWNS = textwrap.dedent(
    """
    import multiprocessing, threading, time
    import elastix

    def child_beats():  # for 150 s: a parent that counted them would outlast the test
        for _ in range(30000):
            elastix.heartbeat()
            time.sleep(0.005)

    if __name__ == "__main__":
        elastix.heartbeat()
        for method in ("spawn", "forkserver"):
            multiprocessing.get_context(method).Process(target=child_beats, daemon=True).start()
        threading.Event().wait()  # the worker itself stops beating: only its children beat
    """
)


def test_children_started_with_spawn_or_forkserver_do_not_beat_for_their_parent(tmp_path, marker):
    code, _out, err = run_program(tmp_path, marker, SPAWNS, "--worker-timeout", "2")
    assert code == 1 and "hung      : no heartbeat for" in err, err
    assert_nothing_left(marker)


def test_heartbeats_outside_elastix_run_do_nothing():
    code = "import elastix\nelastix.heartbeat()\nwith elastix.expect_progress(within=1):\n    pass\n"
    code += "with elastix.timer.expires(after=1):\n    elastix.heartbeat()\nprint('ok')\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIX_HEARTBEAT")}
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout == "ok\n", done.stderr


def test_bad_durations_are_refused():
    import elastix

    with pytest.raises(ValueError, match="within must be a positive duration"):
        with elastix.expect_progress(within=0):
            pass
    with pytest.raises(ValueError, match="after must be a positive duration"):
        with elastix.timer.expires(after=-1):
            pass
