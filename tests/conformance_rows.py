"""What the runs of torch's own test files against elastix share (tests/store/ and tests/cli/
torch_*_conformance.py): a stand-in for ``expecttest`` where it is missing, the test classes a
loaded file defines, a unittest result that keeps one row per test, (outcome, the first line of
its error), where a failed subtest fails its test and the first problem stays; and the table of
those rows against the KNOWN ones."""

from __future__ import annotations

import sys
import types
import unittest
from typing import Any, Dict, List, Tuple


def expecttest_stand_in() -> None:
    """torch's test helpers import ``expecttest`` (a test-only dependency of torch's, absent
    where only torch's runtime requirements are installed) for its ``TestCase`` base, whose
    ``assertExpectedInline`` none of the files run here uses: a plain ``unittest.TestCase``
    stands in."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("expecttest", "stand-in: expecttest is not installed")
        stand_in.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        stand_in.ACCEPT = False  # type: ignore[attr-defined]
        sys.modules["expecttest"] = stand_in


def test_classes(module: types.ModuleType) -> List[type]:
    """The test classes the module defines, in file order."""
    return [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, unittest.TestCase)
        and value.__module__ == module.__name__
        and unittest.defaultTestLoader.getTestCaseNames(value)
    ]


class RowRecorder(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.rows: Dict[str, Tuple[str, str]] = {}

    def _name(self, test: Any) -> str:
        if isinstance(test, unittest.TestCase):
            return f"{type(test).__name__}.{test._testMethodName}"
        return str(test)  # setUpClass and the like

    def _note(self, test: Any, outcome: str, detail: str = "") -> None:
        name = self._name(test)
        if name in self.rows and self.rows[name][0] != "pass":
            return  # keep the first problem (a subtest's) of the test
        self.rows[name] = (outcome, detail)

    @staticmethod
    def _first_line(err: Any) -> str:
        _, value, _ = err
        lines = str(value).strip().splitlines()
        return f"{type(value).__name__}: {lines[0] if lines else ''}"

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._note(test, "pass")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._note(test, "fail", self._first_line(err))

    def addError(self, test: Any, err: Any) -> None:
        super().addError(test, err)
        self._note(test, "error", self._first_line(err))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._note(test, "skip", reason.strip().splitlines()[0] if reason.strip() else "")

    def addSubTest(self, test: unittest.TestCase, subtest: Any, err: Any) -> None:
        super().addSubTest(test, subtest, err)
        if err is not None:
            failed = issubclass(err[0], test.failureException)
            self._note(test, "fail" if failed else "error", f"[{subtest._subDescription()}] {self._first_line(err)}")

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._note(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._note(test, "fail", "unexpected success")


def print_rows(rows: Dict[str, Tuple[str, str]], known: Dict[str, Tuple[str, str]]) -> int:
    """Prints one line per test, marking what KNOWN explains and what it does not; returns the
    number of tests that do not pass and are not in KNOWN."""
    width = max((len(name) for name in rows), default=4)
    print(f"{'test':<{width}}  {'result':<6}  detail")
    unexpected = 0
    for name, (outcome, detail) in rows.items():
        listed = known.get(name)
        note = ""
        if outcome in ("fail", "error"):
            note = f"  [known: {listed[0]}]" if listed else "  [UNEXPECTED]"
            unexpected += listed is None
        elif outcome == "pass" and listed:
            note = "  [listed in KNOWN but passes]"
        print(f"{name:<{width}}  {outcome:<6}  {detail}{note}")
    return unexpected
