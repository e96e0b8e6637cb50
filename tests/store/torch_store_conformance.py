"""Runs PyTorch's own store tests (torch's ``test/distributed/test_store.py``) against
elastix's stores, and prints one row per test: name, outcome, first line of the error.

    python tests/store/torch_store_conformance.py [--torch-test-file PATH] [-k SUBSTRING] [--no-rendezvous-patch]

torch's test file is not part of this repository, and nothing is downloaded: it is taken from
``--torch-test-file``, else from ``$ELASTIX_TORCH_TEST_STORE``, else from next to the installed
torch (a source checkout installed in place has it at ``<checkout>/test/distributed/``; wheels
do not ship it). Use the file from the torch version installed: its helpers
(``torch.testing._internal``) come from that torch. Exit status: 0 when every test that does
not pass is listed in ``KNOWN`` below, 1 otherwise, 2 when torch or the test file is missing.

How the substitution works, without touching torch: the test module is executed with its own
``__import__``, so that the names it imports see elastix's classes:

* ``dist`` (its ``import torch.distributed as dist``) is a stand-in module whose ``TCPStore``,
  ``PrefixStore``, ``HashStore``, ``FileStore`` and ``Store`` are elastix's; every other name
  (``rendezvous``, ``init_process_group``, ``DistStoreError``, ``QueueEmptyError`` ...) is
  torch's own, so torch's exception classes are what the tests expect elastix to raise;
* ``create_tcp_store`` (imported from ``torch.testing._internal.common_distributed``, where it
  builds torch's TCPStore) makes an elastix TCPStore the same way (a free port, the same
  arguments); the classes the module defines at import (``MyPythonStore``, ``DummyStore``,
  ``TestMultiThreadedWait``'s stores) are thereby elastix-based too.

The rendezvous tests call ``dist.rendezvous``, which builds its stores in
``torch.distributed.rendezvous`` from that module's own ``TCPStore``/``FileStore``; so that they
test elastix's stores too, those two names are replaced there while the tests run and put back
afterwards (``--no-rendezvous-patch`` leaves torch alone; those tests then exercise torch's
stores).
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import importlib.util
import os
import signal
import sys
import types
import unittest
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: run as a script too
from conformance_rows import RowRecorder, expecttest_stand_in, print_rows, test_classes

ENV_VAR = "ELASTIX_TORCH_TEST_STORE"
TEST_TIMEOUT_S = 90  # per test; torch's own waits are at most 10 s

# Tests that do not pass with elastix's classes, by id, with (kind, reason):
#   "internals": depends on torch internals that a store implementation cannot provide;
#   "elastix":   a difference in elastix's behaviour (a bug to fix, then drop it from here).
# Measured with torch 2.15.0's helpers and torch's test_store.py of the pytorch/pytorch commit
# f34fa1515024423a239ce26f33a8b65ea9252502 (the closest version at hand to v2.15.0).
_REPR = (
    "torch's repr shows its C++ SocketImpl (fd, [host]:port); elastix's shows addr/remote only "
    "(torch fails this test too where localhost does not reverse-resolve: [::ffff:127.0.0.1])"
)
KNOWN: Dict[str, Tuple[str, str]] = {
    "PythonStoreTest.test_set_get": (
        "internals",
        "torch.distributed._test_python_store is a C++ test hook that takes torch's C++ Store; "
        "a Python subclass of elastix.Store is not one",
    ),
    "InitPgWithNonUvStore.test_with_env_var": (
        "internals",
        "init_process_group wraps the store in torch's own C++ PrefixStore, which the test unwraps "
        "with isinstance(store, dist.PrefixStore), here elastix's class",
    ),
    "InitPgWithNonUvStore.test_with_url_param": ("internals", "as test_with_env_var"),
    "TCPStoreTest.test_repr": ("elastix", _REPR),
    "LibUvTCPStoreTest.test_repr": ("elastix", _REPR),
}


def torch_test_file(explicit: Optional[str] = None) -> Tuple[Optional[str], str]:
    """(path, how it was found) of torch's test_store.py, or (None, why not)."""
    if explicit:
        return (explicit, "--torch-test-file") if os.path.isfile(explicit) else (None, f"no file at {explicit}")
    from_env = os.environ.get(ENV_VAR)
    if from_env:
        return (from_env, f"${ENV_VAR}") if os.path.isfile(from_env) else (None, f"${ENV_VAR}: no file at {from_env}")
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None, "torch is not installed"
    torch_dir = os.path.dirname(spec.origin)
    for root in (torch_dir, os.path.dirname(torch_dir)):
        candidate = os.path.join(root, "test", "distributed", "test_store.py")
        if os.path.isfile(candidate):
            return candidate, "next to the installed torch"
    return None, (
        f"torch's test/distributed/test_store.py is not installed (wheels do not ship it): "
        f"pass --torch-test-file or set ${ENV_VAR} to a copy from the torch source of the installed version"
    )


class _StandIn(types.ModuleType):
    """A module with some names replaced; the others are the real module's."""

    def __init__(self, real: types.ModuleType, **replaced: Any) -> None:
        super().__init__(real.__name__, real.__doc__)
        self.__dict__.update(replaced)
        self.__dict__["_real"] = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_real"], name)


def _elastix_names() -> Dict[str, Any]:
    import elastix

    return {name: getattr(elastix, name) for name in ("TCPStore", "PrefixStore", "HashStore", "FileStore", "Store")}


