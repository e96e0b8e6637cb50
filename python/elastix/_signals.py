"""Signal names for ``--signals-to-handle``."""

from __future__ import annotations

import signal
import warnings
from typing import Callable, List, Optional, Sequence, Union

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
# A process cannot catch these, or must not (the agent waits on its children).
_UNHANDLEABLE = {"SIGKILL", "SIGSTOP", "SIGCHLD"}


def parse_signals(spec: Union[str, Sequence[str]], warn: Optional[Callable[[str], None]] = None) -> List[str]:
    """``"SIGTERM,usr1"`` -> ["SIGTERM", "SIGUSR1"]. An unknown name is skipped with a warning,
    as torchrun does (a signal one platform lacks must not stop a launch script shared with
    another); a signal that cannot be handled is an error."""
    say = warn or (lambda message: warnings.warn(message, stacklevel=3))
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names: List[str] = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        name = text.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        value = getattr(signal.Signals, name, None) if name.isidentifier() else None
        if not isinstance(value, signal.Signals):
            say(f"--signals-to-handle: unknown signal {text!r} ignored (use names such as SIGTERM, SIGUSR1)")
            continue
        name = value.name  # the canonical name of an alias (SIGIOT -> SIGABRT)
        if name in _UNHANDLEABLE:
            raise ValueError(f"--signals-to-handle: {name} cannot be handled")
        if name not in names:
            names.append(name)
    return names
