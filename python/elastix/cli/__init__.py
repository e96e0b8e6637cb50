"""The ``elastix`` command line, one module per subcommand: ``elastix run`` (torchrun's
launcher), ``elastix store`` (the standalone store server, same as ``elastix-store``),
``elastix status`` (a job's state), ``elastix dump`` (its workers' stacks), ``elastix timeline``
(a run's event logs as a page), ``elastix secret`` (a new job secret) and ``--version``."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

COMMANDS = {
    "run": "launch workers on this node (torchrun's flags; `elastix run --help`)",
    "store": "serve a TCPStore-compatible key-value store (same as elastix-store)",
    "status": "show a job's state from its rendezvous store (`elastix status --help`)",
    "dump": "show the stacks of a running job's workers (`elastix dump --help`)",
    "timeline": "draw a run's event logs as one HTML page (`elastix timeline --help`)",
    "secret": "write a new strong job secret to a file only you can read (`elastix secret FILE`)",
}


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # a subcommand owns everything after its name: `run` passes the program's own arguments
    # through untouched, which a top-level parser would try to interpret
    if argv[:1] == ["run"]:
        from . import run

        run.main(argv[1:], prog="elastix run")
        return
    if argv[:1] == ["status"]:
        from . import status

        status.main(argv[1:], prog="elastix status")
        return
    if argv[:1] == ["dump"]:
        from . import dump

        dump.main(argv[1:], prog="elastix dump")
        return
    if argv[:1] == ["timeline"]:
        from . import timeline

        timeline.main(argv[1:], prog="elastix timeline")
        return
    if argv[:1] == ["secret"]:
        from . import secret

        secret.main(argv[1:], prog="elastix secret")
        return
    if argv[:1] == ["store"]:
        from . import store

        sys.argv = ["elastix-store", *argv[1:]]
        store.main()
        return
    if argv and argv[0] not in ("-h", "--help", "--version"):
        _not_a_command(argv)
    parser = argparse.ArgumentParser(
        prog="elastix",
        description="A fast, PyTorch-free elastic launcher and store.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {name:<10}{text}" for name, text in COMMANDS.items()),
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), metavar="COMMAND")
    args = parser.parse_args(argv)
    if args.version:
        from .. import __version__

        print(f"elastix {__version__}")
        return
    parser.print_help()
    sys.exit(2)


def _not_a_command(argv: List[str]) -> None:
    """Exits 2 with a suggestion: run's flags or a script without `run` (the word forgotten, as
    in `elastix --standalone train.py`), or a misspelt command."""
    import difflib
    import shlex

    first = argv[0]
    close = difflib.get_close_matches(first, COMMANDS, n=1)
    if close:
        hint = f"did you mean `elastix {close[0]}`?"
    elif first.startswith("-") or first.endswith(".py"):
        hint = f"did you mean `elastix run {shlex.join(argv)}`?"
    else:
        hint = f"choose from {', '.join(COMMANDS)}"
    print(f"elastix: error: {first!r} is not a command: {hint}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
