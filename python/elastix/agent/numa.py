"""``--numa-binding`` (torchrun 2.9+): which CPUs each local rank's worker may run on, read
from sysfs without torch. The agent applies the result: it sets each worker's CPU affinity
when it starts it (and its standby's), so no ``numactl`` binary is needed and every thread the
worker starts inherits the binding.

As in torch, the worker with local rank ``r`` is bound near device ``r``, by mode
(torch's ``AffinityMode``), always within the CPUs this process may use itself
(``os.sched_getaffinity``: "allowed" below):

* ``node``: every allowed CPU of the device's NUMA node.
* ``socket``: every allowed CPU of every NUMA node on the device's socket. A node's socket is
  the physical package of its lowest allowed CPU.
* ``exclusive``: the device's node's physical cores (a core's hyperthreads stay together),
  in order, divided evenly among the devices on that node, in device order; the first
  ``cores % devices`` devices get one core more. Fewer cores than devices is an error.
* ``core-complex``: one group of CPUs sharing the highest-level data cache (an L3 "core
  complex") on the device's node. The groups are ordered largest first, then by lowest CPU;
  the n-th device of the node takes group n modulo the number of groups.

Devices. NVIDIA GPUs are the PCI devices with vendor 0x10de and a display class (0x03xxxx),
in PCI bus id order: the order CUDA numbers them in with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
(and ``nvidia-smi`` lists them in). A ``CUDA_VISIBLE_DEVICES`` of indices picks from that list
as CUDA does (up to the first invalid entry); one that names GPUs by UUID cannot be mapped
without the driver and is an error. A GPU's node is its ``numa_node`` file; ``-1`` (the
firmware gave none) means the only node on a machine with one node, as in torch, and is an
error on a machine with several. Note that sysfs is not containerised: a container given some
of a host's GPUs sees all of them here, so set ``CUDA_VISIBLE_DEVICES`` there.

Machines without NVIDIA GPUs (an elastix extension: torch needs an accelerator). CPU
training is elastix's common case, so the local ranks are spread evenly over the NUMA nodes
that have allowed CPUs, in blocks: local rank ``r`` of ``n`` goes to the ``r * nodes // n``-th
node, and the ranks that share a node are its "devices" for ``exclusive`` and
``core-complex``. ``CUDA_VISIBLE_DEVICES=""`` (GPUs hidden) counts as no GPUs.

A binding that cannot be computed (no NUMA nodes in sysfs, a GPU without a node, a node
without allowed CPUs, more local ranks than GPUs, ...) is an error that names the flag,
before anything starts, never a silent fallback; only torch's explicit
``NumaOptions(should_fall_back_if_binding_fails=True)`` turns it into a warning.

The topology is read under a sysfs root: ``/sys``, or ``ELASTIX_SYSFS_ROOT`` when it is set
(tests point it at a fake tree), or the ``sysfs_root`` argument.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Set, Tuple

SYSFS_ROOT_VAR = "ELASTIX_SYSFS_ROOT"
DEFAULT_SYSFS_ROOT = "/sys"
NVIDIA_VENDOR = 0x10DE
DISPLAY_CLASS = 0x03  # the PCI base class of VGA and 3D controllers


class AffinityMode(str, enum.Enum):
    """torch.numa.binding.AffinityMode: the modes of ``--numa-binding``."""

    NODE = "node"
    SOCKET = "socket"
    EXCLUSIVE = "exclusive"
    CORE_COMPLEX = "core-complex"


MODES = tuple(mode.value for mode in AffinityMode)


@dataclass(frozen=True)
class NumaOptions:
    """torch.numa.binding.NumaOptions: ``LaunchConfig(numa_options=...)`` takes this, torch's
    own, or a mode's name."""

    affinity_mode: AffinityMode
    # torch's escape hatch for mass rollouts: a binding that cannot be computed is a warning
    # and the workers run unbound (an error otherwise)
    should_fall_back_if_binding_fails: bool = False


class NumaBindingError(ValueError):
    """The binding cannot be computed on this machine."""


