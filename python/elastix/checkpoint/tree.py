"""A training state as a structure and a flat run of bytes: nested dicts (str keys), lists and
tuples whose leaves are NumPy arrays, torch tensors (CPU or CUDA, their data never pickled)
or small plain values. The structure is JSON (it goes in the manifest); the arrays' bytes are
laid out one after another, each 64-byte aligned."""

from __future__ import annotations

import base64
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .errors import CheckpointError

ALIGN = 64
PLAIN = (bool, int, float, str, type(None))


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


class Flat:
    """A state taken apart: its structure, and the arrays to copy with their offsets."""

    def __init__(self) -> None:
        self.arrays: List[Tuple[int, np.ndarray]] = []
        self.size = 0

    def add(self, array: np.ndarray) -> Dict[str, Any]:
        if not array.flags.c_contiguous:
            array = array.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
        offset = _aligned(self.size)
        self.arrays.append((offset, array))
        self.size = offset + array.nbytes
        return {"dtype": array.dtype.str, "shape": list(array.shape), "offset": offset, "nbytes": array.nbytes}


def flatten(state: Any) -> Tuple[Any, Flat]:
    """``state``'s structure and its arrays; a leaf of another kind is refused, named by path."""
    flat = Flat()
    return _flatten(state, "state", flat), flat


def _flatten(node: Any, path: str, flat: Flat) -> Any:
    if isinstance(node, dict):
        for key in node:
            if not isinstance(key, str):
                raise CheckpointError(f"{path}: keys must be str, got {type(key).__name__} {key!r}")
        return {"dict": [[key, _flatten(value, f"{path}[{key!r}]", flat)] for key, value in node.items()]}
    if isinstance(node, (list, tuple)):
        kind = "list" if isinstance(node, list) else "tuple"
        return {kind: [_flatten(value, f"{path}[{i}]", flat) for i, value in enumerate(node)]}
    if isinstance(node, (np.ndarray, np.generic)):
        if node.dtype.hasobject:
            raise CheckpointError(f"{path}: an array of Python objects cannot be saved without pickling")
        leaf = flat.add(np.asarray(node))
        return {"array": {**leaf, "scalar": True} if isinstance(node, np.generic) else leaf}
    if _is_tensor(node):
        return {"tensor": _tensor_leaf(node, flat)}
    if isinstance(node, bytes):
        return {"bytes": base64.b64encode(node).decode()}
    if isinstance(node, PLAIN):
        return {"value": node}
    raise CheckpointError(
        f"{path}: cannot save a {type(node).__module__}.{type(node).__qualname__}; a state holds dicts, lists, "
        "tuples, NumPy arrays, torch tensors and plain values (bool, int, float, str, bytes, None)"
    )


def _is_tensor(node: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(node, torch.Tensor)


def _tensor_leaf(tensor: Any, flat: Flat) -> Dict[str, Any]:
    torch = sys.modules["torch"]
    data = tensor.detach()
    dtype = str(data.dtype).removeprefix("torch.")
    if data.dtype == torch.bfloat16:  # NumPy has no bfloat16: its bits travel as int16
        data = data.view(torch.int16)
    leaf = flat.add(data.cpu().numpy())
    return {**leaf, "torch_dtype": dtype, "device": str(tensor.device)}


def rebuild(structure: Any, read: Callable[[Dict[str, Any]], np.ndarray]) -> Any:
    """The state ``structure`` describes, its arrays read (copied) by ``read``."""
    ((kind, body),) = structure.items()
    if kind == "dict":
        return {key: rebuild(value, read) for key, value in body}
    if kind in ("list", "tuple"):
        items = [rebuild(value, read) for value in body]
        return items if kind == "list" else tuple(items)
    if kind == "array":
        array = read(body)
        return array[()] if body.get("scalar") else array
    if kind == "tensor":
        return _tensor(body, read(body))
    if kind == "bytes":
        return base64.b64decode(body)
    return body


def _tensor(leaf: Dict[str, Any], array: np.ndarray) -> Any:
    import torch

    tensor = torch.from_numpy(array)
    if leaf["torch_dtype"] == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    return tensor.to(leaf["device"])


def first_difference(saved: Any, wanted: Any, path: str = "state") -> Optional[str]:
    """Where two structures first differ (keys, lengths, kinds, shapes, dtypes), or None."""
    ((kind, body),) = saved.items()
    ((other_kind, other),) = wanted.items()
    if kind != other_kind:
        return f"{path}: saved as {kind}, now {other_kind}"
    if kind == "dict":
        keys, other_keys = [key for key, _ in body], [key for key, _ in other]
        if keys != other_keys:
            gone, new = sorted(set(keys) - set(other_keys)), sorted(set(other_keys) - set(keys))
            return f"{path}: saved with keys {sorted(keys)}, now {sorted(other_keys)} (gone: {gone}, new: {new})"
        pairs = [(f"{path}[{key!r}]", a, b) for (key, a), (_, b) in zip(body, other)]
    elif kind in ("list", "tuple"):
        if len(body) != len(other):
            return f"{path}: saved with {len(body)} items, now {len(other)}"
        pairs = [(f"{path}[{i}]", a, b) for i, (a, b) in enumerate(zip(body, other))]
    elif kind in ("array", "tensor"):
        for field in ("shape", "dtype", "torch_dtype"):
            if body.get(field) != other.get(field):
                return f"{path}: saved with {field} {body.get(field)}, now {other.get(field)}"
        return None
    else:
        return None
    for where, a, b in pairs:
        found = first_difference(a, b, where)
        if found:
            return found
    return None
