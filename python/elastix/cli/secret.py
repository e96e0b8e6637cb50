"""``elastix secret FILE``: writes a strong job secret (32 random bytes, in hex) to a new file
that only its owner may read, for ``ELASTIX_AUTH_TOKEN_FILE`` or ``--rdzv-conf auth_token_file``.
It never overwrites a file and refuses places the loader would refuse (a directory everyone may
write to, a symbolic link). The secret is not printed."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None, prog: str = "elastix secret") -> None:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write a new strong job secret to FILE (mode 0600); copy it to every node of the job and "
        "point each at it with ELASTIX_AUTH_TOKEN_FILE=FILE.",
    )
    parser.add_argument("file", metavar="FILE", help="where to write it (must not exist)")
    args = parser.parse_args(argv)
    from .._auth import write_secret

    try:
        write_secret(args.file)
    except ValueError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote a new job secret to {args.file} (mode 0600); give every node ELASTIX_AUTH_TOKEN_FILE={args.file}")
