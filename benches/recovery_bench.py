"""Control-plane recovery benchmark: time from a fault to the job running again, for
`elastix run` and, where torch is installed, `torchrun` in the same scenario.

* blip: a standalone store (`elastix store`) is SIGKILLed and restarted on the same port
  while two nodes run; time from the kill to both nodes' workers running again.
* host-loss: three nodes with `--rdzv-endpoint a,b,c`; the agent hosting the store is
  SIGKILLed; time from the kill to the two survivors' workers running. torchrun takes one
  endpoint, hosted by that node: the same kill ends its job ("no recovery").
* partition: three nodes in network namespaces on a bridge; one node's link goes down and
  comes back. Times: from the cut to the two others running without it, and from the heal to
  all three running again (needs root and iproute2; skipped otherwise).

Nodes count as lost after keep_alive_interval x keep_alive_max_attempt (here 0.5 s x 2 = 1 s,
flags below); the target is recovery within 2 s plus that.

    python benches/recovery_bench.py [--repeat 3] [--keep-alive 0.5] [--max-attempt 2]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from netns import Hosts

# Works until $OUT_DIR/stop; each start leaves a record with its wall-clock time.
WORKER = r"""
import json, os, time
out = os.environ["OUT_DIR"]
record = {"t": time.time(), "world_size": int(os.environ["GROUP_WORLD_SIZE"]), "pid": os.getpid()}
with open(os.path.join(out, f".start_{os.getpid()}"), "w") as f:
    json.dump(record, f)
os.replace(os.path.join(out, f".start_{os.getpid()}"), os.path.join(out, f"start_{os.getpid()}.json"))
deadline = time.monotonic() + 300
while not os.path.exists(os.path.join(out, "stop")) and time.monotonic() < deadline:
    time.sleep(0.02)
