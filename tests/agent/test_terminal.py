"""Workers on a terminal, as under torchrun: with `elastix run` on a real pseudo-terminal and
output neither redirected, tee'd nor prefixed, a worker's stdin, stdout and stderr are the
terminal: `breakpoint()` gives a usable (Pdb) prompt, `isatty()` is true, `\\r` progress
shows at once, and Ctrl-C or SIGTERM still reach every worker through the agent. Piped
output (tee, prefixes, no terminal) relays unfinished lines promptly."""

import fcntl
import os
import select
import signal
import subprocess
import sys
import termios
import textwrap
import time

import pytest

DEADLINE = 60  # seconds any one expected output may take; a bound, not a timing assertion

WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    def stopped(signum, frame):
        print(f"worker {os.environ['LOCAL_RANK']} got signal {signum}", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    print(f"ttys {sys.stdin.isatty()} {sys.stdout.isatty()} {sys.stderr.isatty()}", flush=True)
    if os.environ.get("MODE") == "wait":
        print("waiting", flush=True)
        time.sleep(600)
        sys.exit(1)
    sys.stderr.write("\\rprogress 1/2")
    sys.stderr.flush()
    answer = input()  # the bar is on screen before anyone answers
    sys.stderr.write(f"\\rprogress 2/2 {answer}\\n")
    x = 6
    breakpoint()
    print(f"after pdb x={x}", flush=True)
    """
)


class Terminal:
    """`elastix run ...` as the session leader on a new pseudo-terminal, which is its
    controlling terminal (so Ctrl-C typed into it signals the agent's process group)."""

    def __init__(self, tmp_path, *run_args, env=None):
        self.master, slave = os.openpty()
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        command = [sys.executable, "-m", "elastix", "run", "--standalone", *run_args, str(script)]
        self.process = subprocess.Popen(
            command,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=tmp_path,
            env={**os.environ, "PYTHONBREAKPOINT": "pdb.set_trace", **(env or {})},
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        os.close(slave)
        self.seen = b""

    def expect(self, text: str) -> bytes:
        """Reads until `text` appears; returns everything read up to it."""
        wanted = text.encode()
        deadline = time.monotonic() + DEADLINE
        while wanted not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} never appeared; the terminal showed:\n{self.seen.decode(errors='replace')}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # EIO: every process using the terminal is gone
                    chunk = b""
                assert chunk, f"the terminal closed before {text!r}:\n{self.seen.decode(errors='replace')}"
                self.seen += chunk
        head, _, self.seen = self.seen.partition(wanted)
        return head + wanted

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def exit_code(self) -> int:
        try:
            return self.process.wait(timeout=DEADLINE)
        finally:
            self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=DEADLINE)
        os.close(self.master)


@pytest.fixture
def terminal(tmp_path):
    opened = []

    def open_terminal(*run_args, env=None):
        opened.append(Terminal(tmp_path, *run_args, env=env))
        return opened[-1]

    yield open_terminal
    for term in opened:
        if term.process.poll() is None:
            term.close()


def test_a_worker_on_a_terminal_can_be_debugged_and_shows_progress_live(terminal):
    term = terminal("--nproc-per-node", "1")
    term.expect("ttys True True True")
    # no newline yet: the bar is shown while the worker waits for input
    term.expect("progress 1/2")
    term.type("go\n")
    term.expect("progress 2/2 go")
    term.expect("(Pdb)")
    term.type("p x * 7\n")
    term.expect("42")
    term.type("x = 8\n")
    term.type("c\n")
    term.expect("after pdb x=8")
    assert term.exit_code() == 0


@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c"])
def test_sigterm_and_ctrl_c_reach_every_worker_on_a_terminal(terminal, stop):
    term = terminal("--nproc-per-node", "2", env={"MODE": "wait"})
    term.expect("waiting")
    term.expect("waiting")
    if stop == "sigterm":
        term.process.send_signal(signal.SIGTERM)
        number = signal.SIGTERM
    else:
        term.type("\x03")  # the terminal signals its foreground group, the agent's, alone
        number = signal.SIGINT
    seen = term.expect(f"got signal {number}") + term.expect(f"got signal {number}")
    assert b"worker 0" in seen and b"worker 1" in seen
    assert term.exit_code() == 128 + number


def test_tee_on_a_terminal_pipes_with_prefixes_and_relays_unfinished_lines(terminal):
    term = terminal("--nproc-per-node", "1", "--tee", "3")
    term.expect("[default0]:ttys True False False")  # stdin stays the terminal
    term.expect("[default0]:progress 1/2")  # no newline yet: relayed after a pause
    term.type("go\n")
    term.expect("[default0]:progress 2/2 go")
    # pdb's prompt has no newline either, and pdb still reads the terminal
    term.expect("[default0]:(Pdb)")
    term.type("c\n")
    term.expect("[default0]:after pdb x=6")
    assert term.exit_code() == 0


def test_without_a_terminal_unfinished_lines_are_relayed_promptly(tmp_path):
    script = tmp_path / "ask.py"
    script.write_text("import sys\nsys.stdout.write('name: ')\nsys.stdout.flush()\nprint('hello', input())\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "elastix", "run", "--standalone", "--nproc-per-node", "1", str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + DEADLINE
        seen = b""
        while b"name: " not in seen:
            assert time.monotonic() < deadline, f"the prompt never came: {seen!r}"
            ready, _, _ = select.select([process.stdout], [], [], 1)
            if ready:
                chunk = os.read(process.stdout.fileno(), 4096)
                assert chunk, f"stdout closed before the prompt: {seen!r}"
                seen += chunk
        process.stdin.write(b"world\n")
        process.stdin.close()
        rest = process.stdout.read()
        assert process.wait(timeout=DEADLINE) == 0
        assert b"hello world" in rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
