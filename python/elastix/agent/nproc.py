"""``--nproc-per-node``: an integer, or a count of this machine's CPUs or GPUs, found without
importing torch.

``cpu`` and ``auto`` count the CPUs this process may really use: its affinity mask and its
cgroup's CPU quota (torch uses ``os.cpu_count()``, which in a container limited to 2 CPUs of a
64-core host starts 64 workers).
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional

CHOICES = ("auto", "cpu", "gpu", "xpu")
CGROUP_ROOT = "/sys/fs/cgroup"


def resolve_nproc(value: str, cgroup_root: str = CGROUP_ROOT) -> int:
    """The number of workers for a ``--nproc-per-node`` value; ValueError with a clear message
    for anything else."""
    text = str(value).strip()
    try:
        count = int(text)
    except ValueError:
        pass
    else:
        if count < 1:
            raise ValueError(f"--nproc-per-node must be at least 1, got {count}")
        return count
    kind = text.lower()
    if kind == "cpu":
        return usable_cpu_count(cgroup_root)
    if kind == "gpu":
        gpus = gpu_count()
        if not gpus:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            seen = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
            raise ValueError(
                f"--nproc-per-node gpu: no NVIDIA GPU found (`nvidia-smi -L` listed none{seen}); "
                "give a number of workers instead"
            )
        return gpus
    if kind == "xpu":
        xpus = xpu_count()
        if not xpus:
            raise ValueError(
                "--nproc-per-node xpu: elastix counts Intel GPUs from ZE_AFFINITY_MASK only "
                "(it does not import torch), and it is not set; give a number of workers instead"
            )
        return xpus
    if kind == "auto":
        return gpu_count() or usable_cpu_count(cgroup_root)
    raise ValueError(f"--nproc-per-node: {value!r} is not a positive integer or one of {', '.join(CHOICES)}")


def usable_cpu_count(cgroup_root: str = CGROUP_ROOT) -> int:
    """CPUs in this process's affinity mask, capped by its cgroup CPU quota (rounded up)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_limit(cgroup_root)
    if quota is not None:
        count = min(count, quota)
    return max(1, count)


def cgroup_cpu_limit(cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> Optional[int]:
    """The tightest CPU quota on this process's cgroup and its ancestors (v2 ``cpu.max`` or v1
    ``cpu.cfs_quota_us``), as whole CPUs rounded up; None when unlimited or unreadable."""
    limits: List[float] = []
    for directory in _cgroup_dirs(cgroup_root, proc_cgroup):
        limit = _read_v2(os.path.join(directory, "cpu.max"))
        if limit is None:
            limit = _read_v1(directory)
        if limit is not None:
            limits.append(limit)
    if not limits:
        return None
    return max(1, math.ceil(min(limits) - 1e-9))


def _cgroup_dirs(root: str, proc_cgroup: str) -> List[str]:
    """This process's cgroup directories from the leaf up to the mount root, for v2 and the v1
    cpu controller. In a container the cgroup namespace makes the path "/", so the root alone is
    what counts; a path not visible under the mount also falls back to the root."""
    relative: Dict[str, str] = {}
    try:
        with open(proc_cgroup) as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                _, controllers, path = parts
                if controllers == "":
                    relative[root] = path
                elif "cpu" in controllers.split(","):
                    for mount in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
                        if os.path.isdir(os.path.join(root, mount)):
                            relative[os.path.join(root, mount)] = path
                            break
    except OSError:
        pass
    if not relative:
        relative[root] = "/"
    dirs: List[str] = []
    for mount, path in relative.items():
        path = path.strip("/")
        while path:
            candidate = os.path.join(mount, path)
            if os.path.isdir(candidate):
                dirs.append(candidate)
            path = os.path.dirname(path)
        dirs.append(mount)
    return dirs


def _read_v2(path: str) -> Optional[float]:
    try:
        with open(path) as f:
            quota, _, period = f.read().strip().partition(" ")
    except OSError:
        return None
    if quota == "max" or not period:
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def _read_v1(directory: str) -> Optional[float]:
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota = int(f.read().strip())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:  # -1: unlimited
        return None
    return quota / period


def gpu_count() -> Optional[int]:
    """NVIDIA GPUs this process would see (``nvidia-smi -L``, narrowed by
    ``CUDA_VISIBLE_DEVICES`` as CUDA narrows it); None when neither says anything."""
    physical = _nvidia_smi_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return physical
    return _count_visible(visible, physical)


def _count_visible(visible: str, physical: Optional[int]) -> int:
    """CUDA reads the list up to its first invalid entry: an index out of range, a negative or
    malformed one. UUIDs (GPU-..., MIG-...) are taken as valid."""
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.startswith(("GPU-", "MIG-")):
            count += 1
            continue
        try:
            index = int(entry)
        except ValueError:
            break
        if index < 0 or (physical is not None and index >= physical):
            break
        count += 1
    if physical is not None:
        count = min(count, physical)
    return count


def _nvidia_smi_count() -> Optional[int]:
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def xpu_count() -> Optional[int]:
    """Intel GPUs named by ``ZE_AFFINITY_MASK`` (Level Zero's device list), if it is set."""
    mask = os.environ.get("ZE_AFFINITY_MASK", "").strip()
    if not mask:
        return None
    # "0,1" or "0.0,0.1" (sub-devices): one worker per entry
    return len([entry for entry in mask.split(",") if entry.strip()])
