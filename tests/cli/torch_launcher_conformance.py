"""Runs PyTorch's own launcher tests against ``elastix run`` and elastix's launcher API, and
prints one row per test: name, outcome, first line of the error.

    python tests/cli/torch_launcher_conformance.py [--torch-test-dir DIR] [-k SUBSTRING] [--baseline]

torch's tests are not part of this repository, and nothing is downloaded: they are taken from
``--torch-test-dir``, else from ``$ELASTIX_TORCH_TEST_DIR``, else from next to the installed torch
(a source checkout installed in place has them at ``<checkout>/test``; wheels do not ship them,
and torch publishes no source distribution on PyPI). The directory is laid out as torch's
``test/`` tree (``DIR/distributed/launcher/test_run.py``, ``DIR/distributed/launcher/bin/...``).
Use the files of the torch version installed: their helpers (``torch.testing._internal``) come
from that torch; ``--baseline`` runs them on torch's own launcher, to check that they fit it.
Exit status: 0 when every test that does not pass is listed in ``KNOWN`` below, 1 otherwise, 2
when torch or the tests are missing.

The files run (``SUITES``), and why:

* ``distributed/launcher/test_run.py``: torchrun's command line (``torch.distributed.run.main``);
* ``distributed/launcher/api_test.py``: the launcher API (``elastic_launch``, ``LaunchConfig``,
  ``launch_agent``) end to end, on an etcd server of torch's test helper (needs the ``etcd``
  binary and the ``python-etcd`` client; torch's own CI no longer runs this file, but it is the
  one that launches through the API for real);
* ``distributed/launcher/test_api.py``: ``launch_agent``, as torch's CI runs it;
* ``distributed/elastic/agent/server/test/shutdown_timeout_test.py``: the one agent test file
  that drives the public ``LaunchConfig`` (its ``shutdown_timeout``); its tests of the agent
  classes are torch internals.

Not run: the other agent tests (``local_elastic_agent_test.py``, ``api_test.py`` of the agent
server, ``elastic_agent_rendezvous_contract_test.py``, the GPU health checks) construct torch's
``SimpleElasticAgent``/``LocalElasticAgent`` with rendezvous handler objects and call their
methods: that is torch's agent implementation, which elastix (an agent in Rust behind the
launcher) does not expose. ``launch_test.py`` tests the deprecated ``torch.distributed.launch``
(``--use-env``, ``--local-rank`` passed to the script), which elastix does not reimplement;
torch's CI does not run it either, and its ``test_launch_without_env`` fails on torch 2.15's
own launcher. ``exit_barrier_timeout_test.py``, ``test_run_supervisor.py`` and
``elastic_launch_test.py`` test a ``LaunchConfig`` field, a rendezvous backend and a module
that torch 2.15 does not have.

How the substitution works, without touching torch: each test module is executed with its own
``__import__``, so that the names it imports from torch's launcher are elastix's:

* ``torch.distributed.run``: ``main(argv)`` runs ``elastix.cli.run.main(argv)`` in this
  process. torch's ``main`` returns or raises where ``elastix run`` exits, so its exit status is
  turned back: 0 returns, 2 (elastix run's documented status for a bad command line or
  configuration, which torch raises as ``ValueError``) raises ``ValueError`` with elastix's
  message, any other status raises ``SystemExit`` with it (a failed job is status 1, not
  torch's ``ChildFailedError``). ``parse_min_max_nnodes`` is the function ``elastix run``
  parses ``--nnodes`` with;
* ``torch.distributed.launcher.api``: elastix's ``LaunchConfig``, ``elastic_launch``,
  ``launch_agent`` and ``entrypoint_name`` (torch's ``_get_entrypoint_name``);
* ``RunResult``, ``WorkerState``, ``WorkerSpec``, ``DefaultLogsSpecs``, ``ChildFailedError``
  and ``SignalException`` are elastix's; ``SimpleElasticAgent`` and ``LocalElasticAgent`` are
  stand-ins that raise ``TorchInternalsError`` when made (elastix has no such classes);
* the rest (``torch.testing``, ``get_free_port``, ``EtcdServer``, ``torch`` itself) is torch's.

Those stand-ins only have the names listed: a test that reads another name off them fails
with ``AttributeError`` rather than quietly exercising torch. ``mock.patch`` targets in the tests
name torch's modules, so they patch torch, which elastix never calls: such tests fail here,
and ``KNOWN`` says so.

Each file runs in a process of its own (a new session); the tests print what they print into
a log file. A test that gives no result within ``--per-test-timeout`` seconds is recorded as an
error, its process tree is killed, and the file goes on in a new process from the next test;
``--timeout`` bounds the whole run. Workers started through the API import the test module by
its file name (its directory is put on ``sys.path``), as torch's ``spawn`` would.
"""

