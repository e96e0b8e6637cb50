"""A Kubernetes Indexed Job's pod: its completion index, which names the pod (`JOB-INDEX`,
reachable as `JOB-INDEX.SERVICE` through a headless service) and orders the nodes. The
PyTorchJob operator's pods need nothing here: their `PET_*` variables are flags already."""

from __future__ import annotations

from typing import Mapping, Optional

INDEX_VARIABLE = "JOB_COMPLETION_INDEX"


def completion_index(env: Mapping[str, str]) -> Optional[int]:
    """This pod's index in an Indexed Job; None outside one. ValueError if it is not a number."""
    text = env.get(INDEX_VARIABLE)
    if text is None or text == "":
        return None
    if not text.isdigit():
        raise ValueError(f"{INDEX_VARIABLE}={text!r} is not a completion index (0, 1, ...)")
    return int(text)
