#!/usr/bin/env python3
"""Collectives benchmark (all_reduce, or the one --op names): elastix.collectives (cpu backend)
against torch's gloo, same machine, same run. It prints figures and asserts nothing.

For each world size (local ranks, spawned as processes) and each message size it reports the
time of one collective of float32 (the slowest rank's mean over the iterations) and the bus
bandwidth (the nccl-tests definition: for all_reduce busbw = size / time x 2(p-1)/p), for elastix and, when
torch is installed (pip install -e '.[bench]'), for gloo, and the ratio. Targets: >= 2x
gloo's busbw at >= 1 MiB (design.md), and a 4 KiB all_reduce in <= 5 us on 2 local ranks
(design.md's 50 us, tightened once the roofline work showed what the exchange costs). With
CuPy and at least two GPUs it also measures the nccl backend.

The roofline: the least time the bytes a collective must move take at this machine's memory
bandwidth, in shared memory where every rank reads the others' buffers directly (N: the size
column, what each rank sends; reduce_scatter's N is its whole input):
  all_reduce      each rank reads the whole buffer (its part and the others') to reduce its 1/p
                  part, writes that part, then reads and writes the other reduced parts:
                  (3 - 1/p) N per rank (2.5 N on 2);
  reduce_scatter  each rank reads its 1/p part of every rank's input and writes it: (1 + 1/p) N;
  all_gather      each rank reads every rank's N (its own included) and writes them: 2 p N;
  broadcast       each rank but the root reads N and writes it: 2 N; the root moves nothing.
The bandwidth is what the machine's cores copy at together, as many as ranks that move bytes
(more than the cores share them), measured by benches/floors/stream.c (built here with cc) over
arrays far larger than the caches; the "roof" column is elastix's share of that bound (100%: at
the roofline). A buffer that fits in the caches can beat it: the bound is memory's.

For all_reduce, reduce_scatter and all_gather it also runs elastix with inputs made by
``elastix.collectives.shared_empty`` (the "shared" column): memory every local rank maps, which
those collectives read in place instead of copying it into the group's segment first. The two
are timed in the same ranks, in alternation (five rounds; each figure the median round).

    python benches/collectives_bench.py [--op all_reduce|broadcast|all_gather|reduce_scatter]
        [--ranks 2,4] [--max-size 256M] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_RATIO = 2.0
TARGET_SMALL_US = 5.0


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * mult[text[-1]]) if text[-1] in mult else int(text)


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def iterations(nbytes: int, budget: float) -> int:
    # a rough guess at 1 GB/s, then clamped: enough samples, bounded time
    return int(min(5000, max(5, budget / (20e-6 + nbytes / 1e9))))


# -- the worker (one per rank) ------------------------------------------------------------------


OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
#: The collectives that read inputs made by shared_empty in place (the "shared" column).
SHARED_OPS = ("all_reduce", "all_gather", "reduce_scatter")
#: Alternations of elastix's two ways of those; each variant's figure is its median round.
ROUNDS = 5


def worker(impl: str, op: str, sizes, budget: float, out: str) -> None:
    import numpy as np

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("BENCH_PIN"):  # one core per rank: this VM's slow mode never shows then
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    if impl == "gloo":
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=os.environ["BENCH_INIT"], rank=rank, world_size=world, timeout=timedelta(seconds=600)
        )
        make = lambda n: torch.ones(n, dtype=torch.float32)  # noqa: E731
        reduce_ = dist.all_reduce
        barrier = dist.barrier
        ops = dist

        def slowest(t: float) -> float:
            v = torch.tensor([t], dtype=torch.float64)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            return float(v[0])
    else:
        import elastix.collectives as ec

        ec.init_process_group("nccl" if impl == "nccl" else "cpu", timeout=timedelta(seconds=600))
        if impl == "nccl":
            import cupy

            cupy.cuda.Device(rank).use()
            make = lambda n: cupy.ones(n, dtype=cupy.float32)  # noqa: E731

            def reduce_(x):
                ec.all_reduce(x)
                cupy.cuda.get_current_stream().synchronize()
        else:
            make = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
            reduce_ = ec.all_reduce
        barrier = ec.barrier
        ops = ec

        def slowest(t: float) -> float:
            v = np.array([t])
            ec.all_reduce(v, ec.ReduceOp.MAX)
            return float(v[0])

    def collective(nbytes: int, shared: bool = False):
        """One call of `op` where each rank sends `nbytes` (reduce_scatter: in all); with
        `shared`, its inputs made by shared_empty."""
        n = nbytes // 4

        def shared_ones(shape):
            ones = ec.shared_empty(shape, np.float32)
            ones[:] = 1
            return ones

        if op == "broadcast":
            x = make(n)
            return lambda: ops.broadcast(x, 0)
        if op == "all_gather":
            x, outs = shared_ones(n) if shared else make(n), [make(n) for _ in range(world)]
            return lambda: ops.all_gather(outs, x)
        if op == "reduce_scatter":
            y = make(n // world)
            # shared: one array, as reduce_scatter_tensor's input, cut into the input list
            ins = list(shared_ones((world, n // world))) if shared else [make(n // world) for _ in range(world)]
            return lambda: ops.reduce_scatter(y, ins)
        x = shared_ones(n) if shared else make(n)
        return lambda: reduce_(x)

    # elastix's two ways of a collective that reads shared inputs are timed in alternation, a
    # fifth of the iterations at a time, so that both see the same state of the machine
    variants = ["elastix", "shared"] if impl == "elastix" and op in SHARED_OPS else [impl]
    results: dict = {v: {} for v in variants}
    for nbytes in sizes:
        calls = {v: collective(nbytes, shared=v == "shared") for v in variants}
        iters = iterations(nbytes, budget)
        rounds = ROUNDS if len(variants) > 1 else 1
        per_round = max(1, iters // rounds)
        times: dict = {v: [] for v in variants}
        for call in calls.values():
            for _ in range(max(2, iters // 10)):
                call()
        for _ in range(rounds):
            for v, call in calls.items():
                barrier()
                t0 = time.perf_counter()
                for _ in range(per_round):
                    call()
                times[v].append(slowest((time.perf_counter() - t0) / per_round))
        for v in variants:
            results[v][nbytes] = sorted(times[v])[len(times[v]) // 2]
        del calls
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


# -- the driver ------------------------------------------------------------------------------------


def reserved_port() -> socket.socket:
    """A port for gloo's tcp:// rendezvous, held by a bound, non-listening SO_REUSEADDR socket
    until the run ends: rank 0's store (which binds with SO_REUSEADDR) can take it, nobody
    else can, so there is no race between choosing the port and binding it."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    return holder


