"""argparse with environment fallbacks: a flag ``--foo-bar`` not given on the command line takes
``ELASTIX_FOO_BAR``, else torchrun's ``PET_FOO_BAR``, else its default.

torch reads ``PET_*`` when the parser is built and lets argparse convert the string; here the
environment is read at parse time and a bad value is an error that names the variable. Boolean
flags keep torch's rule for ``PET_*`` (an integer: ``PET_STANDALONE=1``, any non-zero is true);
``ELASTIX_*`` also accepts true/false/yes/no/on/off.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple

SOURCES = "_sources"  # namespace attribute: dest -> "cli", an env variable name, or "default"

_TRUE = {"true", "t", "yes", "y", "on"}
_FALSE = {"false", "f", "no", "n", "off"}


def _mark(namespace: argparse.Namespace, dest: str, source: str) -> None:
    sources = getattr(namespace, SOURCES, None)
    if sources is None:
        sources = {}
        setattr(namespace, SOURCES, sources)
    sources[dest] = source


def source_of(namespace: argparse.Namespace, dest: str) -> str:
    return getattr(namespace, SOURCES, {}).get(dest, "default")


def is_given(namespace: argparse.Namespace, dest: str) -> bool:
    """Whether a flag's value was given (command line, variable or scheduler), not defaulted."""
    return source_of(namespace, dest) != "default"


def set_from(namespace: argparse.Namespace, dest: str, value: Any, source: str) -> None:
    """Sets a flag's value from somewhere other than the command line or its variables (a
    scheduler's environment), and says where: it counts as given from then on."""
    setattr(namespace, dest, value)
    _mark(namespace, dest, source)


class _EnvMixin:
    def env_names(self) -> List[str]:
        name = self.dest.upper()  # type: ignore[attr-defined]
        names = [f"ELASTIX_{name}"]
        if self.pet:  # type: ignore[attr-defined]
            names.append(f"PET_{name}")
        return names


class EnvOption(_EnvMixin, argparse.Action):
    """An option taking a value, with the ELASTIX_/PET_ fallback."""

    def __init__(self, option_strings: Sequence[str], dest: str, pet: bool = True, **kwargs: Any) -> None:
        self.pet = pet
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        _mark(namespace, self.dest, "cli")


class EnvFlag(_EnvMixin, argparse.Action):
    """A boolean flag (store_true), with torch's ``check_env`` fallback."""

    def __init__(self, option_strings: Sequence[str], dest: str, pet: bool = True, **kwargs: Any) -> None:
        self.pet = pet
        kwargs.setdefault("default", False)
        super().__init__(option_strings, dest, nargs=0, const=True, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        _mark(namespace, self.dest, "cli")


def parse_env_bool(name: str, raw: str) -> bool:
    text = raw.strip()
    try:
        return bool(int(text))
    except ValueError:
        pass
    if name.startswith("ELASTIX_"):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError("expected 1/0 or true/false")
    raise ValueError("torchrun's PET_* flags take an integer: 1 for on, 0 for off")


class EnvArgumentParser(argparse.ArgumentParser):
    """ArgumentParser that applies the environment fallbacks after parsing, does not call
    ``--nproc`` ambiguous just because ``--nproc-per-node`` and ``--nproc_per_node`` both match
    it (they are one option; Python 3.11's argparse refuses such abbreviations), and says a
    usage error in one line, with where the flags are, rather than after a page of usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: see `{self.prog} --help` for every flag\n")

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        remainder = next((action for action in self._actions if action.nargs == argparse.REMAINDER), None)
        program_args = None
        if remainder is not None:
            at = self._program_index(args)
            if at is not None:
                args, program_args = args[: at + 1], args[at + 1 :]
        namespace, extras = super().parse_known_args(args, namespace)
        if remainder is not None and program_args is not None:
            # the program's own flags, as given: never taken for (abbreviations of) ours
            setattr(namespace, remainder.dest, program_args)
        self._apply_env(namespace)
        return namespace, extras

    def _program_index(self, args: List[str]) -> Optional[int]:
        """Where the program is among ``args``: the first argument that is neither one of our
        options nor an option's value (None: no program, argparse says so)."""
        at = 0
        while at < len(args):
            arg = args[at]
            if arg == "--":
                return at + 1 if at + 1 < len(args) else None
            if not arg.startswith("-") or arg == "-":
                return at
            name, attached = arg.split("=", 1)[0], "=" in arg
            if not arg.startswith("--") and len(arg) > 2:
                name, attached = arg[:2], True  # -r3: a short option with its value
            found = self._option_string_actions.get(name)
            if found is None and name.startswith("--"):
                matches = self._get_option_tuples(name)
                found = matches[0][0] if len(matches) == 1 else None
            takes_value = found is not None and found.nargs != 0 and not attached
            at += 2 if takes_value else 1
        return None

    def _apply_env(self, namespace: argparse.Namespace) -> None:
        for action in self._actions:
            if not isinstance(action, _EnvMixin) or source_of(namespace, action.dest) == "cli":
                continue
            for name in action.env_names():
                if name not in os.environ:
                    continue
                raw = os.environ[name]
                setattr(namespace, action.dest, self._convert(action, name, raw))
                _mark(namespace, action.dest, name)
                break

    def _convert(self, action: argparse.Action, name: str, raw: str) -> Any:
        flag = "/".join(action.option_strings[:2]) if action.option_strings else action.dest
        try:
            if isinstance(action, EnvFlag):
                return parse_env_bool(name, raw)
            value = action.type(raw) if callable(action.type) else raw
        except (ValueError, TypeError, argparse.ArgumentTypeError) as err:
            reason = str(err) or "invalid value"
            self.error(f"{name}={raw!r} (the environment's value for {flag}): {reason}")
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            self.error(f"{name}={raw!r} (the environment's value for {flag}): choose from {choices}")
        return value

    def _get_option_tuples(self, option_string: str) -> List[Tuple[Any, ...]]:
        seen = set()
        unique = []
        for option_tuple in super()._get_option_tuples(option_string):
            if id(option_tuple[0]) not in seen:
                seen.add(id(option_tuple[0]))
                unique.append(option_tuple)
        return unique


def env_help(parser: argparse.ArgumentParser) -> Dict[str, List[str]]:
    """dest -> the environment variables read for it (for documentation and tests)."""
    return {a.dest: a.env_names() for a in parser._actions if isinstance(a, _EnvMixin)}


__all__ = ["EnvArgumentParser", "EnvOption", "EnvFlag", "source_of", "env_help", "parse_env_bool"]
