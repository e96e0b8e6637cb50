"""The ``elastix`` command."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="elastix",
        description="A fast, PyTorch-free elastic launcher and store.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser(
        "store",
        help="serve a TCPStore-compatible key-value store (same as elastix-store)",
        add_help=False,
    )
    args, rest = parser.parse_known_args(argv)
    if args.version:
        from . import __version__

        print(f"elastix {__version__}")
        return
    if args.command == "store":
        from . import store_cli

        sys.argv = ["elastix-store", *rest]
        store_cli.main()
        return
    parser.print_help()
    sys.exit(2)


if __name__ == "__main__":
    main()