from __future__ import annotations

import argparse
import builtins
import importlib
import importlib.abc
import importlib.util
import io
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import unittest
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: run as a script too
from conformance_rows import RowRecorder, expecttest_stand_in, print_rows, test_classes

ENV_VAR = "ELASTIX_TORCH_TEST_DIR"
PER_TEST_TIMEOUT_S = 150  # the slowest tests take about 30 s here (an elastic job's 30 s last call)
TOTAL_TIMEOUT_S = 1800
_CHILD_ENV = "ELASTIX_LAUNCHER_CONFORMANCE_MODULE"  # tells spawn children which module to substitute

# (path under the test dir, module name). The module name is the file's, so that workers and
# spawn children can import the functions the tests pass them.
SUITES: List[Tuple[str, str]] = [
    ("distributed/launcher/test_run.py", "test_run"),
    ("distributed/launcher/api_test.py", "api_test"),
    ("distributed/launcher/test_api.py", "test_api"),
    ("distributed/elastic/agent/server/test/shutdown_timeout_test.py", "shutdown_timeout_test"),
]

# Tests that do not pass with elastix, by id, with (kind, reason):
#   "internals": depends on torch internals that a reimplementation cannot provide (most of
#                these patch torch's agent or rendezvous classes with mocks and assert on them);
#   "elastix":   a difference in elastix's behaviour (a bug to fix, then drop it from here);
#   "by design": a documented elastix difference.
# Measured with torch 2.15.0 (git d0f2af8b) and pytorch/pytorch's files of these commits (the
# stored copies nearest to v2.15.0 at hand): test_run.py 0943060f, api_test.py 05382727,
# test_api.py 0c363736, shutdown_timeout_test.py 12eeed53; bin/test_script.py c3c6b74e,
# test_script.sh 6d6d705d, test_script_init_method.py 0536503a,
# test_script_is_torchelastic_launched.py 7a86e058. With --baseline every test passes on
# torch's own launcher except test_api's ..._does_not_mask_child_failed_error (newer than 2.15).
_MOCKED_AGENT = "mocks torch's LocalElasticAgent{what} and asserts on the mock; elastix's agent is not that class"
_QUOTED_CONF = (
    "the test's --rdzv-conf has literal quotes ('join_timeout=5,...,timeout=5'), so a key \"'join_timeout\": "
    "torch ignores unknown keys, elastix refuses them (README); without the quotes the same command passes"
)
KNOWN: Dict[str, Tuple[str, str]] = {
    # test_run.py: torchrun's command line
    "test_run.ElasticLaunchTest.test_capture_logs_using_default_logs_specs": (
        "elastix",
        "the Rust agent writes the workers' console lines to this process's stdout file descriptor itself, not "
        "through Python's sys.stdout, so contextlib.redirect_stdout does not capture them (torch's agent writes "
        "them with Python)",
    ),
    "test_run.ElasticLaunchTest.test_launch_elastic": ("by design", _QUOTED_CONF),
    "test_run.ElasticLaunchTest.test_launch_elastic_worker_raise_exception": (
        "by design",
        _QUOTED_CONF + "; then it wants torch.distributed.run.main to raise ChildFailedError (elastix run exits 1) "
        "and torch's events.record (mocked) called",
    ),
    "test_run.ElasticLaunchTest.test_launch_elastic_agent_raise_exception": (
        "internals",
        _MOCKED_AGENT.format(what=".run to raise") + ": the job runs and succeeds",
    ),
    "test_run.ElasticLaunchTest.test_launch_shutdown": (
        "internals",
        _MOCKED_AGENT.format(what=" and torch's rendezvous registry")
        + ": the mocked handler's shutdown is never called",
    ),
    "test_run.ElasticLaunchTest.test_min_max_nodes_parse": (
        "by design",
        "'2:20:30' raises ValueError (a bad command-line value: exit status 2), where torch raises RuntimeError; "
        "'1' and '2:20' parse as torch's",
    ),
    "test_run.ElasticLaunchTest.test_nproc_gpu_launch_configurations": (
        "internals",
        "mocks torch.cuda/torch.accelerator to report 3 GPUs; elastix counts devices without torch "
        "(none here, so 'auto' is the CPU count)",
    ),
    "test_run.ElasticLaunchTest.test_nproc_xpu_launch_configurations": (
        "internals",
        "mocks torch.xpu/torch.accelerator to report 3 XPUs; as test_nproc_gpu_launch_configurations",
    ),
    # api_test.py: the launcher API end to end
    "api_test.ElasticLaunchTest.test_launch_elastic_agent_raise_exception": (
        "internals",
        _MOCKED_AGENT.format(what=".run to raise") + ": the job runs and succeeds",
    ),
    "api_test.ElasticLaunchTest.test_launch_elastic_worker_raise_exception": (
        "internals",
        "ChildFailedError is raised as expected, but the test wants torch's events.record (mocked) called once",
    ),
    "api_test.ElasticLaunchTest.test_launch_shutdown": (
        "internals",
        _MOCKED_AGENT.format(what=" and torch's rendezvous registry")
        + ": the mocked handler's shutdown is never called",
    ),
    "api_test.ElasticLaunchTest.test_rdzv_handler_shutdown_on_agent_error": (
        "internals",
        _MOCKED_AGENT.format(what=".run to raise RuntimeError") + ": the job runs and succeeds",
    ),
    "api_test.ElasticLaunchTest.test_rdzv_handler_shutdown_on_agent_signal": (
        "internals",
        _MOCKED_AGENT.format(what=".run to raise SignalException") + ": the job runs and succeeds",
    ),
    # test_api.py: launch_agent with a mocked agent
    "test_api.LauncherApiTest.test_launch_agent_default_signals": (
        "internals",
        _MOCKED_AGENT.format(what="") + " (so nothing runs, and launch_agent sets TORCHELASTIC_SIGNALS_TO_HANDLE in "
        "its own environment); elastix runs the job ('dummy_script.py' is missing: ChildFailedError) and gives the "
        "signals to its agent, which sets that variable for the workers only",
    ),
    "test_api.LauncherApiTest.test_launch_agent_sets_signals_env_var": (
        "internals",
        "as test_launch_agent_default_signals",
    ),
    "test_api.LauncherApiTest.test_launch_agent_failing_rdzv_shutdown_does_not_mask_child_failed_error": (
        "internals",
        "ChildFailedError is raised as expected, but the test wants torch's rendezvous handler (mocked) shut down; "
        "torch 2.15 fails it too (its ChildFailedError refuses empty failures)",
    ),
    # shutdown_timeout_test.py: LaunchConfig.shutdown_timeout
    "shutdown_timeout_test.ShutdownTimeoutTest.test_simple_elastic_agent_receives_shutdown_timeout": (
        "internals",
        "constructs torch's SimpleElasticAgent",
    ),
    "shutdown_timeout_test.ShutdownTimeoutTest.test_simple_elastic_agent_default_shutdown_timeout": (
        "internals",
        "constructs torch's SimpleElasticAgent",
    ),
    "shutdown_timeout_test.ShutdownTimeoutTest.test_local_elastic_agent_receives_shutdown_timeout": (
        "internals",
        "constructs torch's LocalElasticAgent",
    ),
    "shutdown_timeout_test.ShutdownTimeoutTest.test_shutdown_method_receives_correct_timeout": (
        "internals",
        "constructs torch's LocalElasticAgent and calls its _shutdown",
    ),
}