def _create_tcp_store_with_elastix(common_utils: types.ModuleType) -> Any:
    import elastix

    def create_tcp_store(
        addr="localhost",
        world_size=1,
        is_master=True,
        timeout=timedelta(minutes=5),
        wait_for_workers=True,
        jit_class=False,
        use_libuv=True,
    ):
        """torch's helper, making an elastix TCPStore: a master on a free port. Like torch's,
        it leaves ``timeout`` to the store's default."""
        if jit_class:
            raise unittest.SkipTest("a TorchScript store class (torch.classes.dist_c10d) is torch's own")
        port = common_utils.find_free_port()
        return elastix.TCPStore(
            addr, port, world_size, is_master, wait_for_workers=wait_for_workers, use_libuv=use_libuv
        )

    return create_tcp_store


def load_test_module(path: str, name: str = "torch_test_store", substitute: bool = True) -> types.ModuleType:
    """torch's test module, executed with elastix's stores in place of torch's (with torch's
    own when ``substitute`` is false: the baseline)."""
    expecttest_stand_in()
    import torch
    import torch.distributed
    import torch.testing._internal.common_distributed as common_distributed
    import torch.testing._internal.common_utils as common_utils

    dist = _StandIn(torch.distributed, **_elastix_names())
    torch_stand_in = _StandIn(torch, distributed=dist)
    common_distributed_stand_in = _StandIn(
        common_distributed, create_tcp_store=_create_tcp_store_with_elastix(common_utils)
    )
    real_import = builtins.__import__

    def test_module_import(name, globals=None, locals=None, fromlist=(), level=0):
        module = real_import(name, globals, locals, fromlist, level)
        if level != 0 or not substitute:
            return module
        if not fromlist and (name == "torch.distributed" or name.startswith("torch.distributed.")):
            return torch_stand_in  # `import torch.distributed[.x] as y` reads .distributed[.x] on it
        if fromlist and name == "torch.distributed":
            return dist
        if fromlist and name == "torch.testing._internal.common_distributed":
            return common_distributed_stand_in
        return module

    module = types.ModuleType(name)
    module.__file__ = path
    module.__dict__["__builtins__"] = dict(vars(builtins), __import__=test_module_import)
    with open(path, encoding="utf-8") as source:
        code = compile(source.read(), path, "exec")
    sys.modules[name] = module
    exec(code, module.__dict__)
    return module


@contextlib.contextmanager
def rendezvous_uses_elastix(enabled: bool = True) -> Iterator[None]:
    """torch.distributed.rendezvous's handlers build elastix stores while the block runs."""
    if not enabled:
        yield
        return
    import importlib

    # (the package's `rendezvous` attribute is the function, not this module)
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    names = _elastix_names()
    saved = {name: getattr(rendezvous, name) for name in ("TCPStore", "FileStore")}
    for name in saved:
        setattr(rendezvous, name, names[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(rendezvous, name, value)


class _TestTimeout(Exception):
    pass


class Recorder(RowRecorder):
    """Keeps one row per test, each test bounded by an alarm."""

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        print(f"  running {self._name(test)}", file=sys.stderr, flush=True)

        def expired(signum: int, frame: Any) -> None:
            raise _TestTimeout(f"no result after {TEST_TIMEOUT_S} s")

        signal.signal(signal.SIGALRM, expired)
        signal.alarm(TEST_TIMEOUT_S)

    def stopTest(self, test: unittest.TestCase) -> None:
        signal.alarm(0)
        import torch.distributed

        if torch.distributed.is_initialized():  # a test that failed before destroying its group
            torch.distributed.destroy_process_group()
        super().stopTest(test)


def run(
    path: str, keyword: str = "", patch_rendezvous: bool = True, baseline: bool = False
) -> Dict[str, Tuple[str, str]]:
    module = load_test_module(path, substitute=not baseline)
    suite = unittest.TestSuite()
    for cls in test_classes(module):
        for test in unittest.defaultTestLoader.loadTestsFromTestCase(cls):
            if keyword in f"{cls.__name__}.{test._testMethodName}":
                suite.addTest(test)
    result = Recorder()
    with rendezvous_uses_elastix(patch_rendezvous and not baseline):
        suite.run(result)
    return result.rows


def report(rows: Dict[str, Tuple[str, str]], known: Dict[str, Tuple[str, str]]) -> int:
    """Prints the table and a summary; returns the number of unexpected non-passes."""
    unexpected = print_rows(rows, known)
    counts = {
        outcome: sum(1 for o, _ in rows.values() if o == outcome) for outcome in ("pass", "fail", "error", "skip")
    }
    print(
        f"\n{len(rows)} tests: {counts['pass']} passed, {counts['fail']} failed, {counts['error']} errors, "
        f"{counts['skip']} skipped; {unexpected} not passing and not known"
    )
    return unexpected


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-test-file", help=f"torch's test/distributed/test_store.py (default: ${ENV_VAR})")
    parser.add_argument("-k", dest="keyword", default="", help="run only tests whose Class.method contains this")
    parser.add_argument("--no-rendezvous-patch", action="store_true", help="leave torch.distributed.rendezvous alone")
    parser.add_argument("--baseline", action="store_true", help="run the tests on torch's own stores instead")
    args = parser.parse_args(argv)
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        print("skipped: torch is not installed", file=sys.stderr)
        return 2
    path, how = torch_test_file(args.torch_test_file)
    if path is None:
        print(f"skipped: {how}", file=sys.stderr)
        return 2
    print(f"torch's tests: {path} ({how})", file=sys.stderr)
    sys.argv = sys.argv[:1]  # torch's test helpers read the command line
    rows = run(path, args.keyword, patch_rendezvous=not args.no_rendezvous_patch, baseline=args.baseline)
    unexpected = report(rows, KNOWN if not args.baseline else {})
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
