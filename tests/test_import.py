"""What `import elastix` does, in a fresh interpreter that compares its own state before and after
the import: outside `elastix run` it starts no thread, installs no signal handler (Python's or
native), leaves os.environ as it was and opens no file; in a worker of `elastix run` it claims the
heartbeat slot and arms stack dumps, as python/elastix/__init__.py's docstring says. And what
runs in a worker (python/elastix/worker) never loads the launcher (elastix.agent)."""

from __future__ import annotations

import ast
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap

from conftest import REPO

# Prints, as JSON, what `import elastix` changed in this process (the kernel's view of threads,
# signal handlers and descriptors, so that the extension's native ones count too).
PROBE = textwrap.dedent(
    """
    import atexit, json, os, signal, sys, threading

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1], 16)

    def target(fd):
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return "(closed)"  # the descriptor that listed the folder

    def state():
        handlers = {}
        for number in signal.valid_signals():
            try:
                handlers[int(number)] = repr(signal.getsignal(number))
            except (OSError, ValueError):
                pass
        return {
            "tasks": len(os.listdir("/proc/self/task")),
            "python_threads": threading.active_count(),
            "caught": status("SigCgt"),
            "ignored": status("SigIgn"),
            "blocked": status("SigBlk"),
            "handlers": handlers,
            "environ": dict(os.environ),
            "fds": sorted(target(fd) for fd in os.listdir("/proc/self/fd")),
            "atexit": atexit._ncallbacks() if hasattr(atexit, "_ncallbacks") else None,
        }

    logging_before = "logging" in sys.modules
    before = state()
    import elastix
    after = state()
    changed = {key: [before[key], after[key]] for key in before if before[key] != after[key]}
    print(json.dumps({"changed": changed, "logging_before": logging_before, "agent_loaded": sorted(m for m in sys.modules if m.startswith("elastix.agent"))}))
    """
)


def probe(env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIX_", "TORCHELASTIC_"))}
    env.update(env_extra or {})
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_import_elastix_starts_no_thread_installs_no_handler_and_leaves_the_environment():
    found = probe()
    changed = found["changed"]
    # the documented hooks: the extension's exit gate (rust/python/src/exit_gate.rs), and
    # logging's own flush, registered when logging is first imported (by the extension)
    hooks = changed.pop("atexit", None)
    assert hooks is None or hooks[1] - hooks[0] == (1 if found["logging_before"] else 2), hooks
    assert changed == {}, f"import elastix changed {sorted(changed)}: {changed}"
    assert found["agent_loaded"] == [], "the launcher loads on first use only"


def test_in_a_worker_of_elastix_run_import_elastix_claims_its_slot_and_arms_stack_dumps(tmp_path):
    words = 32
    page = tmp_path / "page"
    page.write_bytes(struct.pack(f"{words}Q", *[0] * words))
    stacks = tmp_path / "stacks"
    env = {"ELASTIX_HEARTBEAT_FILE": str(page), "ELASTIX_HEARTBEAT_SLOT": "0", "ELASTIX_STACKS_FILE": str(stacks)}
    changed = probe(env)["changed"]
    slot = struct.unpack(f"{words}Q", page.read_bytes())
    dump_signal, owner = slot[3], slot[5]
    assert dump_signal == signal.SIGRTMIN + 3 and owner > 0, slot
    # one handler more, on that signal (faulthandler's); the page stays mapped (mmap keeps a
    # descriptor of it) and the stacks file open for faulthandler
    caught_before, caught_after = changed.pop("caught")
    assert caught_after & ~caught_before == 1 << (dump_signal - 1), (caught_before, caught_after)
    fds_before, fds_after = changed.pop("fds")
    assert sorted(set(fds_after) - set(fds_before)) == sorted([str(page), str(stacks)]), (fds_before, fds_after)
    changed.pop("atexit", None)
    assert changed == {}, f"import elastix changed {sorted(changed)} in a worker: {changed}"


def test_worker_code_never_imports_the_launcher():
    """Nothing in python/elastix/worker imports elastix.agent, and running @record's failure
    path loads no module of it (ChildFailedError lives in elastix.errors)."""
    worker = os.path.join(REPO, "python", "elastix", "worker")
    offenders = []
    for folder, _, files in os.walk(worker):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            depth = len(os.path.relpath(path, os.path.join(REPO, "python")).split(os.sep)) - 1
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    package = ".".join(["elastix", "worker", *os.path.relpath(folder, worker).split(os.sep)][:depth])
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    module = node.module or ""
                    full = (base + "." + module if module else base) if node.level else module
                    names = [full] + [f"{full}.{alias.name}" for alias in node.names]
                else:
                    continue
                if any(n == "elastix.agent" or n.startswith("elastix.agent.") for n in names):
                    offenders.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    assert offenders == [], offenders

    code = textwrap.dedent(
        """
        import sys
        import elastix
        from elastix.worker import function_worker, progress, record, timer

        @elastix.record
        def main():
            raise ValueError("a worker's failure")

        try:
            main()
        except ValueError:
            pass
        print(sorted(m for m in sys.modules if m.startswith("elastix.agent")))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIX_", "TORCHELASTIC_"))}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_child_failed_error_is_one_class_under_every_name():
    import elastix
    import elastix.agent.failures
    import elastix.errors

    assert elastix.ChildFailedError is elastix.errors.ChildFailedError is elastix.agent.failures.ChildFailedError
    assert issubclass(elastix.ChildFailedError, Exception)
    assert "ChildFailedError" in elastix.errors.__all__ and "ChildFailedError" in elastix.agent.failures.__all__
