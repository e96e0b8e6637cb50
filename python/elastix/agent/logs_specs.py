"""Where workers' output goes: torch's ``Std`` masks, ``-r``/``-t`` specs, the local-ranks
filter and line-prefix templates, turned into the per-rank lists the Rust agent takes.

Differences from torch: a ``-r``/``-t`` map accepts local ranks of any number of digits (torch
stops at 9), and prefix templates are translated from torch's ``${rank}`` syntax to elastix's
``{rank}`` syntax here, once, so the agent only knows one syntax.
"""

from __future__ import annotations

import enum
import re
from typing import Dict, Iterable, List, Mapping, Optional, Set, Union


class Std(enum.IntFlag):
    """Which of a worker's streams a setting applies to (torch's values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR

    @classmethod
    def from_str(cls, spec: str) -> Union["Std", Dict[int, "Std"]]:
        """``"3"`` (every rank) or ``"0:1,1:2"`` (per local rank), as torch's ``-r``/``-t``."""
        return parse_std_spec(spec)


StdSpec = Union[Std, int, str, Mapping[int, Union[Std, int]], None]

_MASK = re.compile(r"^[0-3]$")
_ENTRY = re.compile(r"^(\d+):([0-3])$")


def parse_std_spec(spec: str, flag: str = "--redirects") -> Union[Std, Dict[int, Std]]:
    """Parses torch's ``-r``/``-t`` syntax; raises ValueError naming ``flag`` otherwise."""
    text = spec.strip()
    if _MASK.match(text):
        return Std(int(text))
    ranks: Dict[int, Std] = {}
    for item in text.split(","):
        match = _ENTRY.match(item.strip())
        if not match:
            raise ValueError(
                f"{flag}: {spec!r} is neither a mask 0-3 (0 none, 1 stdout, 2 stderr, 3 both) nor "
                "a map LOCAL_RANK:MASK,... such as 0:1,1:2"
            )
        ranks[int(match.group(1))] = Std(int(match.group(2)))
    return ranks


def masks_per_rank(spec: StdSpec, local_world_size: int, flag: str = "--redirects") -> List[int]:
    """One mask per local rank. Ranks a map does not name get 0 (torch's rule); ranks it names
    beyond the local world size are ignored, as torch does, since a launch line is often shared
    by nodes with different worker counts."""
    if spec is None:
        return [0] * local_world_size
    if isinstance(spec, str):
        spec = parse_std_spec(spec, flag)
    if isinstance(spec, Mapping):
        masks = [0] * local_world_size
        for rank, mask in spec.items():
            rank, mask = int(rank), int(mask)
            if rank < 0 or not 0 <= mask <= 3:
                raise ValueError(f"{flag}: bad entry {rank}:{mask}")
            if rank < local_world_size:
                masks[rank] = mask
        return masks
    mask = int(spec)
    if not 0 <= mask <= 3:
        raise ValueError(f"{flag}: mask {mask} is not 0-3")
    return [mask] * local_world_size


def parse_ranks_filter(spec: Union[str, Iterable[int], None]) -> Optional[List[int]]:
    """``"0,1"`` -> [0, 1]; empty or None -> None (every rank shown)."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if not spec.strip():
            return None
        try:
            ranks = {int(item) for item in spec.split(",")}
        except ValueError:
            raise ValueError(
                f"--local-ranks-filter: {spec!r} is not a comma-separated list of local ranks such as 0,1,2"
            ) from None
    else:
        ranks = {int(rank) for rank in spec}
    if any(rank < 0 for rank in ranks):
        raise ValueError(f"--local-ranks-filter: local ranks are >= 0, got {sorted(ranks)}")
    return sorted(ranks) or None


# torch's macro names -> elastix's placeholders
_TORCH_MACROS = {"role_name": "{role}", "rank": "{rank}", "local_rank": "{local_rank}", "hostname": "{host}"}
_TORCH_TEMPLATE = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def translate_torch_prefix(template: str) -> str:
    """torch's ``string.Template`` prefix (``${rank}``, ``$local_rank``, ``${role_name}``,
    ``${hostname}``; ``$$`` is a dollar) -> elastix's ``{rank}`` form. Unknown names are left
    as written, as torch's ``safe_substitute`` leaves them."""

    def one(match: "re.Match[str]") -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(2)
        return _TORCH_MACROS.get(name, match.group(0))

    return _TORCH_TEMPLATE.sub(one, template)


class DefaultLogsSpecs:
    """torch's DefaultLogsSpecs arguments: where logs go and what is redirected or tee'd.

    ``log_dir`` None lets the agent make a temporary directory only when some output goes to a
    file; ``redirects``/``tee`` take a Std, an int mask, a ``{local_rank: mask}`` map or torch's
    string syntax; ``local_ranks_filter`` a set of local ranks shown on the console (the others
    still go to their files: elastix never drops output). A plain class, not a dataclass: this
    module is on ``elastix run``'s start-up path, and dataclasses costs milliseconds to import.
    """

    def __init__(
        self,
        log_dir: Optional[str] = None,
        redirects: StdSpec = Std.NONE,
        tee: StdSpec = Std.NONE,
        local_ranks_filter: Optional[Set[int]] = None,
    ) -> None:
        self.log_dir = log_dir
        self.redirects = redirects
        self.tee = tee
        self.local_ranks_filter = local_ranks_filter

    @property
    def root_log_dir(self) -> Optional[str]:
        return self.log_dir

    def __repr__(self) -> str:
        return (
            f"DefaultLogsSpecs(log_dir={self.log_dir!r}, redirects={self.redirects!r}, "
            f"tee={self.tee!r}, local_ranks_filter={self.local_ranks_filter!r})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DefaultLogsSpecs) and vars(self) == vars(other)


LogsSpecs = DefaultLogsSpecs

__all__ = [
    "Std",
    "DefaultLogsSpecs",
    "LogsSpecs",
    "parse_std_spec",
    "masks_per_rank",
    "parse_ranks_filter",
    "translate_torch_prefix",
]
