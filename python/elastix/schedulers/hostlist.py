"""Slurm's hostlist expressions (``node[01-04,07]``, ``rack[1-2]-gpu[1-2]``), expanded here:
``scontrol show hostnames`` is often missing inside a container, and a job that falls back to
a world of one per node is worse than an error."""

from __future__ import annotations

import itertools
import math
from typing import List

#: Most hosts one expression may name (a typo such as node[1-1000000] fails fast).
MAX_HOSTS = 1_000_000


def expand(expression: str) -> List[str]:
    """Every host an expression names, in order: comma-separated items, each with any number of
    bracketed sets of numbers or ranges (zero-padded as their lower bound is); several sets in
    one item give their product, the last varying fastest. ValueError names what is wrong."""
    text = expression.strip()
    if not text:
        raise ValueError("empty hostlist")
    hosts: List[str] = []
    for item in _split_items(text, expression):
        hosts.extend(_expand_item(item, expression))
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"hostlist {expression!r} names more than {MAX_HOSTS} hosts")
    return hosts


def first(expression: str) -> str:
    """The first host an expression names (the whole expression is checked)."""
    return expand(expression)[0]


def _split_items(text: str, expression: str) -> List[str]:
    """Splits at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"hostlist {expression!r}: nested '[' at column {i + 1}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"hostlist {expression!r}: ']' without '[' at column {i + 1}")
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"hostlist {expression!r}: '[' not closed")
    items.append(text[start:])
    for item in items:
        if not item.strip():
            raise ValueError(f"hostlist {expression!r}: an empty item")
    return [item.strip() for item in items]


def _expand_item(item: str, expression: str) -> List[str]:
    # literal text and bracketed sets, alternating: "rack", "1-2", "-gpu", "1-2", ""
    parts = item.replace("]", "[").split("[")
    choices = []
    for i, part in enumerate(parts):
        choices.append(_numbers(part, expression) if i % 2 else [part])
    if math.prod(len(choice) for choice in choices) > MAX_HOSTS:
        raise ValueError(f"hostlist {expression!r}: {item} names more than {MAX_HOSTS} hosts")
    return ["".join(combination) for combination in itertools.product(*choices)]


def _numbers(spec: str, expression: str) -> List[str]:
    numbers: List[str] = []
    for piece in spec.split(","):
        low, dash, high = piece.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"hostlist {expression!r}: [{spec}] holds {piece!r}, not a number or a range N-M")
        if not dash:
            numbers.append(low)
            continue
        start, end = int(low), int(high)
        if start > end:
            raise ValueError(f"hostlist {expression!r}: range {piece} runs backwards")
        if end - start >= MAX_HOSTS:
            raise ValueError(f"hostlist {expression!r}: range {piece} names more than {MAX_HOSTS} hosts")
        width = len(low)
        numbers.extend(f"{n:0{width}d}" for n in range(start, end + 1))
    return numbers
