"""Errors of ``elastix.rpc``. A remote function's own exception is re-raised as itself (its
type, with the remote traceback attached); these are for what went wrong around it."""

from __future__ import annotations


class RpcError(RuntimeError):
    """An RPC could not be made or answered (torch raises RuntimeError for these)."""


class RpcTimeoutError(RpcError, TimeoutError):
    """No answer in time; the message names the callee. The call may still run there."""


class WorkerGoneError(RpcError, ConnectionError):
    """The callee died or cannot be reached; the message names it. Every call waiting on it
    fails with this as soon as its connection is lost."""


class RemoteError(RpcError):
    """A remote function raised an exception that cannot be re-created here (its class is
    unknown here, or it cannot be pickled); the message has the remote traceback."""


def translate(err: BaseException) -> BaseException:
    """The transport's builtin exceptions as this module's classes (same message)."""
    if isinstance(err, RpcError):
        return err
    if isinstance(err, TimeoutError):
        return RpcTimeoutError(str(err))
    if isinstance(err, ConnectionError):
        return WorkerGoneError(str(err))
    if type(err) is RuntimeError:
        return RpcError(str(err))
    return err


__all__ = ["RpcError", "RpcTimeoutError", "WorkerGoneError", "RemoteError", "translate"]
