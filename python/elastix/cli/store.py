"""The ``elastix-store`` console script: the Rust server's command line, run in-process."""

import signal
import sys


def main() -> None:
    from .. import _core

    # The Rust side handles SIGINT/SIGTERM itself; Python's SIGINT handler would otherwise
    # turn the same Ctrl-C into a KeyboardInterrupt after a clean stop.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(_core.run_store_cli(["elastix-store", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
