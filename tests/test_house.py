"""The house rules a reader relies on (see the README's development section), checked on the
sources themselves: no Rust file over 600 lines of code outside its tests, no function over 80
lines (Rust or Python), the core's modules in layers that import only downwards, and no circle
of imports among the Python package's modules."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUST_SOURCES = [ROOT / "rust", ROOT / "benches"]
MAX_FILE_LINES = 600
MAX_FN_LINES = 80

# The core's top-level modules, lowest first: a module may use only those before it.
CORE_LAYERS: List[Set[str]] = [
    {"address_log", "console", "interrupt"},
    {"logging", "auth"},
    {"metrics"},
    {"store", "collectives", "rpc"},
    {"rendezvous"},
    {"agent"},
]

FN_START = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)")
TEST_MODULE = re.compile(r"^\s*#\[cfg\(test\)\]")


def rust_files() -> Iterator[Path]:
    """The Rust sources, without tests and build outputs."""
    for top in RUST_SOURCES:
        for directory, subdirectories, names in os.walk(top):
            subdirectories[:] = sorted(name for name in subdirectories if name not in {"target", "tests"})
            for name in sorted(names):
                if name.endswith(".rs") and name != "tests.rs":
                    yield Path(directory) / name


def code_lines(path: Path) -> List[str]:
    """The file's lines before its test module."""
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines):
        if TEST_MODULE.match(line):
            return lines[:number]
    return lines


def braces(line: str) -> int:
    """The change in brace depth on a line, outside strings, characters and comments."""
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])'", "''", line)
    line = line.split("//")[0]
    return line.count("{") - line.count("}")


def functions(lines: List[str]) -> Iterator[Tuple[str, int, int]]:
    """Each function's name, first line (1-based) and length in lines."""
    for start, line in enumerate(lines):
        match = FN_START.match(line)
        if not match:
            continue
        depth, opened = 0, False
        for end in range(start, len(lines)):
            text = lines[end]
            if not opened and ";" in text and "{" not in text:
                break  # a declaration without a body
            depth += braces(text)
            opened = opened or "{" in text
            if opened and depth <= 0:
                yield match.group(6), start + 1, end - start + 1
                break


def test_rust_files_and_functions_are_short() -> None:
    too_long = []
    for path in rust_files():
        lines = code_lines(path)
        name = path.relative_to(ROOT)
        if len(lines) > MAX_FILE_LINES:
            too_long.append(f"{name}: {len(lines)} lines of code (at most {MAX_FILE_LINES})")
        for function, line, length in functions(lines):
            if length > MAX_FN_LINES:
                too_long.append(f"{name}:{line}: fn {function} is {length} lines (at most {MAX_FN_LINES})")
    assert not too_long, "\n".join(too_long)


def long_python_functions(source: str) -> List[Tuple[str, int, int]]:
    """The functions of a Python source over the limit: name, first line, length."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FN_LINES:
                found.append((node.name, node.lineno, length))
    return found


def test_python_functions_are_short() -> None:
    too_long = [
        f"{path.relative_to(ROOT)}:{line}: def {name} is {length} lines (at most {MAX_FN_LINES})"
        for path in sorted((ROOT / "python" / "elastix").rglob("*.py"))
        for name, line, length in long_python_functions(path.read_text())
    ]
    assert not too_long, "\n".join(too_long)


def test_the_length_checks_see_a_long_function_and_file(tmp_path: Path) -> None:
    body = ["    let x = 1;"] * (MAX_FN_LINES + 1)
    lines = ["pub async fn long() {", *body, "}", "fn short() -> &'static str {", '    "{"', "}"]
    found = {name: length for name, _, length in functions(lines)}
    assert found == {"long": MAX_FN_LINES + 3, "short": 3}
    source = tmp_path / "big.rs"
    source.write_text("\n".join(["// x"] * (MAX_FILE_LINES + 1) + ["#[cfg(test)]", "mod tests {}"]))
    assert len(code_lines(source)) == MAX_FILE_LINES + 1
    python = "def long():\n" + "    x = 1\n" * MAX_FN_LINES + "\ndef short():\n    pass\n"
    assert long_python_functions(python) == [("long", 1, MAX_FN_LINES + 1)]


def core_uses() -> Dict[str, Set[str]]:
    """For each top-level module of the core, the other top-level modules it names."""
    src = ROOT / "rust" / "core" / "src"
    uses: Dict[str, Set[str]] = {}
    for path in rust_files():
        if src not in path.parents:
            continue
        module = path.relative_to(src).parts[0].removesuffix(".rs")
        if module in {"lib", "main"}:
            continue
        named = set(re.findall(r"\bcrate::(\w+)", "\n".join(code_lines(path))))
        uses.setdefault(module, set()).update(named - {module})
    return uses


def upward_uses(uses: Dict[str, Set[str]]) -> List[str]:
    layer_of = {module: n for n, layer in enumerate(CORE_LAYERS) for module in layer}
    wrong = []
    for module, named in sorted(uses.items()):
        if module not in layer_of:
            wrong.append(f"{module}: not in CORE_LAYERS (tests/test_house.py): place it")
            continue
        for other in sorted(named):
            if layer_of.get(other, -1) >= layer_of[module]:
                wrong.append(f"{module} uses crate::{other}, which is not below it")
    return wrong


def test_the_core_imports_only_downwards() -> None:
    uses = core_uses()
    assert uses, "no core modules found"
    assert not upward_uses(uses), "\n".join(upward_uses(uses))


def test_an_upward_use_is_found() -> None:
    assert upward_uses({"store": {"agent"}, "agent": {"store"}}) == ["store uses crate::agent, which is not below it"]


def python_imports() -> Dict[str, Set[str]]:
    """For each module of the elastix package, the package's modules it imports when it is
    imported (imports inside functions and under TYPE_CHECKING run later, or never)."""
    package = ROOT / "python" / "elastix"
    graph: Dict[str, Set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        name = ".".join(parts)
        base = parts if is_package else parts[:-1]
        imported: Set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for statement in [node, *(node.body if isinstance(node, (ast.If, ast.Try)) else [])]:
                if isinstance(statement, ast.Import):
                    imported.update(alias.name for alias in statement.names)
                elif isinstance(statement, ast.ImportFrom):
                    if statement.level:
                        anchor = base[: len(base) - statement.level + 1]
                        module = ".".join(anchor + ([statement.module] if statement.module else []))
                    else:
                        module = statement.module or ""
                    imported.add(module)
                    imported.update(f"{module}.{alias.name}" for alias in statement.names)
        graph[name] = imported
    return {name: {other for other in imported if other in graph and other != name} for name, imported in graph.items()}


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The import circles of `graph` that do not pass through a package's own __init__ chain
    (a package imports its submodules; a submodule importing its parent package is how
    Python works, and not a circle between concerns)."""
    found = []
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if node.startswith(other + ".") or other.startswith(node + "."):
                continue  # a package and its own modules
            if state.get(other) == 1:
                found.append([*stack[stack.index(other) :], other])
            elif other not in state:
                visit(other)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_python_package_has_no_import_circles() -> None:
    graph = python_imports()
    assert "elastix.store.tcp" in graph, sorted(graph)[:5]
    assert not circles(graph), "\n".join(" -> ".join(circle) for circle in circles(graph))


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a.x": {"a.y"}, "a.y": {"a.x"}}, [["a.x", "a.y", "a.x"]]),
        ({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": set()}, []),
        ({"a": {"a.x"}, "a.x": {"a"}}, []),
    ],
)
def test_a_circle_is_found(graph: Dict[str, Set[str]], expected: List[List[str]]) -> None:
    assert circles(graph) == expected