def run_impl(impl: str, op: str, world: int, sizes, budget: float, timeout: float, pin: bool = False):
    """Spawns ``world`` ranks of ``impl``; returns {variant: {size: seconds}} (the variants:
    ``impl``, and elastix's "shared" where it has one) or None (and why)."""
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    env = dict(
        os.environ,
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
        GROUP_RANK="0",
    )
    if pin:
        env["BENCH_PIN"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")])
    store = port_holder = None
    if impl == "gloo":
        port_holder = reserved_port()
        env["BENCH_INIT"] = f"tcp://127.0.0.1:{port_holder.getsockname()[1]}"
    else:
        import elastix

        store = elastix.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=600))
        env.update(MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        impl,
        "--op",
        op,
        "--sizes",
        ",".join(map(str, sizes)),
        "--budget",
        str(budget),
        "--out",
        out,
    ]
    procs = []
    try:
        for r in range(world):
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                    stdin=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        errors = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return None, "timed out"
            if p.returncode:
                errors.append(err[-1500:])
        if errors:
            return None, errors[0]
        with open(out) as f:
            return {v: {int(k): t for k, t in r.items()} for v, r in json.load(f).items()}, None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        os.unlink(out)
        if port_holder is not None:
            port_holder.close()


def copy_bandwidth(cores: int) -> dict[int, float]:
    """GB/s 1..`cores` cores copy at together (STREAM's count: read + write); empty if unknown."""
    source = REPO / "benches" / "floors" / "stream.c"
    binary = Path(tempfile.mkdtemp(prefix="elastix-stream-")) / "stream"
    try:
        subprocess.run(["cc", "-O2", "-pthread", "-o", str(binary), str(source)], check=True, capture_output=True)
        done = subprocess.run([str(binary), "256", str(cores)], check=True, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as err:
        print(f"  no roofline ({err})")
        return {}
    finally:
        shutil.rmtree(binary.parent, ignore_errors=True)
    found = (json.loads(line) for line in done.stdout.splitlines())
    return {int(f["cores"]): float(f["total_gbs"]) for f in found if f["kernel"] == "copy"}


def bytes_per_rank(op: str, nbytes: int, world: int) -> list[float]:
    """What each rank must read and write for `op` of `nbytes` (the docstring's model)."""
    p = world
    if op == "broadcast":  # the root is rank 0
        return [0.0] + [2.0 * nbytes] * (p - 1)
    per_rank = {"reduce_scatter": 1 + 1 / p, "all_gather": 2.0 * p}.get(op, 3 - 1 / p)
    return [per_rank * nbytes] * p


def roofline_s(op: str, nbytes: int, world: int, gbs: dict[int, float]) -> float | None:
    """The least time `op` of `nbytes` on `world` ranks takes when the ranks that move bytes copy
    at the bandwidth that many cores get together (`gbs`, by core count)."""
    moved = [b for b in bytes_per_rank(op, nbytes, world) if b > 0]
    cores = min(len(moved), max(gbs, default=0))
    return sum(moved) / (gbs[cores] * 1e9) if cores in gbs else None


def busbw(nbytes: int, seconds: float, world: int, op: str = "all_reduce") -> float:
    """nccl-tests' bus bandwidth: the algorithm's bandwidth times what each link carries."""
    factor = {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0}.get(op, (world - 1) / world)
    return nbytes / seconds * factor / 1e9


def gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--min-size", default="4K")
    ap.add_argument("--max-size", default="256M")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds of timed work per size")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--op", choices=OPS, default="all_reduce", help="the collective")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="pin rank i to core i mod cores: steadier figures on a VM whose scheduler may stack "
        "both ranks on one vCPU (what `elastix run --numa-binding exclusive` does); small messages "
        "then wait out each vCPU's steal time",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.op, [int(s) for s in args.sizes.split(",")], args.budget, args.out)
        return 0

    sizes, s = [], parse_size(args.min_size)
    while s <= parse_size(args.max_size):
        sizes.append(s)
        s *= 4
    have_torch = not args.no_torch and importlib.util.find_spec("torch") is not None
    impls = ["elastix"] + (["gloo"] if have_torch else [])
    op = args.op
    if gpu_count() >= 2:
        impls.append("nccl")
    print(
        f"{op} float32, local ranks, {os.cpu_count()} CPUs; load average "
        f"{os.getloadavg()[0]:.2f}; impls: {', '.join(impls)}"
        + (" (elastix also on shared inputs, alternated)" if op in SHARED_OPS else "")
        + ("" if have_torch else " (torch not installed)")
    )
    report = {}
    for world in [int(w) for w in args.ranks.split(",")]:
        figures = {}
        for impl in impls:
            if impl == "nccl" and world > gpu_count():
                continue
            result, why = run_impl(impl, op, world, sizes, args.budget, args.timeout, args.pin)
            if result is None:
                print(f"  {impl} with {world} ranks failed: {why}")
                continue
            figures.update(result)
        report[world] = figures
        cores = min(world, os.cpu_count() or world)
        gbs = copy_bandwidth(cores)
        bandwidth = f"; {cores} cores copy at {gbs[cores]:.1f} GB/s together (stream.c)" if cores in gbs else ""
        print(f"\n{world} ranks{bandwidth}")
        head = f"{'size':>9} | {'elastix':>10} {'busbw':>9} {'roof':>5}"
        if "shared" in figures:
            head += f" | {'shared':>10} {'busbw':>9} {'roof':>5}"
        if "gloo" in figures:
            head += f" | {'gloo':>10} {'busbw':>9} | {'ratio':>6}"
        if "nccl" in figures:
            head += f" | {'nccl':>10} {'busbw':>9}"
        print(head)
        print("-" * len(head))
        for n in sizes:
            e = figures.get("elastix", {}).get(n)
            bound = roofline_s(op, n, world, gbs)
            roof = f"{bound / e:>5.0%}" if e and bound else f"{'-':>5}"
            line = f"{human(n):>9} | " + (
                f"{e * 1e6:>8.1f}us {busbw(n, e, world, op):>5.2f}GB/s {roof}" if e else f"{'-':>26}"
            )
            if "shared" in figures:
                d = figures["shared"].get(n)
                droof = f"{bound / d:>5.0%}" if d and bound else f"{'-':>5}"
                line += f" | {d * 1e6:>8.1f}us {busbw(n, d, world, op):>5.2f}GB/s {droof}" if d else f" | {'-':>26}"
            if "gloo" in figures:
                g = figures["gloo"].get(n)
                line += f" | {g * 1e6:>8.1f}us {busbw(n, g, world, op):>5.2f}GB/s | {g / e:>5.2f}x" if g and e else ""
            if "nccl" in figures:
                c = figures["nccl"].get(n)
                line += f" | {c * 1e6:>8.1f}us {busbw(n, c, world, op):>5.2f}GB/s" if c else ""
            print(line)
        e = figures.get("elastix", {})
        if world == 2 and 4096 in e:
            verdict = "meets" if e[4096] * 1e6 <= TARGET_SMALL_US else "misses"
            print(f"4 KiB {op}: {e[4096] * 1e6:.1f} us ({verdict} the <= {TARGET_SMALL_US:.0f} us target)")
        if "gloo" in figures:
            big = [n for n in sizes if n >= 1 << 20 and n in e and n in figures["gloo"]]
            if big:
                worst = min(figures["gloo"][n] / e[n] for n in big)
                verdict = "meets" if worst >= TARGET_RATIO else "misses"
                print(
                    f"busbw ratio vs gloo at >= 1 MiB: min {worst:.2f}x ({verdict} the >= {TARGET_RATIO:.0f}x target)"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {str(w): {i: {str(n): t for n, t in r.items()} for i, r in fig.items()} for w, fig in report.items()},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
