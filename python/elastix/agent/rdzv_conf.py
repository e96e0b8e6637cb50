"""The one serializer of rendezvous configurations (``--rdzv-conf``, ``LaunchConfig.rdzv_configs``,
``RendezvousHandler(conf=...)``) into what the Rust rendezvous reads (``ConfInput`` in
rust/core/src/rendezvous/conf.rs): torch's ``"k=v,k=v"`` text as it is, or a map of plain
values. The keys and their meanings are checked there, not here."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Dict, Mapping, Union

ConfValue = Union[str, bool, int, float]


def rdzv_conf_values(conf: Union[str, Mapping[str, object], None]) -> Union[str, Dict[str, ConfValue]]:
    """Text stays text; a mapping becomes plain values (a timedelta becomes seconds)."""
    if conf is None:
        return ""
    if isinstance(conf, str):
        return conf
    values: Dict[str, ConfValue] = {}
    for key, value in conf.items():
        if not isinstance(key, str):
            raise ValueError(f"rendezvous conf: key {key!r} is not a string")
        if isinstance(value, timedelta):
            values[key] = value.total_seconds()
        elif isinstance(value, (str, bool, int, float)):
            values[key] = value
        else:
            raise ValueError(
                f"rendezvous conf {key}={value!r}: expected a string, a number, a bool or a timedelta, "
                f"not {type(value).__name__}"
            )
    return values


def rdzv_conf_json(conf: Union[str, Mapping[str, object], None]) -> str:
    return json.dumps(rdzv_conf_values(conf))


__all__ = ["rdzv_conf_json", "rdzv_conf_values"]
