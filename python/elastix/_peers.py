"""What the collectives' TCP transport and RPC share to reach their peers: the address this
process is reached at, and a group's key for the round (drawn by rank 0, derived from the job
secret), which every connection proves before it carries anything."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
from typing import Optional

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


def group_key(store, me: int, nonce_key: str, label: bytes) -> bytes:
    """This group's key for this round: rank 0 draws the nonce (at ``nonce_key``), everyone
    reads it (the read waits for it, as the address reads do). ``label`` keeps the keys of
    different uses of one nonce apart (collectives, RPC)."""
    secret = load_secret()  # first: a bad secret file fails here, before anyone waits
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
    if secret is None:
        return nonce
    return hmac.new(secret, label + nonce, hashlib.sha256).digest()
