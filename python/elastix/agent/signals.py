"""Signal names for ``--signals-to-handle``."""

from __future__ import annotations

import signal
from typing import List, Sequence, Union

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
# A process cannot catch these, or must not (the agent waits on its children).
_UNHANDLEABLE = {"SIGKILL", "SIGSTOP", "SIGCHLD"}


def parse_signals(spec: Union[str, Sequence[str]]) -> List[str]:
    """``"SIGTERM,usr1"`` -> ["SIGTERM", "SIGUSR1"]. A name this system does not know is an
    error, as ``--help`` says: torchrun skips it with a warning, so a typo (SIGUSR3) would
    silently leave a preemption signal unforwarded."""
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
            raise ValueError(
                f"--signals-to-handle: {text!r} is not a signal of this system (names as `kill -l` lists them: "
                "SIGTERM, SIGUSR1, ...)"
            )
        name = value.name  # the canonical name of an alias (SIGIOT -> SIGABRT)
        if name in _UNHANDLEABLE:
            raise ValueError(f"--signals-to-handle: {name} cannot be handled")
        if name not in names:
            names.append(name)
    return names