# ---------------------------------------------------------------------------------------------
# finding the tests


def torch_test_dir(explicit: Optional[str] = None) -> Tuple[Optional[str], str]:
    """(torch's test/ directory, how it was found), or (None, why not)."""
    marker = SUITES[0][0]

    def check(path: str, how: str) -> Tuple[Optional[str], str]:
        if os.path.isfile(os.path.join(path, marker)):
            return path, how
        return None, f"{how}: no {marker} under {path}"

    if explicit:
        return check(explicit, "--torch-test-dir")
    from_env = os.environ.get(ENV_VAR)
    if from_env:
        return check(from_env, f"${ENV_VAR}")
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None, "torch is not installed"
    torch_dir = os.path.dirname(spec.origin)
    for root in (torch_dir, os.path.dirname(torch_dir)):
        candidate = os.path.join(root, "test")
        if os.path.isfile(os.path.join(candidate, marker)):
            return candidate, "next to the installed torch"
    return None, (
        f"torch's test/{marker} is not installed (wheels do not ship it; PyPI has no torch sdist): pass "
        f"--torch-test-dir or set ${ENV_VAR} to a copy of torch's test/ directory (with "
        f"{os.path.dirname(marker)}/bin) from the torch source of the installed version"
    )


# ---------------------------------------------------------------------------------------------
# the substitution


