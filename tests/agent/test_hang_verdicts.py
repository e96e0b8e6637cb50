"""Hang detection judged on both sides: a table of plain programs (one process each, no elastix
import), each run under `elastix run --standalone --worker-timeout 2`, with the verdict each
must get. Healthy programs wait a lot (short sleeps, I/O, locks, a blocking C call, a thread
or a child that computes) and must finish untouched; stuck ones wait for good, some while a
side thread wakes now and then, and must be found hung within the timeout + 2 s. A main
thread blocked for good while another thread computes is neither: it runs on, and
`elastix status` shows it as "blocked, process busy"."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from agents import Agent, assert_nothing_left, elastix_run, finish, wait_for

TIMEOUT = 2.0
# about three timeouts of work, in waits each shorter than the timeout
HEALTHY = {
    "a loop of 0.1 s sleeps": """
        import time
        for step in range(60):
            time.sleep(0.1)
            print(step, flush=True)
    """,
    "steps that wait 1.6 s in recv()": """
        import socket, threading, time
        a, b = socket.socketpair()
        def feed():
            for _ in range(4):
                time.sleep(1.6)
                b.send(b"x")
        threading.Thread(target=feed, daemon=True).start()
        for step in range(4):
            a.recv(1)
            print(step, flush=True)
    """,
    "steps that wait 1.6 s on a lock": """
        import threading, time
        lock = threading.Lock()
        def hold():
            for _ in range(4):
                with lock:
                    time.sleep(1.6)
                time.sleep(0.01)
        threading.Thread(target=hold, daemon=True).start()
        time.sleep(0.05)
        for step in range(4):
            with lock:
                print(step, flush=True)
            time.sleep(0.02)
    """,
    "steps that block 1.6 s in a C call (as a blocking GPU synchronize)": """
        import os, threading, time
        r, w = os.pipe()
        def device():
            for _ in range(4):
                time.sleep(1.6)
                os.write(w, b"x")
        threading.Thread(target=device, daemon=True).start()
        for step in range(4):
            os.read(r, 1)
            print(step, flush=True)
    """,
    "a main thread joining a thread that computes for 6 s": """
        import threading, time
        def compute():
            end, x = time.monotonic() + 6, 0
            while time.monotonic() < end:
                x += 1
        t = threading.Thread(target=compute)
        t.start()
        t.join()
    """,
    "one long C call that burns CPU for 6 s": """
        import hashlib, time
        start = time.perf_counter()
        hashlib.pbkdf2_hmac("sha256", b"x", b"salt", 20_000)
        rounds = int(20_000 * 6 / max(time.perf_counter() - start, 1e-6))
        hashlib.pbkdf2_hmac("sha256", b"x", b"salt", rounds)
    """,
    "a main thread waiting 6 s for a child process that computes": """
        import subprocess, sys
        busy = "import time\\nend = time.monotonic() + 6\\nwhile time.monotonic() < end: pass"
        subprocess.run([sys.executable, "-c", busy], check=True)
    """,
}
STUCK = {
    "blocked in recv() for good": """
        import socket
        a, b = socket.socketpair()
        a.recv(1)
    """,
    "blocked on a lock for good": """
        import threading
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    """,
    "blocked in Event.wait() for good": """
        import threading
        threading.Event().wait()
    """,
    "blocked in recv() while a logging thread wakes every 0.2 s": """
        import logging, socket, threading, time
        logging.basicConfig(level=logging.INFO)
        def log():
            while True:
                time.sleep(0.2)
                logging.getLogger("side").debug("tick")
        threading.Thread(target=log, daemon=True).start()
        a, b = socket.socketpair()
        a.recv(1)
    """,
    "blocked in Event.wait() while a data thread works a little every 50 ms": """
        import threading, time
        def data():
            while True:
                time.sleep(0.05)
                sum(range(2000))
        threading.Thread(target=data, daemon=True).start()
        threading.Event().wait()
    """,
}
HUNG = r"its main thread has not run and its processes used no CPU for (\d+\.\d+)s \(--worker-timeout 2\.00s\)"


def verdict(tmp_path, marker, name, source):
    """Runs `source` as the one worker of a standalone job: (exit code, stderr)."""
    out = tmp_path / re.sub(r"\W+", "_", name)
    out.mkdir()
    script = out / "program.py"
    script.write_text(textwrap.dedent(source))
    proc = elastix_run("--standalone", "--worker-timeout", TIMEOUT, script, out_dir=out, marker=marker)
    code, _out, err = finish(proc, timeout=120)
    return code, err


@pytest.mark.parametrize("kind", ["healthy", "stuck"])
def test_each_program_gets_its_verdict(tmp_path, marker, kind):
    table = HEALTHY if kind == "healthy" else STUCK
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(zip(table, pool.map(lambda item: verdict(tmp_path, marker, *item), table.items())))
    wrong = []
    for name, (code, err) in results.items():
        found = re.search(r"hung      : " + HUNG, err)
        if kind == "healthy" and (code != 0 or "hung" in err):
            wrong.append(f"healthy, but {name!r} exited {code}:\n{err[-3000:]}")
        elif kind == "stuck" and not (code == 1 and found):
            wrong.append(f"stuck, but {name!r} was not found hung (exit {code}):\n{err[-3000:]}")
        elif kind == "stuck" and float(found.group(1)) > TIMEOUT + 2:
            wrong.append(f"{name!r} was found hung after {found.group(1)} s, past the timeout + 2 s")
    assert not wrong, "\n\n".join(wrong)
    assert_nothing_left(marker)


BLOCKED_BUSY = """
import os, threading, time
def spin():
    while not os.path.exists(os.path.join(os.environ["OUT_DIR"], "stop")):
        pass
    os._exit(0)
threading.Thread(target=spin, daemon=True).start()
threading.Event().wait()  # the main thread waits for good while another thread computes
"""


def test_a_blocked_main_thread_in_a_busy_process_runs_on_and_shows_as_blocked_busy(tmp_path, marker):
    script = tmp_path / "blocked_busy.py"
    script.write_text(BLOCKED_BUSY)
    argv = [sys.executable, "-m", "elastix", "run", "--standalone", "--worker-timeout", str(TIMEOUT), str(script)]
    a = Agent(argv, tmp_path, marker, "blocked_busy")
    try:
        shown = wait_for(
            lambda: [line for line in a.output().splitlines() if "to watch the job: elastix status" in line],
            what="the status command in the agent's log",
        )
        command = shlex.split(shown[0].split("to watch the job: ", 1)[1])

        def doing():
            done = subprocess.run([sys.executable, "-m", *command, "--json"], capture_output=True, text=True)
            workers = json.loads(done.stdout)["members"][0]["workers"] if done.stdout.strip() else []
            return workers and workers[0].get("doing") == "blocked_busy" and done

        wait_for(doing, timeout=60, what="the worker shown as blocked, process busy")
        human = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True).stdout
        assert "blocked, process busy" in human, human
        assert "hung" not in a.output(), a.output()
    finally:
        (tmp_path / "stop").touch()
        code = a.finish()
    assert code == 0, a.output()
    assert_nothing_left(marker)
