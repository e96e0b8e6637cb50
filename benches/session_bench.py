"""What sessions cost: every byte of an elastix-to-elastix connection travels in sealed records
after the handshake (rust/core/src/auth/session.rs): authenticated by default, encrypted with
`ELASTIX_SESSION=encrypted`. Side by side, in one run:

* store requests: an `elastix.TCPStore` client's SET + GET round trips against `elastix-store`
  on loopback, without a secret (a plain connection, as torch's clients always are), and with
  one in each session mode;
* RPC latency: `rpc_sync` of a no-op between two workers of `elastix run`, median of `--calls`;
* all_reduce over TCP: two workers of `elastix run` forced onto TCP (a host id each), a float32
  all_reduce of `--mib` MiB, bus bandwidth (size / time x 2(p-1)/p), best of `--iters`.

Runs alternate between the settings so that a slower moment of the machine falls on all.

    python benches/session_bench.py [--runs 3] [--ops 20000] [--calls 2000] [--mib 16] [--iters 10]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

STORE_CLIENT = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import elastix
    store = elastix.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
    ops = int(sys.argv[2])
    store.set("warm", b"x")
    start = time.perf_counter()
    for i in range(ops // 2):
        store.set("k", b"v" * 64)
        store.get("k")
    print(f"RESULT {(time.perf_counter() - start) / ops * 1e6:.2f}", flush=True)
    """
)

WORKER = textwrap.dedent(
    """
    import os, statistics, sys, time
    os.environ["ELASTIX_COLLECTIVES_HOST_ID"] = f"host{os.environ['LOCAL_RANK']}"  # TCP between the two
    import numpy as np
    import elastix.collectives as ec
    import elastix.rpc as rpc

    def noop():
        return None

    calls, mib, iters = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    ec.init_process_group()
    rank = ec.get_rank()
    rpc.init_rpc(f"w{rank}")
    if rank == 0:
        for _ in range(100):
            rpc.rpc_sync("w1", noop)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            rpc.rpc_sync("w1", noop)
            times.append(time.perf_counter() - start)
        print(f"RPC {statistics.median(times) * 1e6:.1f}", flush=True)
    x = np.ones(int(mib * (1 << 20) / 4), np.float32)
    ec.all_reduce(x)
    best = float("inf")
    for _ in range(iters):
        ec.barrier()
        start = time.perf_counter()
        ec.all_reduce(x)
        best = min(best, time.perf_counter() - start)
    if rank == 0:
        print(f"BUSBW {x.nbytes / best * 2 * (2 - 1) / 2 / 1e9:.3f}", flush=True)
    rpc.shutdown()
    """
)


def store_cost(workdir: str, secret: "str | None", mode: str, ops: int) -> float:
    env = {**os.environ, "ELASTIX_SESSION": mode}
    env.pop("ELASTIX_AUTH_TOKEN_FILE", None)
    argv = [sys.executable, "-m", "elastix", "store", "--host", "127.0.0.1", "--port", "0"]
    if secret:
        argv += ["--auth-token-file", secret]
        env["ELASTIX_AUTH_TOKEN_FILE"] = secret
    log = open(os.path.join(workdir, "store.log"), "w")
    server = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        port = re.search(r":(\d+)", line)
        if not port:
            raise SystemExit(f"elastix-store did not say its address: {line!r}")
        client = os.path.join(workdir, "client.py")
        with open(client, "w") as f:
            f.write(STORE_CLIENT)
        done = subprocess.run(
            [sys.executable, client, port.group(1), str(ops)], env=env, capture_output=True, text=True, timeout=600
        )
        found = re.search(r"RESULT (\S+)", done.stdout)
        if not found:
            raise SystemExit(f"the store client failed:\n{done.stdout}\n{done.stderr}")
        return float(found.group(1))
    finally:
        server.kill()
        server.wait()
        log.close()


def worker_costs(workdir: str, secret: str, mode: str, calls: int, mib: float, iters: int) -> "tuple[float, float]":
    env = {**os.environ, "ELASTIX_SESSION": mode, "ELASTIX_AUTH_TOKEN_FILE": secret}
    script = os.path.join(workdir, "worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    argv = [sys.executable, "-m", "elastix", "run", "--standalone", "--nproc-per-node", "2", script]
    done = subprocess.run(
        [*argv, str(calls), str(mib), str(iters)], env=env, capture_output=True, text=True, timeout=600
    )
    rpc, busbw = re.search(r"RPC (\S+)", done.stdout), re.search(r"BUSBW (\S+)", done.stdout)
    if done.returncode != 0 or not rpc or not busbw:
        raise SystemExit(f"the workers failed:\n{done.stdout}\n{done.stderr[-3000:]}")
    return float(rpc.group(1)), float(busbw.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ops", type=int, default=20000)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--mib", type=float, default=16.0)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="elastix-session-bench-") as workdir:
        secrets_dir = os.path.join(workdir, "secrets")
        os.mkdir(secrets_dir, 0o700)
        secret = os.path.join(secrets_dir, "job.secret")
        subprocess.run([sys.executable, "-m", "elastix", "secret", secret], check=True, capture_output=True)
        store: "dict[str, list[float]]" = {"no secret (plain)": [], "authenticated": [], "encrypted": []}
        rpc: "dict[str, list[float]]" = {"authenticated": [], "encrypted": []}
        busbw: "dict[str, list[float]]" = {"authenticated": [], "encrypted": []}
        for _ in range(args.runs):
            store["no secret (plain)"].append(store_cost(workdir, None, "authenticated", args.ops))
            for mode in ("authenticated", "encrypted"):
                store[mode].append(store_cost(workdir, secret, mode, args.ops))
                latency, bandwidth = worker_costs(workdir, secret, mode, args.calls, args.mib, args.iters)
                rpc[mode].append(latency)
                busbw[mode].append(bandwidth)
                time.sleep(0.2)
    plain = statistics.median(store["no secret (plain)"])
    print(f"median of {args.runs} runs each")
    print(f"{'':<44}{'value':>12}{'vs first':>10}")
    for label, values in store.items():
        value = statistics.median(values)
        print(f"{'store SET+GET, per request, ' + label:<44}{value:>10.1f}us{value / plain:>9.2f}x")
    first = statistics.median(rpc["authenticated"])
    for mode, values in rpc.items():
        value = statistics.median(values)
        print(f"{'rpc_sync no-op, ' + mode:<44}{value:>10.1f}us{value / first:>9.2f}x")
    first = statistics.median(busbw["authenticated"])
    for mode, values in busbw.items():
        value = statistics.median(values)
        print(f"{f'all_reduce {args.mib:g} MiB over TCP busbw, ' + mode:<44}{value:>8.3f}GB/s{value / first:>9.2f}x")


if __name__ == "__main__":
    main()
