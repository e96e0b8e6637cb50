"""Where the peer, torch, is: this interpreter, or the one $TORCH_PYTHON names (torch is large:
a venv of its own keeps it out of the environment under test)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional


def torch_python() -> Optional[str]:
    """An interpreter that can run torchrun (`python -m torch.distributed.run`), or None."""
    for python in [sys.executable, os.environ.get("TORCH_PYTHON")]:
        if not python:
            continue
        probe = subprocess.run([python, "-c", "import torch.distributed.run"], capture_output=True)
        if probe.returncode == 0:
            return python
    return None
