"""What travels: pickle protocol 5, with array data as out-of-band buffers (sent from the
array's own memory, received into memory the unpickled array then owns), RRefs as forks
(see ``rref.py``), and exceptions with their remote traceback.

Pickling happens in the calling thread and unpickling in the thread that gets the message,
so the RRef fork context is thread-local: the forks made while pickling one message (undone
if it is never sent), and the worker a message being unpickled came from.
"""

from __future__ import annotations

import importlib
import pickle
import threading
import traceback
from typing import Any, List, Optional, Sequence, Tuple

from .errors import RemoteError

OP_CALL, OP_REMOTE, OP_TO_HERE = 1, 2, 3
STATUS_OK, STATUS_ERROR, STATUS_REFUSED = 0, 1, 2

# (owner rank, rref id, fork id): one fork made while pickling
ForkData = Tuple[int, Tuple[int, int], Tuple[int, int]]

_context = threading.local()


def dumps(obj: Any) -> Tuple[bytes, List[memoryview], List[ForkData]]:
    """(payload, out-of-band buffers, forks made): the forks are for the caller to undo if the
    message is never delivered."""
    buffers: List[pickle.PickleBuffer] = []
    forks: List[ForkData] = []
    outer = getattr(_context, "forks", None)
    _context.forks = forks
    try:
        payload = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    finally:
        _context.forks = outer
    return payload, [buffer.raw() for buffer in buffers], forks


def forks_being_made() -> Optional[List[ForkData]]:
    """Where RRef.__reduce__ notes its fork; None outside an RPC message."""
    return getattr(_context, "forks", None)


def loads(payload: bytes, buffers: Sequence[Any], sender: int, receiver: Any) -> Any:
    """Unpickles a message that ``receiver`` (the RPC agent) got from rank ``sender``."""
    outer = getattr(_context, "received", None)
    _context.received = (sender, receiver)
    try:
        return pickle.loads(payload, buffers=buffers)
    finally:
        _context.received = outer


def message_origin() -> Optional[Tuple[int, Any]]:
    """(sender rank, receiving agent) of the message being unpickled; None outside one."""
    return getattr(_context, "received", None)


def dump_error(err: BaseException, where: str) -> bytes:
    """The exception itself when it pickles, else its class's name and its text; with the
    formatted remote traceback either way."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    try:
        return pickle.dumps((err, text, where), protocol=5)
    except Exception:
        cls = type(err)
        return pickle.dumps((None, text, where, cls.__module__, cls.__qualname__, str(err)), protocol=5)


def _class(module: str, qualname: str) -> Optional[type]:
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:
        return None
    return found if isinstance(found, type) and issubclass(found, BaseException) else None


def load_error(payload: bytes) -> BaseException:
    """The remote exception, as its own class where possible, with ``remote_traceback`` set
    and the traceback added as a note (shown under the local traceback)."""
    try:
        parts = pickle.loads(payload)
    except Exception as bad:
        return RemoteError(f"the remote function raised an exception that cannot be unpickled here: {bad!r}")
    err: Optional[BaseException] = parts[0]
    text, where = parts[1], parts[2]
    if err is None:
        module, qualname, message = parts[3:]
        cls = _class(module, qualname)
        try:
            err = cls(message) if cls is not None else None
        except Exception:
            err = None
    if err is None:
        err = RemoteError(f"{module}.{qualname}: {message}\n\nRemote traceback ({where}):\n{text}")
    # set on whatever class the remote raised (a user's own too), which declares no such attribute
    err.remote_traceback = text  # type: ignore[attr-defined]
    add_note = getattr(err, "add_note", None)
    if add_note is not None:  # Python 3.11+
        add_note(f"\nRemote traceback ({where}):\n{text.rstrip()}")
    return err


__all__ = [
    "OP_CALL",
    "OP_REMOTE",
    "OP_TO_HERE",
    "STATUS_OK",
    "STATUS_ERROR",
    "STATUS_REFUSED",
    "dumps",
    "loads",
    "dump_error",
    "load_error",
    "forks_being_made",
    "message_origin",
]
