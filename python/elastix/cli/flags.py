"""Command-line flags as data. Each command (``run``, ``status``, ``dump``) lists its flags in a
table of groups; a flag several commands share (the ``--rdzv-*`` ones) is defined here once, and
a command changes only what differs for it (its help, its default) with :meth:`Flag.but`.

A flag's action is :class:`~elastix.cli.envargs.EnvOption` unless it says otherwise, so every
option can also come from ``ELASTIX_<NAME>`` or torchrun's ``PET_<NAME>``; ``action=None`` is a
plain argparse option (no environment)."""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .envargs import EnvOption


class Flag:
    """One option: its names (the dashed one first, then aliases) and argparse's settings."""

    def __init__(self, *names: str, **settings: Any) -> None:
        self.names: Tuple[str, ...] = names
        self.settings: Dict[str, Any] = {"action": EnvOption, **settings}

    def but(self, **changes: Any) -> "Flag":
        """The same flag with some settings changed (another command's help or default)."""
        return Flag(*self.names, **{**self.settings, **changes})

    def add_to(self, parser: Any) -> None:
        settings = dict(self.settings)
        if settings["action"] is None:
            del settings["action"]
        parser.add_argument(*self.names, **settings)


class Group:
    """A titled group of flags in ``--help``: ``Group(title, [flags])`` or
    ``Group(title, description, [flags])``."""

    def __init__(self, title: str, *rest: Any) -> None:
        self.title = title
        self.description: Optional[str] = rest[0] if len(rest) == 2 else None
        self.flags: List[Flag] = list(rest[-1])


def add_groups(parser: argparse.ArgumentParser, groups: Sequence[Group]) -> None:
    for group in groups:
        section = parser.add_argument_group(group.title, group.description)
        for flag in group.flags:
            flag.add_to(section)


# -- the rendezvous: how `run` joins a job, and how `status` and `dump` find it --------------

RDZV_BACKEND = Flag(
    "--rdzv-backend",
    "--rdzv_backend",
    type=str,
    default="c10d",
    metavar="BACKEND",
    help="c10d (default) or etcd (the job's etcd endpoints as --rdzv-endpoint)",
)
RDZV_ENDPOINT = Flag(
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    type=str,
    default="",
    metavar="HOST[:PORT][,...]",
    help="the job's rendezvous store, as given to `elastix run`",
)
RDZV_ID = Flag("--rdzv-id", "--rdzv_id", type=str, default="none", metavar="ID", help="the job's run ID")
RDZV_CONF = Flag(
    "--rdzv-conf",
    "--rdzv_conf",
    type=str,
    default="",
    metavar="K=V,...",
    help="the job's rendezvous settings, as given to `elastix run` (auth_token_file is used; on etcd "
    "also protocol, cacert, cert, key and key_prefix)",
)

__all__ = ["Flag", "Group", "add_groups", "RDZV_BACKEND", "RDZV_ENDPOINT", "RDZV_ID", "RDZV_CONF"]