class TorchInternalsError(NotImplementedError):
    """Raised by the stand-ins of torch classes that elastix has no counterpart of."""


def _internal_class(name: str) -> type:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise TorchInternalsError(f"{name} is torch's agent implementation; elastix has no such class")

    return type(name, (), {"__init__": refuse, "__module__": __name__})


class _StandIn(types.ModuleType):
    """A module whose listed names are replaced. Its submodules that have stand-ins are those;
    other names come from the real module unless ``strict``, where they are AttributeErrors."""

    def __init__(self, real: types.ModuleType, replaced: Dict[str, Any], strict: bool, children: Dict[str, Any]):
        super().__init__(real.__name__, real.__doc__)
        self.__dict__.update(replaced)
        self.__dict__["_real"] = real
        self.__dict__["_strict"] = strict
        self.__dict__["_children"] = children

    def __getattr__(self, name: str) -> Any:
        children = self.__dict__["_children"]
        if name in children:
            return children[name]
        if self.__dict__["_strict"] and not name.startswith("__"):
            raise AttributeError(f"elastix's stand-in for {self.__name__} has no {name!r}")
        return getattr(self.__dict__["_real"], name)


class _CliExit(SystemExit):
    """``elastix run`` exited with a status other than 0 and 2."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status)
        self.message = message

    def __str__(self) -> str:
        return f"elastix run exited with status {self.code}: {self.message}"


class _StderrTee(io.TextIOBase):
    """Writes through to the stream it wraps and keeps the last lines (for the error message)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.text = ""

    def write(self, s: str) -> int:
        self.text = (self.text + s)[-4000:]
        return self._stream.write(s)

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()


def elastix_run_main(args: Optional[List[str]] = None) -> None:
    """torch.distributed.run.main's contract over ``elastix.cli.run.main``: returns when the job
    succeeded, ValueError for a bad command line or configuration (exit status 2), SystemExit
    with any other status."""
    import elastix.cli.run

    tee = _StderrTee(sys.stderr)
    saved, sys.stderr = sys.stderr, tee
    try:
        elastix.cli.run.main(list(args) if args is not None else None)
        status: Any = 0
    except SystemExit as exit_:
        status = exit_.code
    finally:
        sys.stderr = saved
    if status in (0, None):
        return
    lines = [line for line in tee.text.strip().splitlines() if line.strip()]
    message = next((line for line in reversed(lines) if "error:" in line), lines[-1] if lines else "")
    if status == 2:
        raise ValueError(message.split("error:", 1)[-1].strip() or "elastix run: usage error (exit status 2)")
    raise _CliExit(status, message or "the job failed (the root cause is in the log)")


