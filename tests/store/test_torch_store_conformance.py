"""PyTorch's own store tests (its test/distributed/test_store.py) against elastix's stores.

torch's test file is not in this repository: point $ELASTIX_TORCH_TEST_STORE at a copy from the
torch source of the installed version (see tests/store/torch_store_conformance.py). Skipped when torch
or the file is absent. Passes when every test that does not pass is one listed in KNOWN."""

import os
import subprocess
import sys

import pytest

import torch_gate

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch_store_conformance as conformance  # noqa: E402

pytestmark = pytest.mark.torch
torch_gate.need()


def test_torch_store_tests_pass_with_elastix_stores():
    path, how = conformance.torch_test_file()
    if path is None:
        pytest.skip(how)
    # a process of its own: the tests create process groups and set environment variables
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "torch_store_conformance.py"), "--torch-test-file", path],
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
