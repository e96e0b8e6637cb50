"""What a checkpoint costs the training loop: the time `save` blocks it, and the time a
restart takes to restore, with elastix.checkpoint (a copy into shared memory; restored from
that memory) side by side with the usual way (`torch.save` of the state to a file, fsync'd as
a checkpoint that must survive has to be, and `torch.load`; `np.savez`/`np.load` where torch
is not installed). The state is `--mb` MiB of float32 arrays in a few tensors, as a model and
its optimizer state are.

    python benches/checkpoint_bench.py [--mb 256] [--runs 5] [--dir DIR]

`--dir` is where the usual way writes (default: a temporary directory on the disk that holds
this checkout); the memory is a directory of /dev/shm, as the agent makes it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

import elastix


def state(mb: int) -> dict:
    parts = 4
    n = mb * (1 << 20) // 4 // parts
    rng = np.random.default_rng(0)
    return {"model": {f"layer{i}": rng.standard_normal(n, dtype=np.float32) for i in range(parts // 2)},
            "optimizer": [rng.standard_normal(n, dtype=np.float32) for _ in range(parts // 2)], "step": 1}  # fmt: skip


def usual(directory: str):
    """save and load with torch (or NumPy), to a synced file."""
    path = os.path.join(directory, "checkpoint.pt")
    try:
        import torch

        def save(step, value):
            tensors = {"model": {k: torch.from_numpy(v) for k, v in value["model"].items()},
                       "optimizer": [torch.from_numpy(v) for v in value["optimizer"]], "step": step}  # fmt: skip
            with open(path, "wb") as f:
                torch.save(tensors, f)
                f.flush()
                os.fsync(f.fileno())

        def load():
            return torch.load(path)

        return "torch.save + fsync", save, load
    except ImportError:

        def save_np(step, value):
            with open(path, "wb") as f:
                np.savez(f, *value["model"].values(), *value["optimizer"], step=step)
                f.flush()
                os.fsync(f.fileno())

        def load_np():
            with np.load(path) as f:
                return {name: f[name] for name in f.files}

        return "np.savez + fsync", save_np, load_np


def timed(call, runs: int) -> list[float]:
    times = []
    for run in range(runs):
        start = time.perf_counter()
        call(run)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    value = state(args.mb)
    memory = tempfile.mkdtemp(prefix="elastix-ckpt-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    disk = tempfile.mkdtemp(prefix="elastix-ckpt-bench-", dir=args.dir or os.path.dirname(os.path.abspath(__file__)))
    try:
        ckpt = elastix.checkpoint.open(memory=memory)
        name, save, load = usual(disk)
        rows = {
            "save (blocks training)": (
                timed(lambda run: ckpt.save(run, value), args.runs),
                timed(lambda run: save(run, value), args.runs),
            ),
            "restore after a restart": (
                timed(lambda run: elastix.checkpoint.open(memory=memory).load(), args.runs),
                timed(lambda run: load(), args.runs),
            ),
        }
    finally:
        shutil.rmtree(memory, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    copies = memcpy(value, args.runs)
    print(f"state: {args.mb} MiB of float32; medians of {args.runs} runs (min-max)")
    print(f"{'':>24} | {'elastix.checkpoint':>22} | {name:>22} | ratio")
    for label, (ours, theirs) in rows.items():
        a, b = statistics.median(ours), statistics.median(theirs)
        print(
            f"{label:>24} | {a * 1000:>9.1f} ms ({min(ours) * 1000:.0f}-{max(ours) * 1000:.0f}) | "
            f"{b * 1000:>9.1f} ms ({min(theirs) * 1000:.0f}-{max(theirs) * 1000:.0f}) | {b / a:.1f}x faster"
        )
    save, floor = statistics.median(rows["save (blocks training)"][0]), statistics.median(copies)
    print(f"save blocks {save * 1000:.1f} ms against {floor * 1000:.1f} ms for a plain memcpy of the state into memory "
          f"already touched: {save / floor:.2f}x the floor (target: at most 1.2x)")  # fmt: skip
    sys.stdout.flush()


def memcpy(value: dict, runs: int) -> list[float]:
    """The floor of a save: the state's arrays copied into arrays already written once."""
    arrays = [*value["model"].values(), *value["optimizer"]]
    targets = [np.ones_like(array) for array in arrays]

    def copy(_run: int) -> None:
        for target, array in zip(targets, arrays):
            np.copyto(target, array)

    return timed(copy, runs)


if __name__ == "__main__":
    main()
