"""Rendezvous benchmark: time for N simulated nodes to complete one round against one store.

elastix: `elastix-rdzv-bench` (N handlers as tasks, each with its own store connection and
presence listener, split over processes of 5,000; each leaves once it has its rank), against
an elastix-store process. torch (when installed): N DynamicRendezvousHandlers with the c10d backend,
each with its own TCPStore client, as threads split over two processes, against one torch
TCPStore server; min_nodes = max_nodes = N, as in reference/baselines.md.

    python benches/rendezvous_bench.py [--nodes 16 128 1024 10000] [--torch-max-nodes 128]

`--backend etcd`: the same round on a 3-member etcd cluster on loopback (Debian's etcd-server,
started here in a temporary directory), next to the c10d backend, with the etcd requests each
node sent. "own clients" gives every node its own etcd client (its own connections, as
separate machines would); "shared client" has them share one, which leaves out the cost of
opening thousands of connections on one machine. torch's etcd rendezvous needs python-etcd and
an etcd started with --enable-v2; it is not run here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

from store_bench import Children, first_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "target", "release", "elastix-rdzv-bench")
STORE = os.path.join(REPO, "target", "release", "elastix-store")

TORCH_WORKER = r"""
import sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

port, nodes, local, run_id, start_at = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
finished = []

def node():
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id=run_id,
                                  min_nodes=nodes, max_nodes=nodes, join_timeout="600", local_addr="127.0.0.1")
    handler = create_handler(store, C10dRendezvousBackend(store, run_id), params)
    time.sleep(max(0.0, start_at - time.time()))
    handler.next_rendezvous()
    finished.append(time.time())

