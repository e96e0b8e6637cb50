"""Tests that need torch, and the CI stage that runs them.

The main test run is torch-free, as most users' environments are: there the tests marked
``torch`` are deselected, with one line saying so, rather than reported as skipped. The torch
stage (``.ci/torch-tests``: a virtual environment with torch beside the main one) runs exactly
those, with ``ELASTIX_REQUIRE_TORCH=1``, where torch missing is a failure, never a skip.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

import pytest

REQUIRE_VAR = "ELASTIX_REQUIRE_TORCH"
MARKER = "torch"


def required() -> bool:
    return os.environ.get(REQUIRE_VAR) == "1"


def available() -> bool:
    return importlib.util.find_spec("torch") is not None


class _Missing:
    """Stands for a torch module where torch is missing; its tests are deselected, so nothing
    reads it, but a test that forgot its marker skips instead of failing on an import."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # what collection looks for (__test__, __call__ ...)
            raise AttributeError(attr)
        pytest.skip(f"needs {self._name} (mark the test `torch`)")


def need(name: str = "torch.distributed") -> Any:
    """The module `name`, for a test marked ``torch``: imported where torch is (a broken install
    fails the test), a stand-in where it is not and the torch stage is not running."""
    if required() or available():
        return importlib.import_module(name)
    return _Missing(name)


def configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: needs torch; CI runs these in its torch stage (.ci/torch-tests)")


def deselect_without_torch(config: pytest.Config, items: list) -> None:
    """Where torch is missing (and not required), the torch tests leave the run, said once."""
    if required() or available():
        return
    needing = [item for item in items if item.get_closest_marker(MARKER)]
    if not needing:
        return
    config.hook.pytest_deselected(items=needing)
    items[:] = [item for item in items if not item.get_closest_marker(MARKER)]
    config._elastix_torch_deselected = len(needing)  # type: ignore[attr-defined]


def report(terminalreporter: Any, config: pytest.Config) -> None:
    count = getattr(config, "_elastix_torch_deselected", 0)
    if count:
        terminalreporter.write_line(
            f"{count} test(s) need torch, which this environment lacks: .ci/torch-tests runs them"
        )
