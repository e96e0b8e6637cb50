"""RPC benchmark: elastix.rpc side by side with torch.distributed.rpc (TensorPipe), two
processes on this machine.

* latency: `rpc_sync` round trip of a no-op (median of rounds, per call).
* throughput: `rpc_async` calls with a 1 KiB and a 1 MiB NumPy array argument (the callee
  returns its length), 32 calls in flight; torch is run with the same NumPy arrays, and with
  torch tensors of the same size (TensorPipe's own path for tensors).

    python benches/rpc_bench.py [--calls 5000] [--rounds 5] [--mib-calls 400]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def noop():
    return None


def size_of(x):
    return len(x)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _latency(rpc, calls: int, rounds: int) -> float:
    for _ in range(200):
        rpc.rpc_sync("w1", noop)
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            rpc.rpc_sync("w1", noop)
        per_call.append((time.perf_counter() - start) / calls)
    return statistics.median(per_call) * 1e6


def _throughput(rpc, make, nbytes: int, calls: int, rounds: int, window: int = 32) -> float:
    arg = make(nbytes)
    for _ in range(20):
        rpc.rpc_sync("w1", size_of, args=(arg,))
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        inflight = []
        for _ in range(calls):
            inflight.append(rpc.rpc_async("w1", size_of, args=(arg,)))
            if len(inflight) >= window:
                inflight.pop(0).wait()
        for fut in inflight:
            fut.wait()
        rates.append(calls * nbytes / (time.perf_counter() - start))
    return statistics.median(rates) / 2**20


def worker(impl: str, rank: int, port: int, args) -> None:
    import numpy as np

    if impl == "torch":
        import torch
        import torch.distributed.rpc as rpc

        options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=16)
    else:
        import elastix.rpc as rpc

        options = rpc.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        numpy_array = lambda n: np.ones(n, dtype=np.uint8)  # noqa: E731
        result = {"latency_us": _latency(rpc, args.calls, args.rounds)}
        result["kib_numpy"] = _throughput(rpc, numpy_array, 1024, args.calls, args.rounds)
        result["mib_numpy"] = _throughput(rpc, numpy_array, 1 << 20, args.mib_calls, args.rounds)
        if impl == "torch":
            tensor = lambda n: torch.ones(n, dtype=torch.uint8)  # noqa: E731
            result["kib_tensor"] = _throughput(rpc, tensor, 1024, args.calls, args.rounds)
            result["mib_tensor"] = _throughput(rpc, tensor, 1 << 20, args.mib_calls, args.rounds)
        print("RESULT " + json.dumps(result), flush=True)
    rpc.shutdown()


def run_pair(impl: str, argv) -> dict:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl, "--port", str(port), *argv]
    procs = [
        subprocess.Popen([*cmd, "--worker", str(rank)], env=env, stdout=subprocess.PIPE, text=True) for rank in (0, 1)
    ]
    out = procs[0].communicate(timeout=600)[0]
    procs[1].wait(timeout=60)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{impl} run printed no result:\n{out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--mib-calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--impl", default=None)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--worker", type=int, default=None)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.impl, args.worker, args.port, args)
        return
    passthrough = ["--calls", str(args.calls), "--mib-calls", str(args.mib_calls), "--rounds", str(args.rounds)]
    ours = run_pair("elastix", passthrough)
    try:
        import torch  # noqa: F401

        theirs = run_pair("torch", passthrough)
    except ImportError:
        theirs = None
    print(f"{'':28}{'elastix':>12}{'torch':>12}{'ratio':>8}")
    print(f"{'rpc_sync no-op (us/call)':28}{ours['latency_us']:12.1f}", end="")
    print(f"{theirs['latency_us']:12.1f}{theirs['latency_us'] / ours['latency_us']:7.2f}x" if theirs else "")
    for key, label in (("kib_numpy", "rpc_async 1 KiB (MiB/s)"), ("mib_numpy", "rpc_async 1 MiB (MiB/s)")):
        print(f"{label:28}{ours[key]:12.1f}", end="")
        if theirs:
            print(
                f"{theirs[key]:12.1f}{ours[key] / theirs[key]:7.2f}x   (torch tensors: {theirs[key.replace('numpy', 'tensor')]:.1f})"
            )
        else:
            print("   (torch not installed)")
    print("ratio: torch time / elastix time (latency), elastix rate / torch rate with NumPy (throughput)")


if __name__ == "__main__":
    main()