def numa_options(value: Any, what: str = "numa_options") -> Optional[NumaOptions]:
    """``value`` as NumaOptions: None, a mode's name, this module's NumaOptions or torch's
    (anything with an ``affinity_mode``); ValueError naming ``what`` otherwise."""
    if value is None:
        return None
    if isinstance(value, NumaOptions):
        mode: Any = value.affinity_mode
        fall_back = value.should_fall_back_if_binding_fails
    elif isinstance(value, str):
        mode, fall_back = value, False
    elif hasattr(value, "affinity_mode"):
        mode = value.affinity_mode
        fall_back = bool(getattr(value, "should_fall_back_if_binding_fails", False))
    else:
        raise ValueError(f"{what}: expected NumaOptions (or a mode: {', '.join(MODES)}), got {type(value).__name__}")
    try:
        return NumaOptions(AffinityMode(getattr(mode, "value", mode)), bool(fall_back))
    except ValueError:
        raise ValueError(f"{what}: unknown mode {mode!r} (choose from {', '.join(MODES)})") from None


def agent_binding(
    value: Any,
    local_world_size: int,
    *,
    what: str = "--numa-binding",
    warn: Optional[Callable[[str], None]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Optional[Dict[str, Any]]:
    """The agent configuration's ``numa_binding`` for ``value`` (see :func:`numa_options`):
    ``{"mode": ..., "cpus": [[cpu, ...] for each local rank]}``, or None without a binding.
    NumaBindingError (a ValueError) naming ``what`` when it cannot be computed."""
    options = numa_options(value, what)
    if options is None:
        return None
    mode = options.affinity_mode
    try:
        cpus = cpus_per_local_rank(mode, local_world_size, environ=environ)
    except NumaBindingError as err:
        message = f"{what} {mode.value}: {err}"
        if not options.should_fall_back_if_binding_fails:
            raise NumaBindingError(message) from None
        if warn is not None:
            warn(f"{message}; workers run unbound (should_fall_back_if_binding_fails)")
        return None
    return {"mode": mode.value, "cpus": [sorted(rank) for rank in cpus]}


def cpus_per_local_rank(
    mode: Any,
    local_world_size: int,
    *,
    sysfs_root: Optional[str] = None,
    allowed_cpus: Optional[Iterable[int]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> List[Set[int]]:
    """The CPUs of each local rank ``0 .. local_world_size - 1`` (see the module's text).
    ``environ`` (default: this process's) gives ``ELASTIX_SYSFS_ROOT`` unless ``sysfs_root``
    is given, and ``CUDA_VISIBLE_DEVICES``; ``allowed_cpus`` defaults to this process's
    affinity."""
    mode = AffinityMode(getattr(mode, "value", mode))
    environ = os.environ if environ is None else environ
    root = sysfs_root or environ.get(SYSFS_ROOT_VAR) or DEFAULT_SYSFS_ROOT
    allowed = os.sched_getaffinity(0) if allowed_cpus is None else allowed_cpus
    topology = _Topology(root, allowed)
    devices = _Devices(topology, local_world_size, environ.get("CUDA_VISIBLE_DEVICES"))
    return [_cpus_for(topology, devices, mode, rank) for rank in range(local_world_size)]


def parse_cpu_list(text: str) -> Set[int]:
    """A sysfs CPU list (``0-3,8,10-11``; empty for none) as a set."""
    cpus: Set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpu_list`: ``{0, 1, 2, 5}`` is ``0-2,5``."""
    ranges: List[List[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in ranges)


class _Topology:
    """What sysfs says about NUMA nodes, CPUs and PCI devices, read on demand."""

    def __init__(self, root: str, allowed: Iterable[int]) -> None:
        self.root = root
        self.allowed: FrozenSet[int] = frozenset(allowed)
        self._nodes: Optional[Dict[int, FrozenSet[int]]] = None

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def read(self, *parts: str) -> str:
        path = self.path(*parts)
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError as err:
            raise NumaBindingError(f"cannot read {path} ({err.strerror or err})") from None

    def read_int(self, *parts: str, base: int = 10) -> int:
        text = self.read(*parts)
        try:
            return int(text, base)
        except ValueError:
            raise NumaBindingError(f"{self.path(*parts)}: {text!r} is not a number") from None

    def read_cpus(self, *parts: str) -> Set[int]:
        text = self.read(*parts)
        try:
            return parse_cpu_list(text)
        except ValueError:
            raise NumaBindingError(f"{self.path(*parts)}: {text!r} is not a CPU list") from None

    def all_node_cpus(self, node: int) -> Set[int]:
        return self.read_cpus("devices", "system", "node", f"node{node}", "cpulist")

    @property
    def nodes(self) -> Dict[int, FrozenSet[int]]:
        """Each NUMA node's allowed CPUs (empty for a node of memory only, or of CPUs this
        process may not use)."""
        if self._nodes is None:
            directory = self.path("devices", "system", "node")
            try:
                names = os.listdir(directory)
            except OSError:
                names = []
            ids = sorted(int(m.group(1)) for m in map(re.compile(r"node(\d+)$").match, names) if m)
            if not ids:
                raise NumaBindingError(f"no NUMA node in {directory} (a kernel without NUMA support?)")
            self._nodes = {node: frozenset(self.all_node_cpus(node) & self.allowed) for node in ids}
        return self._nodes

    def cpu_file(self, cpu: int, *parts: str) -> Tuple[str, ...]:
        return ("devices", "system", "cpu", f"cpu{cpu}", *parts)

    def package(self, cpu: int) -> int:
        return self.read_int(*self.cpu_file(cpu, "topology", "physical_package_id"))

    def core(self, cpu: int) -> int:
        """The physical core of ``cpu``, named by its lowest hyperthread."""
        return min(self.read_cpus(*self.cpu_file(cpu, "topology", "thread_siblings_list")) | {cpu})

    def cache_group(self, cpu: int) -> int:
        """The CPUs sharing ``cpu``'s highest-level data (or unified) cache, named by the
        lowest of them."""
        directory = self.path(*self.cpu_file(cpu, "cache"))
        try:
            entries = sorted(os.listdir(directory))
        except OSError as err:
            raise NumaBindingError(f"cannot list {directory} ({err.strerror or err})") from None
        best: Tuple[int, Set[int]] = (-1, set())
        for entry in entries:
            if not re.fullmatch(r"index\d+", entry):
                continue
            cache = self.cpu_file(cpu, "cache", entry)
            if os.path.exists(self.path(*cache, "type")) and self.read(*cache, "type") not in ("Unified", "Data"):
                continue  # an instruction cache
            level = self.read_int(*cache, "level")
            if level > best[0]:
                best = (level, self.read_cpus(*cache, "shared_cpu_list"))
        if best[0] < 0:
            raise NumaBindingError(f"no data cache listed in {directory}")
        return min(best[1] | {cpu})

    def nvidia_gpus(self) -> List[Tuple[str, int]]:
        """(PCI address, ``numa_node``) of each NVIDIA GPU, in PCI bus id order."""
        directory = self.path("bus", "pci", "devices")
        try:
            addresses = os.listdir(directory)
        except OSError:
            return []
        gpus = []
        for address in addresses:
            device = ("bus", "pci", "devices", address)
            try:
                vendor = self.read_int(*device, "vendor", base=16)
                pci_class = self.read_int(*device, "class", base=16)
            except NumaBindingError:
                continue  # not a device we can identify, so not a GPU we could use
            if vendor == NVIDIA_VENDOR and pci_class >> 16 == DISPLAY_CLASS:
                gpus.append((address, self.read_int(*device, "numa_node")))
        return sorted(gpus, key=lambda gpu: _pci_order(gpu[0]))


def _pci_order(address: str) -> Tuple[int, ...]:
    """``0000:3b:00.0`` as (domain, bus, device, function), hexadecimal."""
    try:
        return tuple(int(part, 16) for part in re.split(r"[:.]", address))
    except ValueError:
        return (1 << 32,)


class _Devices:
    """The devices local ranks are bound near: the visible NVIDIA GPUs, or else (CPU training)
    one per local rank, spread over the NUMA nodes."""

    def __init__(self, topology: _Topology, local_world_size: int, visible: Optional[str]) -> None:
        self.topology = topology
        gpus = topology.nvidia_gpus()
        if visible is not None:
            gpus = _visible(gpus, visible)
        self.gpus = gpus
        if gpus:
            if local_world_size > len(gpus):
                listed = ", ".join(address for address, _ in gpus)
                raise NumaBindingError(
                    f"local rank {len(gpus)} has no GPU to be bound near: {len(gpus)} NVIDIA GPU(s) "
                    f"({listed}) for {local_world_size} local ranks"
                )
            self.count = len(gpus)
        else:
            usable = [node for node, cpus in topology.nodes.items() if cpus]
            if not usable:
                raise NumaBindingError(
                    f"no NUMA node has any of the CPUs this process may use ({format_cpu_list(topology.allowed)})"
                )
            self.spread = [usable[rank * len(usable) // local_world_size] for rank in range(local_world_size)]
            self.count = local_world_size

    def name(self, index: int) -> str:
        if self.gpus:
            return f"GPU {index} ({self.gpus[index][0]})"
        return f"local rank {index}"

    def node(self, index: int) -> int:
        if not self.gpus:
            return self.spread[index]
        address, node = self.gpus[index]
        nodes = self.topology.nodes
        if node < 0:
            if len(nodes) == 1:
                return next(iter(nodes))
            raise NumaBindingError(
                f"GPU {index} ({address}) has no NUMA node (its numa_node is {node}) on a machine with "
                f"{len(nodes)} NUMA nodes"
            )
        if node not in nodes:
            raise NumaBindingError(f"GPU {index} ({address}) is on NUMA node {node}, which sysfs does not list")
        return node

    def on_node(self, node: int) -> List[int]:
        return [index for index in range(self.count) if self.node(index) == node]


def _visible(gpus: List[Tuple[str, int]], visible: str) -> List[Tuple[str, int]]:
    """The GPUs CUDA_VISIBLE_DEVICES shows, in its order (CUDA reads it up to the first invalid
    entry)."""
    shown = []
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.startswith(("GPU-", "MIG-")):
            raise NumaBindingError(
                f"CUDA_VISIBLE_DEVICES={visible!r} names GPUs by UUID, which sysfs cannot map to PCI "
                "devices; use indices (in PCI bus id order)"
            )
        if not entry.isdigit() or int(entry) >= len(gpus):
            break
        shown.append(gpus[int(entry)])
    return shown


def _cpus_for(topology: _Topology, devices: _Devices, mode: AffinityMode, device: int) -> Set[int]:
    node = devices.node(device)
    cpus = topology.nodes[node]
    if not cpus:
        raise NumaBindingError(
            f"{devices.name(device)} is on NUMA node {node}, which has none of the CPUs this process may "
            f"use (node {node}: {format_cpu_list(topology.all_node_cpus(node)) or 'no CPUs'}; "
            f"allowed: {format_cpu_list(topology.allowed)})"
        )
    if mode is AffinityMode.NODE:
        return set(cpus)
    if mode is AffinityMode.SOCKET:
        socket = topology.package(min(cpus))
        return {
            cpu
            for node_cpus in topology.nodes.values()
            if node_cpus and topology.package(min(node_cpus)) == socket
            for cpu in node_cpus
        }
    peers = devices.on_node(node)
    position = peers.index(device)
    if mode is AffinityMode.EXCLUSIVE:
        cores = _groups(cpus, topology.core)
        per_device, extra = divmod(len(cores), len(peers))
        if per_device < 1:
            raise NumaBindingError(
                f"NUMA node {node} has {len(cores)} physical core(s) this process may use for {len(peers)} "
                f"devices ({', '.join(devices.name(peer) for peer in peers)}): exclusive needs one each"
            )
        start = position * per_device + min(position, extra)
        end = start + per_device + (1 if position < extra else 0)
        return {cpu for _, core in cores[start:end] for cpu in core}
    complexes = sorted(_groups(cpus, topology.cache_group), key=lambda group: (-len(group[1]), group[0]))
    return set(complexes[position % len(complexes)][1])


def _groups(cpus: Iterable[int], key: Callable[[int], int]) -> List[Tuple[int, Set[int]]]:
    """``cpus`` grouped by ``key``, in key order."""
    groups: Dict[int, Set[int]] = {}
    for cpu in cpus:
        groups.setdefault(key(cpu), set()).add(cpu)
    return sorted(groups.items())


__all__ = [
    "AffinityMode",
    "NumaOptions",
    "NumaBindingError",
    "MODES",
    "SYSFS_ROOT_VAR",
    "numa_options",
    "agent_binding",
    "cpus_per_local_rank",
    "parse_cpu_list",
    "format_cpu_list",
]
