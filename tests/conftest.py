import os
import socket
import subprocess
import sys
from datetime import timedelta

import pytest

import elastix

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def master():
    """A master TCPStore on a free port, with a short timeout so failures do not hang."""
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    yield store


@pytest.fixture
def client(master):
    return elastix.TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=10))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(code: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, **kwargs)
