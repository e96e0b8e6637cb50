"""@elastix.record: torch's error.json, written by real worker processes."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from elastix.agent.failures import ChildFailedError, ProcessFailure
from elastix.worker.record import ErrorHandler, record


def run_worker(tmp_path, body, env=None, timeout=60):
    """Runs `body` (the inside of a @elastix.record main) in a fresh interpreter."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys, faulthandler\nimport elastix\n\n@elastix.record\ndef main():\n"
        + textwrap.indent(textwrap.dedent(body), "    ")
        + "\n\nif __name__ == '__main__':\n    print('returned', main())\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_ERROR_FILE", "ELASTIX_ERROR_FILE")}
    return subprocess.run(
        [sys.executable, str(script)], env={**clean, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


def test_uncaught_exception_writes_torch_error_file(tmp_path):
    error_file = tmp_path / "attempt_0" / "0" / "error.json"
    before = int(time.time())
    out = run_worker(tmp_path, "raise ValueError('bad lr')", {"TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert out.returncode == 1
    assert "ValueError: bad lr" in out.stderr  # the exception still propagates as usual
    data = json.loads(error_file.read_text())
    assert set(data) == {"message"} and set(data["message"]) == {"message", "extraInfo"}
    assert data["message"]["message"] == "ValueError: bad lr"
    extra = data["message"]["extraInfo"]
    assert set(extra) == {"py_callstack", "timestamp"}
    assert extra["py_callstack"].startswith("Traceback (most recent call last):")
    assert "raise ValueError('bad lr')" in extra["py_callstack"]
    assert extra["py_callstack"].rstrip().endswith("ValueError: bad lr")
    assert isinstance(extra["timestamp"], str) and before <= int(extra["timestamp"]) <= time.time() + 1
    assert not [p for p in error_file.parent.iterdir() if p.name != "error.json"]  # no temp file left


def test_elastix_error_file_too(tmp_path):
    torch_file, own_file = tmp_path / "t.json", tmp_path / "e.json"
    out = run_worker(tmp_path, "raise KeyError('k')",
                     {"TORCHELASTIC_ERROR_FILE": str(torch_file), "ELASTIX_ERROR_FILE": str(own_file)})  # fmt: skip
    assert out.returncode == 1
    assert json.loads(torch_file.read_text()) == json.loads(own_file.read_text())
    assert json.loads(own_file.read_text())["message"]["message"] == "KeyError: 'k'"
    out = run_worker(tmp_path, "raise KeyError('only')", {"ELASTIX_ERROR_FILE": str(own_file)})
    assert json.loads(own_file.read_text())["message"]["message"] == "KeyError: 'only'"


@pytest.mark.parametrize("body,code,printed", [
    ("sys.exit(0)", 0, "returned None"),  # a clean exit is a normal return (run_path scripts)
    ("return 5", 0, "returned 5"),
    ("sys.exit(3)", 3, None),
    ("sys.exit(None)", 0, None),
    ("raise KeyboardInterrupt", -2, None),  # Python dies of SIGINT, unrecorded as in torch
])  # fmt: skip
def test_exits_leave_no_error_file(tmp_path, body, code, printed):
    error_file = tmp_path / "error.json"
    out = run_worker(tmp_path, body, {"TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert out.returncode == code, out.stderr
    if printed:
        assert printed in out.stdout
    assert not error_file.exists()


def test_without_an_error_file_nothing_is_written(tmp_path):
    out = run_worker(tmp_path, "raise RuntimeError('x')")
    assert out.returncode == 1 and "RuntimeError: x" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker.py"]


def test_faulthandler_is_on_and_dumps_a_crash(tmp_path):
    out = run_worker(tmp_path, "assert faulthandler.is_enabled()\nimport ctypes\nctypes.string_at(0)")
    assert out.returncode < 0  # SIGSEGV
    assert "Fatal Python error" in out.stderr and "main" in out.stderr


def test_record_in_process(tmp_path, monkeypatch):
    error_file = tmp_path / "e.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    @record
    def fails(x):
        raise ValueError(f"x={x}")

    with pytest.raises(ValueError):
        fails(1)
    assert json.loads(error_file.read_text())["message"]["message"] == "ValueError: x=1"
    assert fails.__name__ == "fails"  # functools.wraps
    assert record()(lambda: 4)() == 4  # also usable as @record()


def test_custom_error_handler(monkeypatch):
    seen = []

    class Handler(ErrorHandler):
        def initialize(self):
            seen.append("init")

        def record_exception(self, e):
            seen.append(repr(e))

    with pytest.raises(OSError):
        record(lambda: (_ for _ in ()).throw(OSError("disk")), error_handler=Handler())()
    assert seen == ["init", "OSError('disk')"]


def test_child_failed_error_copies_the_root_cause_to_the_parent_file(tmp_path, monkeypatch):
    child = tmp_path / "child.json"
    payload = {"message": {"message": "ValueError: x", "extraInfo": {"py_callstack": "tb", "timestamp": "100"}}}
    child.write_text(json.dumps(payload))
    parent = tmp_path / "parent.json"
    parent.write_text("stale")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(parent))
    failures = {
        0: ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=None, timestamp=200.0),
        1: ProcessFailure(local_rank=1, pid=2, exitcode=3, error_file=str(child)),
    }

    @record
    def launcher():
        raise ChildFailedError("train.py", failures)

    with pytest.raises(ChildFailedError):
        launcher()
    data = json.loads(parent.read_text())
    assert data["message"]["errorCode"] == 3 and data["message"]["message"] == "ValueError: x"


def test_elastix_record_is_the_decorator_even_after_importing_its_module():
    import elastix.worker.record

    assert elastix.record is record and callable(elastix.record)