threads = [threading.Thread(target=node) for _ in range(local)]
for t in threads: t.start()
for t in threads: t.join()
print(max(finished), flush=True)
"""


# Each simulated node holds a presence listener besides its store connection: 5,000 nodes
# are 10,000 descriptors, half this machine's open-file limit for one process. An etcd client
# of its own holds a connection to each of the 3 members.
NODES_PER_PROCESS = {"c10d": 5000, "etcd": 2500}
# each round its own run ID: one etcd cluster serves several rounds of the same size, and a
# round entering another's run would wait for that run's nodes to be lost
ROUNDS = itertools.count()


def elastix_bench(nodes: int, *extra: str) -> dict:
    """One round of `nodes` nodes, split over processes of at most NODES_PER_PROCESS that all
    join at one agreed moment; against an elastix-store process of its own (c10d) unless
    `extra` names an etcd cluster. On c10d each node leaves once it has its rank (see
    benches/rendezvous/src/main.rs): members' heartbeat and watcher connections (3 per node)
    would take 10,000 nodes past the store's open-file limit, and are no part of the round.
    On etcd they stay (a node that leaves revokes its lease, which the others would see as a
    departure), each process on a runtime of 2 threads."""
    # always: a stale binary would measure old code (cargo does nothing when it is current)
    build = ["cargo", "build", "--release", "-q", "-p", "elastix-rdzv-bench", "-p", "elastix-store"]
    subprocess.run(build, cwd=REPO, check=True)
    children = Children()
    try:
        backend = "etcd" if "--etcd" in extra else "c10d"
        if backend == "c10d":
            store = children.start([STORE, "--host", "127.0.0.1", "--port", "0", "--log-level", "warn"])
            port = int(first_line(children, store, "elastix-store", 30).rsplit(":", 1)[1])
            extra = ("--endpoint", f"127.0.0.1:{port}", "--threads", "1", "--leave-after-rank", *extra)
        per_process = NODES_PER_PROCESS[backend]
        counts = [per_process] * (nodes // per_process) + [nodes % per_process]
        start_at = time.time() + 1.0 + nodes / 2000  # every handler is made before the start
        run_id = f"bench-{nodes}-{os.getpid()}-{next(ROUNDS)}"
        common = ["--nodes", str(nodes), "--run-id", run_id, "--start-at", str(start_at), *extra]
        procs = [children.start([BENCH, *common, "--here", str(here)]) for here in counts if here]
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"elastix-rdzv-bench failed:\n{children.stderr_of(proc)[-2000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        children.stop_all()
    per_node = {
        key: sum(r.get(key, 0) * here for r, here in zip(results, counts)) / nodes
        for key in ("requests_per_node", "shed_per_node", "renewals_per_node")
    }
    return {"seconds": max(r["finished_at"] for r in results) - start_at, **per_node}


def elastix_round(nodes: int) -> float:
    return elastix_bench(nodes)["seconds"]


def etcd_main(node_counts: list[int], members: int, modes: list[str], elections_ms: tuple[int, int]) -> None:
    import tempfile

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from etcd_cluster import EtcdCluster

    extra = {"own": (), "shared": ("--shared-client",)}
    with tempfile.TemporaryDirectory() as data:
        cluster = EtcdCluster(data, members=members, elections_ms=elections_ms)
        try:
            print(f"etcd: {members} members, heartbeat {elections_ms[0]} ms, election timeout {elections_ms[1]} ms")
            print(
                f"{'nodes':>6} | {'c10d s':>8} | "
                + " | ".join(
                    f"etcd, {m} client(s): s, requests/node (shed, renewals), log entries/node, elections"
                    for m in modes
                )
            )
            for nodes in node_counts:
                cells = [f"{elastix_round(nodes):>8.3f}"]
                for mode in modes:
                    term, index = raft_position(cluster)
                    try:
                        r = elastix_bench(nodes, "--etcd", cluster.endpoints, *extra[mode])
                        cells.append(
                            f"{r['seconds']:.3f} s, {r['requests_per_node']:.2f} "
                            f"({r['shed_per_node']:.2f}, {r['renewals_per_node']:.2f})"
                        )
                    except RuntimeError as err:  # a round that failed: say so, measure the rest
                        print(f"etcd, {mode} clients, {nodes} nodes failed: {err}", file=sys.stderr)
                        cells.append("failed")
                    term_after, index_after = raft_position(cluster)
                    cells[-1] += f", {(index_after - index) / nodes:.2f}, {term_after - term}"
                print(f"{nodes:>6} | " + " | ".join(cells), flush=True)
        finally:
            cluster.close()


def raft_position(cluster) -> tuple[int, int]:
    """The cluster's Raft term and the last index of its log: each election during a round adds
    one to the term, each entry (a write, a lease granted or revoked; reads are none) one to the
    index (a member that does not answer within 30 s counts as none)."""
    deadline = time.monotonic() + 30
    while True:
        found = [s for i in range(len(cluster.names)) if (s := cluster.status(i))]
        if found or time.monotonic() > deadline:
            return (
                max((int(s.get("raftTerm", 0)) for s in found), default=0),
                max((int(s.get("raftIndex", 0)) for s in found), default=0),
            )
        time.sleep(0.5)


def torch_round(nodes: int, use_libuv: bool) -> float:
    """N handlers split over two processes; the store server runs in a third.

    torch's libuv server resolves every client's address (reverse DNS) on its only thread;
    where the resolver is unreachable (sandboxes, air-gapped clusters) that stalls it for
    seconds and the rendezvous times out. So the legacy server is the default here."""
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch.distributed as d, time; from datetime import timedelta; "
            f"s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, use_libuv={use_libuv}, "
            "timeout=timedelta(seconds=600)); print(s.port, flush=True); time.sleep(3600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    workers = []
    try:
        port = int(server.stdout.readline())
        start_at = time.time() + 3.0 + nodes / 100  # every handler is built before the start
        run_id = f"bench-{nodes}-{os.getpid()}"
        for local in (nodes - nodes // 2, nodes // 2):
            workers.append(
                subprocess.Popen(
                    [sys.executable, "-c", TORCH_WORKER, str(port), str(nodes), str(local), run_id, str(start_at)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        ends = []
        for worker in workers:
            out, err = worker.communicate(timeout=900)
            if worker.returncode != 0:
                raise RuntimeError(f"torch rendezvous worker failed:\n{err[-2000:]}")
            ends.append(float(out))
        return max(ends) - start_at
    finally:
        for proc in [server, *workers]:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 128, 1024, 10000])
    parser.add_argument("--torch-max-nodes", type=int, default=128, help="skip torch above this (it is slow)")
    parser.add_argument("--torch-libuv", action="store_true", help="torch's store on its libuv server")
    parser.add_argument("--backend", choices=["c10d", "etcd"], default="c10d")
    parser.add_argument("--etcd-members", type=int, default=3, help="members of the etcd cluster (--backend etcd)")
    parser.add_argument(
        "--etcd-clients",
        default="own,shared",
        help="which etcd rounds to run (--backend etcd): own (a client per node), shared (one client), or both",
    )
    parser.add_argument(
        "--etcd-elections-ms",
        default="100,1000",
        help="the members' heartbeat interval and election timeout (default: etcd's own; with the tests' "
        "50,500, overloaded members elected new leaders mid-round at 10,000 nodes, and 1 round in 4 failed)",
    )
    args = parser.parse_args()
    if args.backend == "etcd":
        heartbeat, _, election = args.etcd_elections_ms.partition(",")
        if not (heartbeat.isdigit() and election.isdigit()):
            parser.error(f"--etcd-elections-ms: two whole numbers of milliseconds, got {args.etcd_elections_ms!r}")
        modes = [m for m in args.etcd_clients.split(",") if m]
        if not modes or any(m not in ("own", "shared") for m in modes):
            parser.error(f"--etcd-clients: a list of own and shared, got {args.etcd_clients!r}")
        etcd_main(args.nodes, args.etcd_members, modes, (int(heartbeat), int(election)))
        return
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
        print("torch is not installed: elastix figures only (pip install -e '.[bench]' for the comparison)")
    print(f"{'nodes':>6} | {'elastix s':>10} | {'torch s':>12} | {'speed-up':>10}", flush=True)
    for nodes in args.nodes:
        ours = elastix_round(nodes)
        theirs, ratio = "-", "-"
        if have_torch and nodes <= args.torch_max_nodes:
            try:
                seconds = torch_round(nodes, args.torch_libuv)
                theirs, ratio = f"{seconds:.3f}", f"{seconds / ours:.1f}x"
            except RuntimeError as err:  # torch's join_timeout (600 s) passed
                print(f"torch at {nodes} nodes: {str(err).splitlines()[-1]}", file=sys.stderr)
                theirs, ratio = "> 600 (timeout)", f"> {600 / ours:.0f}x"
        print(f"{nodes:>6} | {ours:>10.3f} | {theirs:>12} | {ratio:>10}", flush=True)


if __name__ == "__main__":
    main()