"""

NO_RECOVERY = "no recovery"
# torchrun's behaviour found by the fault injection of issue 10, shown where torch is not
# installed to measure it again: its store client never reconnects, and its store lives and
# dies with the endpoint's agent.
UNMEASURED = {
    "store blip": f"{NO_RECOVERY} (reported; torch not installed here)",
    "store-host loss": f"{NO_RECOVERY} (reported; torch not installed here)",
}


def free_ports(n: int) -> list[int]:
    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


def starts(out: str) -> list[dict]:
    found = []
    for path in glob.glob(os.path.join(out, "start_*.json")):
        with open(path) as f:
            found.append(json.load(f))
    return found


def running_again(out: str, world_size: int, after: float, within: float) -> float | None:
    """Seconds from `after` until `world_size` workers of a `world_size`-node round started
    after it, or None if that did not happen within `within` s."""
    deadline = time.time() + within
    while time.time() < deadline:
        fresh = sorted(r["t"] for r in starts(out) if r["t"] > after and r["world_size"] == world_size)
        if len(fresh) >= world_size:
            return fresh[world_size - 1] - after
        time.sleep(0.01)
    return None


def wait_running(out: str, world_size: int, within: float = 60) -> None:
    if running_again(out, world_size, 0, within) is None:
        raise RuntimeError(f"the job never ran on {world_size} nodes")


class Job:
    """Agents of one scenario, stopped and reaped at the end whatever happened."""

    def __init__(self, out: str):
        self.out, self.procs = out, []

    def start(self, argv: list[str]) -> subprocess.Popen:
        env = {**os.environ, "OUT_DIR": self.out}
        log = open(os.path.join(self.out, f"agent{len(self.procs)}.log"), "w")
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        open(os.path.join(self.out, "stop"), "w").close()
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def elastix_args(nnodes: str, endpoint: str, addr: str, conf: str, script: str, extra: str = "") -> list[str]:
    return [
        *("run", "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", endpoint, "--rdzv-id", "bench", "--local-addr", addr),
        *("--rdzv-conf", conf + extra, script),
    ]


def torchrun_args(nnodes: str, endpoint: str, addr: str, conf: str, script: str, extra: str = "") -> list[str]:
    return [
        *("--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", endpoint, "--rdzv-id", "bench", "--local-addr", addr),
        *("--rdzv-conf", conf + extra, "--max-restarts", "3", script),
    ]


def blip(launcher: list[str], args, conf: str, script: str, out: str) -> float | None:
    (port,) = free_ports(1)
    store_cmd = [sys.executable, "-m", "elastix", "store", "--host", "127.0.0.1", "--port", str(port)]
    job = Job(out)
    store = subprocess.Popen(store_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        for i in (1, 2):
            job.start([*launcher, *args("2", f"127.0.0.1:{port}", f"127.0.0.{i}", conf, script, ",is_host=false")])
        wait_running(out, 2)
        fault = time.time()
        store.kill()
        store.wait()
        store = subprocess.Popen(store_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return running_again(out, 2, fault, 30)
    finally:
        job.close()
        store.kill()
        store.wait()


def host_loss(launcher: list[str], args, conf: str, script: str, out: str, sites: bool) -> float | None:
    ports = free_ports(3)
    endpoint = ",".join(f"127.0.0.{i + 1}:{p}" for i, p in enumerate(ports)) if sites else f"127.0.0.1:{ports[0]}"
    job = Job(out)
    try:
        agents = [job.start([*launcher, *args("2:3", endpoint, f"127.0.0.{i}", conf, script)]) for i in (1, 2, 3)]
        wait_running(out, 3)
        fault = time.time()
        os.killpg(agents[0].pid, signal.SIGKILL)
        agents[0].wait()
        return running_again(out, 2, fault, 30)
    finally:
        job.close()


def partition(launcher: list[str], args, conf: str, script: str, out: str) -> tuple[float | None, float | None]:
    hosts = Hosts(3)
    job = Job(out)
    try:
        endpoint = f"{hosts.addr(0)}:29400"
        for i in range(3):
            job.start(hosts.command(i, *launcher, *args("2:3", endpoint, hosts.addr(i), conf, script)))
        wait_running(out, 3)
        cut = time.time()
        hosts.cut(2)
        majority = running_again(out, 2, cut, 30)
        healed = time.time()
        hosts.heal(2)
        back = running_again(out, 3, healed, 60)
        return majority, back
    finally:
        job.close()
        hosts.close()


def show(seconds: list[float | None]) -> str:
    if any(s is None for s in seconds):
        return NO_RECOVERY
    return f"{statistics.median(seconds):6.2f} s (min {min(seconds):.2f}, max {max(seconds):.2f})"  # type: ignore[type-var]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep-alive", type=float, default=0.5, help="keep_alive_interval, seconds")
    parser.add_argument("--max-attempt", type=int, default=2, help="keep_alive_max_attempt")
    opts = parser.parse_args()
    lost_after = opts.keep_alive * opts.max_attempt
    conf = (
        f"keep_alive_interval={opts.keep_alive}s,keep_alive_max_attempt={opts.max_attempt},"
        "heartbeat_timeout=1s,last_call_timeout=500ms,join_timeout=60s"
    )
    elastix = [sys.executable, "-m", "elastix"]
    torchrun = shutil.which("torchrun")
    why_no_netns = Hosts.available()
    print(f"nodes count as lost after {lost_after:.1f} s without a heartbeat; target: {2 + lost_after:.1f} s")
    rows: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)

        def runs(scenario, *args) -> list:
            results = []
            for _ in range(opts.repeat):
                out = tempfile.mkdtemp(dir=tmp)
                results.append(scenario(*args, out))
            return results

        rows["store blip"] = {"elastix": show(runs(blip, elastix, elastix_args, conf, script))}
        rows["store-host loss"] = {
            "elastix": show(runs(lambda *a: host_loss(*a, sites=True), elastix, elastix_args, conf, script))
        }
        if torchrun:
            rows["store blip"]["torchrun"] = show(runs(blip, [torchrun], torchrun_args, conf, script))
            rows["store-host loss"]["torchrun"] = show(
                runs(lambda *a: host_loss(*a, sites=False), [torchrun], torchrun_args, conf, script)
            )
        if why_no_netns is None:
            both = runs(partition, elastix, elastix_args, conf, script)
            rows["partition: majority re-formed"] = {"elastix": show([m for m, _ in both])}
            rows["partition heal: all back"] = {"elastix": show([b for _, b in both])}
    print(f"\n{'scenario':32} {'elastix':36} torchrun")
    for scenario, row in rows.items():
        peer = row.get("torchrun", UNMEASURED.get(scenario, "not measured (torch not installed)"))
        print(f"{scenario:32} {row['elastix']:36} {peer}")
    if why_no_netns:
        print(f"partition: skipped ({why_no_netns})")


if __name__ == "__main__":
    main()
