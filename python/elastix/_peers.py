"""What the collectives' TCP transport and RPC share to reach their peers: the address this
process is reached at, and a group's key for the round (drawn by rank 0, derived from the job
secret), which every connection proves before it carries anything."""

from __future__ import annotations

import os
import resource
import secrets
import socket
from typing import Optional

from . import _core
from ._auth import load_secret

NONCE_BYTES = 32


class MalformedNonce(ValueError):
    """The group's store holds something else where the nonce should be."""


def local_address(override_env: str = "ELASTIX_COLLECTIVES_ADDR", towards: Optional[str] = None) -> str:
    """The address peers reach this process at: the variable ``override_env``, else the source
    address of the route to ``towards`` (default MASTER_ADDR), else this host's name."""
    override = os.environ.get(override_env)
    if override:
        return override
    target = towards or os.environ.get("MASTER_ADDR")
    if target:
        try:
            family = socket.AF_INET6 if ":" in target else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostname()


def raise_open_file_limit() -> None:
    """Raises the soft open-file limit to the hard one: every connection, a stranger's too, is a
    descriptor, and a default soft limit of 1024 would run out before the listeners' limits on
    unproven connections. (Workers under ``elastix run`` inherit the agent's raised limit.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass  # a hard limit of "unlimited" may exceed what the kernel takes: keep the soft one


def group_key(store, me: int, nonce_key: str, label: bytes) -> _core.PeerKey:
    """This group's key for this round: rank 0 draws the nonce (at ``nonce_key``), everyone
    reads it (the read waits for it, as the address reads do). ``label`` keeps the keys of
    different uses of one nonce apart (collectives, RPC). Derived from the job secret in the
    core; without a secret the nonce itself is the key (as private as the store)."""
    secret = load_secret()  # first: a bad secret file fails here, before anyone waits
    raise_open_file_limit()
    if me == 0:
        store.set(nonce_key, secrets.token_bytes(NONCE_BYTES).hex())
    try:
        nonce = bytes.fromhex(store.get(nonce_key).decode())
    except ValueError:
        nonce = b""
    if len(nonce) != NONCE_BYTES:
        raise MalformedNonce(
            f"the group's store holds a malformed {nonce_key}; the store is shared with something else"
        )
    return _core.group_key(secret, label, nonce)