def _substitutes() -> Dict[str, Tuple[Dict[str, Any], bool]]:
    """{torch module: ({name: elastix's}, strict)}."""
    import elastix
    import elastix.agent.config
    import elastix.agent.launcher
    import elastix.agent.logs_specs
    import elastix.errors

    cli = {"main": elastix_run_main}
    return {
        "torch.distributed.run": (
            dict(cli, parse_min_max_nnodes=elastix.agent.config.parse_nnodes),
            True,
        ),
        "torch.distributed.launcher.api": (
            {
                "LaunchConfig": elastix.agent.launcher.LaunchConfig,
                "elastic_launch": elastix.agent.launcher.elastic_launch,
                "launch_agent": elastix.agent.launcher.launch_agent,
                "_get_entrypoint_name": elastix.agent.launcher.entrypoint_name,
            },
            True,
        ),
        "torch.distributed.elastic.agent.server.api": (
            {
                "RunResult": elastix.RunResult,
                "WorkerState": elastix.WorkerState,
                "WorkerSpec": elastix.WorkerSpec,
                "SimpleElasticAgent": _internal_class("SimpleElasticAgent"),
            },
            True,
        ),
        "torch.distributed.elastic.agent.server.local_elastic_agent": (
            {"LocalElasticAgent": _internal_class("LocalElasticAgent")},
            True,
        ),
        "torch.distributed.elastic.multiprocessing": (
            {"DefaultLogsSpecs": elastix.agent.logs_specs.DefaultLogsSpecs},
            True,
        ),
        "torch.distributed.elastic.multiprocessing.errors": (
            {"ChildFailedError": elastix.ChildFailedError},
            True,
        ),
        "torch.distributed.elastic.multiprocessing.api": (
            {"SignalException": elastix.errors.SignalException},
            True,
        ),
    }


def _stand_ins() -> Dict[str, _StandIn]:
    """A stand-in for every substituted module and for each package above one (``torch``,
    ``torch.distributed``, ...), so that ``import torch.distributed.run as launch`` finds it."""
    table = _substitutes()
    names: Set[str] = set()
    for name in table:
        parts = name.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    made: Dict[str, _StandIn] = {}
    for name in sorted(names, key=lambda n: -n.count(".")):  # children first
        replaced, strict = table.get(name, ({}, False))
        children = {
            child.rsplit(".", 1)[1]: stand_in for child, stand_in in made.items() if child.rsplit(".", 1)[0] == name
        }
        made[name] = _StandIn(importlib.import_module(name), replaced, strict, children)
    return made


def _import_for(stand_ins: Optional[Dict[str, _StandIn]]) -> Any:
    real_import = builtins.__import__

    def test_module_import(name, globals=None, locals=None, fromlist=(), level=0):
        module = real_import(name, globals, locals, fromlist, level)
        if stand_ins is None or level != 0:
            return module
        if not fromlist:
            # `import torch.x.y [as z]` binds `torch` (or reads .x.y off it)
            top = name.split(".", 1)[0]
            return stand_ins.get(top, module)
        return stand_ins.get(name, module)

    return test_module_import


def exec_test_module(module: types.ModuleType, path: str, baseline: bool) -> None:
    """Runs torch's test file as ``module``, importing elastix's names (torch's own when
    ``baseline``)."""
    expecttest_stand_in()
    import torch.testing._internal.common_utils  # noqa: F401  (before the module: it reads sys.argv)

    module.__file__ = path
    module.__dict__["__builtins__"] = dict(vars(builtins), __import__=_import_for(None if baseline else _stand_ins()))
    with open(path, encoding="utf-8") as source:
        code = compile(source.read(), path, "exec")
    exec(code, module.__dict__)


def load_test_module(path: str, name: str, baseline: bool = False) -> types.ModuleType:
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.insert(0, directory)  # workers import the test's functions by the module's name
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec_test_module(module, path, baseline)
    return module


