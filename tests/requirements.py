"""The system components some tests need, beyond Python packages: network namespaces, firewalls
in them (iptables), etcd, Slurm and chromium. Where one is missing, a test that needs it is
skipped, saying how to get it; where CI requires them (``ELASTIX_REQUIRE``, a comma-separated
list of components or ``all``, which .ci/run sets when it runs as root after installing them)
it fails instead, so a CI run cannot pass by skipping what it claims to test. Every test that
asks is recorded, and the run ends with a table of which suites ran (see ``report``)."""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from typing import Any, Dict, Optional, Set

import pytest

REQUIRE_VAR = "ELASTIX_REQUIRE"
COMPONENTS = ("namespaces", "firewalls", "etcd", "slurm", "chromium")
ETCD_MISSING = "etcd is not installed (Debian package etcd-server; .ci/run installs it)"

# component -> the tests that asked for it
_asked: Dict[str, Set[str]] = defaultdict(set)


def required(name: str) -> bool:
    wanted = {part.strip() for part in os.environ.get(REQUIRE_VAR, "").split(",") if part.strip()}
    return name in wanted or "all" in wanted


def need(name: str, missing: Optional[str]) -> None:
    """The current test needs component `name`; `missing`: why it is not here (None: it is)."""
    assert name in COMPONENTS, name
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    _asked[name].add(current.rsplit(" (", 1)[0])
    if missing is None:
        return
    if required(name):
        pytest.fail(f"{name} is required here ({REQUIRE_VAR}={os.environ.get(REQUIRE_VAR)}) but missing: {missing}")
    pytest.skip(missing)


def need_etcd() -> None:
    need("etcd", None if shutil.which("etcd") else ETCD_MISSING)


def report(terminalreporter: Any) -> None:
    """A table of the run: per folder of tests, and per component the tests that needed it,
    how many passed, failed and were skipped."""
    outcomes: Dict[str, str] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for result in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(result, "nodeid", None)
            if nodeid and (outcome != "passed" or getattr(result, "when", "call") == "call"):
                # a failure in teardown after a passed call counts as the failure
                if outcomes.get(nodeid) not in ("failed", "error"):
                    outcomes[nodeid] = outcome
    if not outcomes:
        return
    rows: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for nodeid, outcome in outcomes.items():
        parts = nodeid.split("::")[0].split("/")
        suite = parts[1] if len(parts) > 2 else "(top level)"
        rows[suite][outcome] += 1
    for name in COMPONENTS:
        asked = {nodeid for nodeid in _asked.get(name, ()) if nodeid in outcomes}
        label = f"[{name}]" + (" required" if required(name) else "")
        rows[label] = defaultdict(int)
        for nodeid in asked:
            rows[label][outcomes[nodeid]] += 1
    heads = ["suite", "passed", "failed", "skipped"]
    table = [heads] + [
        [suite, *(str(counts.get(k, 0) + (counts.get("error", 0) if k == "failed" else 0)) for k in heads[1:])]
        for suite, counts in sorted(rows.items(), key=lambda item: (item[0].startswith("["), item[0]))
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(heads))]
    terminalreporter.write_sep("-", "suites that ran")
    for row in table:
        terminalreporter.write_line("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
