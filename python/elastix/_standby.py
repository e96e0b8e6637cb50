"""The bootstrap of a warm standby worker (see rust/core/src/agent/standby.rs).

The agent starts ``python -u <this file>`` ahead of a restart. The interpreter
starts up, then blocks reading fd 3; on activation it receives the worker's arguments (what
follows the interpreter on a cold start's command line: ``-u script.py ...`` or
``-u -m module ...``) and its environment variables, and runs the program as ``__main__``
just as that command line would. EOF with nothing read means the agent no longer needs it.

Before activation it imports only ``json`` and ``runpy`` (standard library, no side
effects), so the worker finds the interpreter much as a cold start would leave it. Only the
forms the launcher builds are accepted (``standby_command`` decides when a standby may stand
in for a worker). One difference stays visible from outside: /proc/<pid>/environ shows the
environment the standby started with; the worker's code and its children see the worker's.
"""

import os
import sys

ACTIVATION_FD = 3


def standby_command(python: str, args: "list[str]") -> "list[str] | None":
    """The standby command for workers started as ``python *args``, or None when a standby
    cannot reproduce that command line (other interpreter options than ``-u``)."""
    if len(args) >= 2 and args[0] == "-u" and ((args[1] == "-m" and len(args) >= 3) or not args[1].startswith("-")):
        return [python, "-u", os.path.abspath(__file__)]
    return None


def read_activation() -> "bytes":
    chunks = []
    while True:
        chunk = os.read(ACTIVATION_FD, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(ACTIVATION_FD)
    return b"".join(chunks)


def run(args: "list[str]") -> None:
    """Runs ``-u script args...`` or ``-u -m module args...`` as the interpreter would, down to
    what the program can see: ``sys.argv``, ``sys.orig_argv``, ``sys.path[0]``, ``__file__``."""
    import runpy

    # what a cold start's interpreter would have been given
    sys.orig_argv = [sys.orig_argv[0] if sys.orig_argv else sys.executable, *args]
    args = args[1:]  # -u: this interpreter is unbuffered already
    if args[0] == "-m":
        sys.argv = args[1:]  # runpy puts the module's path in argv[0]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(args)  # argv[0] as typed
    sys.path.insert(0, os.path.dirname(os.path.realpath(args[0])))
    if os.path.isfile(args[0]):
        run_script(os.path.abspath(args[0]))
    else:  # a directory or zip file with a __main__.py
        runpy.run_path(args[0], run_name="__main__")


def run_script(path: str) -> None:
    """Runs the script at ``path`` as ``__main__``, as the interpreter runs one named on its
    command line: ``__file__`` and the code's file name are absolute (Python 3.9+), while
    ``sys.argv[0]`` stays as typed (``runpy.run_path`` would change it)."""
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__cached__ = None  # type: ignore[attr-defined]
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__spec__ = None
    sys.modules["__main__"] = main
    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def main() -> None:
    import json  # loaded while idle rather than after the activation
    import runpy  # noqa: F401

    message = read_activation()
    if not message:
        sys.exit(0)
    activation = json.loads(message)
    os.environ.update(activation["env"])
    try:
        run(activation["args"])
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:
        # the traceback a cold start would print: from the program's frames on
        tb = error.__traceback__
        while tb is not None and _is_bootstrap(tb.tb_frame):
            tb = tb.tb_next
        # the interpreter's hook prints the exception's own traceback, not the one given
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        sys.exit(1)


def _is_bootstrap(frame) -> bool:
    return frame.f_code.co_filename == __file__ or frame.f_globals.get("__name__") == "runpy"


if __name__ == "__main__":
    # this package's directory is no place to import from, neither for the bootstrap nor for
    # the program (run() puts the program's own entry first)
    sys.path.pop(0)
    main()