class _SubstitutingFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """In a ``spawn`` child of a test: the test module, imported to unpickle its functions, is
    the substituted one, as in the test's own process."""

    def __init__(self, name: str, path: str, baseline: bool) -> None:
        self.name, self.path, self.baseline = name, path, baseline

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=self.path)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        exec_test_module(module, self.path, self.baseline)


if __name__ == "__mp_main__" and os.environ.get(_CHILD_ENV):  # a spawn child of a test
    _child = json.loads(os.environ[_CHILD_ENV])
    sys.meta_path.insert(0, _SubstitutingFinder(_child["name"], _child["path"], _child["baseline"]))


# ---------------------------------------------------------------------------------------------
# the child: runs one file's tests, reporting to a pipe


class Recorder(RowRecorder):
    """Reports one (id, outcome, first line) per test to the parent."""

    def __init__(self, module: str, report: Any) -> None:
        super().__init__()
        self.module = module
        self.report = report

    def _name(self, test: Any) -> str:
        if isinstance(test, unittest.TestCase):
            return f"{self.module}.{type(test).__name__}.{test._testMethodName}"
        # setUpClass and the like: "setUpClass (module.Class)"
        text = str(test)
        what, _, where = text.partition(" (")
        where = where.rstrip(")")
        return f"{self.module}.{where.rsplit('.', 1)[-1]}.{what}" if where else f"{self.module}.{text}"

    def _send(self, *message: Any) -> None:
        self.report.write(json.dumps(message) + "\n")
        self.report.flush()

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        print(f"\n===== {self._name(test)}", file=sys.stderr, flush=True)
        self._send("start", self._name(test))

    def stopTest(self, test: unittest.TestCase) -> None:
        super().stopTest(test)
        name = self._name(test)
        outcome, detail = self.rows.get(name, ("error", "no outcome recorded"))
        self._send("row", name, outcome, detail)

    def addError(self, test: Any, err: Any) -> None:
        super().addError(test, err)
        if not isinstance(test, unittest.TestCase):  # setUpClass and the like: no stopTest
            self._send("row", self._name(test), "error", self._first_line(err))


def run_child(path: str, name: str, report_fd: int, skip: Set[str], keyword: str, baseline: bool) -> int:
    os.set_inheritable(report_fd, False)  # the tests' own children (workers, etcd) must not hold it open
    report = os.fdopen(report_fd, "w")
    sys.argv = sys.argv[:1]  # torch's test helpers read the command line
    os.environ[_CHILD_ENV] = json.dumps({"name": name, "path": path, "baseline": baseline})
    try:
        module = load_test_module(path, name, baseline)
    except BaseException as err:  # SkipTest, ImportError, anything: it is the file's row
        import traceback

        traceback.print_exc()
        lines = str(err).strip().splitlines()
        report.write(json.dumps(["load_error", f"{type(err).__name__}: {lines[0] if lines else ''}"]) + "\n")
        report.flush()
        return 0
    suite = unittest.TestSuite()
    for cls in test_classes(module):
        for test in unittest.defaultTestLoader.loadTestsFromTestCase(cls):
            test_id = f"{name}.{cls.__name__}.{test._testMethodName}"
            if keyword in test_id and test_id not in skip:
                suite.addTest(test)
    result = Recorder(name, report)
    suite.run(result)
    report.write(json.dumps(["end"]) + "\n")
    report.flush()
    return 0


# ---------------------------------------------------------------------------------------------
# the parent: one child process per file, timeouts, the table


def _proc_stat(pid: int) -> Optional[Tuple[int, int]]:
    """(parent pid, session id) of a process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[3])
    except (OSError, IndexError, ValueError):
        return None


def _processes() -> Iterator[Tuple[int, int, int]]:
    """(pid, parent pid, session id) of every process visible."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat:
                yield int(entry), stat[0], stat[1]


def _kill_tree(root: int, with_root: bool = True) -> int:
    """Kills ``root`` (when ``with_root``), its descendants and what is left in its session (the
    child is a session leader: that is everything the tests started, unless a process made a
    session of its own and lost its parent). Returns how many processes were sent SIGKILL."""
    table = list(_processes())
    doomed = {pid for pid, _, sid in table if sid == root} | {root}
    while True:
        more = {pid for pid, ppid, _ in table if ppid in doomed} - doomed
        if not more:
            break
        doomed |= more
    if not with_root:
        doomed.discard(root)
    killed = 0
    for pid in doomed - {os.getpid()}:
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
    return killed


class _Child:
    """One child process running a file's tests, from which events are read."""

    def __init__(self, argv: List[str], log: Any) -> None:
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [*argv, "--report-fd", str(write_fd)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            pass_fds=(write_fd,),
            start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        os.close(write_fd)
        # read with os.read, not a buffered file: select() cannot see lines already buffered
        self.report = read_fd
        self.pending = b""
        self.selector = selectors.DefaultSelector()
        self.selector.register(read_fd, selectors.EVENT_READ)

    def next_event(self, deadline: float) -> Optional[List[Any]]:
        """The next event; ["eof"] when the child closed its end; None at the deadline."""
        while True:
            if b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                try:
                    return json.loads(line)
                except ValueError:
                    continue
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self.selector.select(timeout=left):
                chunk = os.read(self.report, 65536)
                if not chunk:
                    return ["eof"]
                self.pending += chunk

    def finish(self, kill: bool) -> Tuple[int, int]:
        """(exit status, processes killed): kills the child's tree first when ``kill``, and
        always what the tests left behind in its session."""
        killed = _kill_tree(self.proc.pid) if kill else 0
        try:
            status = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            killed += _kill_tree(self.proc.pid)
            status = self.proc.wait()
        killed += _kill_tree(self.proc.pid, with_root=False)
        self.selector.close()
        os.close(self.report)
        return status, killed


def run_file(
    path: str,
    name: str,
    log_path: str,
    keyword: str,
    baseline: bool,
    per_test_timeout: float,
    deadline: float,
) -> Dict[str, Tuple[str, str]]:
    """The rows of one test file, restarting its process after a test that timed out or killed it."""
    rows: Dict[str, Tuple[str, str]] = {}
    with open(log_path, "ab") as log:
        while True:
            skip_file = os.path.join(os.path.dirname(log_path), f"{name}.skip.json")
            with open(skip_file, "w") as f:
                json.dump(sorted(rows), f)
            argv = [sys.executable, os.path.abspath(__file__), "--child", path, "--module", name]
            argv += ["--skip-file", skip_file, "-k", keyword] + (["--baseline"] if baseline else [])
            log.write(f"\n##### {' '.join(argv)}\n".encode())
            log.flush()
            child = _Child(argv, log)
            current: Optional[str] = None
            started = time.monotonic()
            ended = timed_out = False
            while True:
                limit = min(deadline, started + per_test_timeout) if current else deadline
                event = child.next_event(limit)
                if event is None:
                    timed_out = True
                    break
                if event[0] == "start":
                    current, started = event[1], time.monotonic()
                    print(f"  running {current}", file=sys.stderr, flush=True)
                elif event[0] == "row":
                    rows[event[1]] = (event[2], event[3])
                    current = None if event[1] == current else current
                elif event[0] == "load_error":
                    rows[f"{name} (the file)"] = ("error", event[1])
                    ended = True
                elif event[0] in ("end", "eof"):
                    ended = event[0] == "end" or ended
                    break
            status, killed = child.finish(kill=timed_out)
            if killed:
                log.write(f"\n##### killed {killed} processes left by the tests\n".encode())
            if ended:
                return rows
            if current is not None:
                if timed_out and time.monotonic() >= deadline:
                    rows[current] = ("error", "not finished when the whole run's time limit was reached")
                    return rows
                why = (
                    f"no result after {per_test_timeout:.0f} s" if timed_out else f"its process died (status {status})"
                )
                rows[current] = ("error", why)
                continue  # the next tests, in a new process
            if timed_out:
                rows[f"{name} (the file)"] = ("error", "the whole run's time limit was reached")
            else:
                rows[f"{name} (the file)"] = ("error", f"its process ended without reporting (status {status})")
            return rows


def missing_prerequisite(name: str) -> Optional[str]:
    """What a file needs that is not there, said plainly rather than as the error it would cause."""
    if name == "api_test":
        if shutil.which("etcd") is None and not os.environ.get("TORCHELASTIC_ETCD_BINARY_PATH"):
            return "needs the etcd binary on PATH (torch's EtcdServer starts one)"
        if importlib.util.find_spec("etcd") is None:
            return (
                "needs the python-etcd client, with which torch's EtcdServer waits for etcd (pip install python-etcd)"
            )
    return None


def report(rows: Dict[str, Tuple[str, str]], known: Dict[str, Tuple[str, str]]) -> int:
    """Prints the table and the figures; returns the number of unexpected non-passes."""
    unexpected = print_rows(rows, known)
    print()
    modules = list(dict.fromkeys(name.split(".", 1)[0].split(" ", 1)[0] for name in rows))
    for module in [*modules, "all"]:
        mine = {n: o for n, (o, _) in rows.items() if module == "all" or n.split(".", 1)[0].split(" ", 1)[0] == module}
        outcomes = list(mine.values())
        counts = {o: outcomes.count(o) for o in ("pass", "fail", "error", "skip")}
        listed = sum(1 for n, o in mine.items() if o in ("fail", "error") and n in known)
        print(
            f"{module + ':':<24} {len(mine):>3} tests: {counts['pass']:>3} passed, {counts['skip']:>2} skipped, "
            f"{counts['fail']:>2} failed, {counts['error']:>2} errors ({listed} of them in KNOWN)"
        )
    print(f"{unexpected} not passing and not in KNOWN")
    return unexpected


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--torch-test-dir", help=f"torch's test/ directory (default: ${ENV_VAR})")
    parser.add_argument("-k", dest="keyword", default="", help="run only tests whose module.Class.method has this")
    parser.add_argument("--baseline", action="store_true", help="run the tests on torch's own launcher instead")
    parser.add_argument(
        "--per-test-timeout", type=float, default=PER_TEST_TIMEOUT_S, help="seconds (default: %(default)s)"
    )
    parser.add_argument(
        "--timeout", type=float, default=TOTAL_TIMEOUT_S, help="seconds for the whole run (default: %(default)s)"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the tests' output even when all is as expected")
    # the child's side
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--module", help=argparse.SUPPRESS)
    parser.add_argument("--skip-file", help=argparse.SUPPRESS)
    parser.add_argument("--report-fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        with open(args.skip_file) as f:
            skip = set(json.load(f))
        return run_child(args.child, args.module, args.report_fd, skip, args.keyword, args.baseline)

    if importlib.util.find_spec("torch") is None:
        print("skipped: torch is not installed", file=sys.stderr)
        return 2
    test_dir, how = torch_test_dir(args.torch_test_dir)
    if test_dir is None:
        print(f"skipped: {how}", file=sys.stderr)
        return 2
    print(f"torch's tests: {test_dir} ({how})", file=sys.stderr)
    logs = tempfile.mkdtemp(prefix="elastix-launcher-conformance-")
    deadline = time.monotonic() + args.timeout
    began = time.monotonic()
    rows: Dict[str, Tuple[str, str]] = {}
    for relative, name in SUITES:
        path = os.path.join(test_dir, relative)
        missing = f"not found: {relative}" if not os.path.isfile(path) else missing_prerequisite(name)
        if missing:
            rows[f"{name} (the file)"] = ("error", missing)
            continue
        log_path = os.path.join(logs, f"{name}.log")
        rows.update(run_file(path, name, log_path, args.keyword, args.baseline, args.per_test_timeout, deadline))
    unexpected = report(rows, KNOWN if not args.baseline else {})
    print(f"{time.monotonic() - began:.0f} s")
    if unexpected or args.keep_logs:
        print(f"the tests' output: {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
