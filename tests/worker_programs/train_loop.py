"""A data-parallel training loop as the fault tests need one: every step is an all_reduce over
the whole world (so a peer's death breaks it at once, as in real training), and every step is
logged to $OUT_DIR/steps_<round>_<rank>.txt as "<unix time> <step>" lines, so that a test can
tell which rounds trained when. Reports each start like elastic_loop.py; works until
$OUT_DIR/stop exists (or 180 s pass); then, given $LINGER seconds (set on one node), stays
that long (the other nodes wait for it at the exit barrier).

Over network namespaces every node shares the host name, so ELASTIX_COLLECTIVES_HOST_ID (set
by the test per node) keeps the ranks of different nodes on TCP, as on real machines. With
TRAIN_RPC=1 every rank also joins elastix RPC and calls its right neighbour every 10 steps.
With COMPUTE_S=<seconds>, each step computes that long (a sleep, cut short by the stop file)
before its all_reduce: a peer's death then reaches no collective for as long."""

import json
import os
import time

import numpy as np

import elastix.collectives as ec

out = os.environ["OUT_DIR"]
rank = int(os.environ["RANK"])
record = {
    "round": int(os.environ["ELASTIX_ROUND"]),
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "group_rank": int(os.environ["GROUP_RANK"]),
    "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
    "pid": os.getpid(),
    "host": os.environ.get("ELASTIX_COLLECTIVES_HOST_ID"),
}
path = os.path.join(out, f"start_{record['round']}_{rank}_{os.getpid()}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
print(f"worker rank {rank} started in round {record['round']}", flush=True)

ec.init_process_group()
rpc = None
if os.environ.get("TRAIN_RPC") == "1":
    import operator

    import elastix.rpc as rpc

    rpc.init_rpc(f"w{rank}")
grad = np.ones(64 * 1024, np.float32)  # 256 KiB: most of a step is spent in the collective
steps = open(os.path.join(out, f"steps_{record['round']}_{rank}.txt"), "a", buffering=1)
deadline = time.monotonic() + 180
compute = float(os.environ.get("COMPUTE_S", "0"))
step = 0
while True:
    if time.monotonic() > deadline:
        raise SystemExit("the test never asked this worker to stop")
    computed = time.monotonic() + compute
    while time.monotonic() < computed and not os.path.exists(os.path.join(out, "stop")):
        time.sleep(0.05)
    grad[:] = 1.0
    # the last element carries "stop": every rank leaves after the same step
    grad[-1] = float(os.path.exists(os.path.join(out, "stop")))
    ec.all_reduce(grad)
    assert float(grad[0]) == ec.get_world_size(), (grad[0], ec.get_world_size())
    if rpc is not None and step % 10 == 0:
        right = f"w{(rank + 1) % ec.get_world_size()}"
        assert rpc.rpc_sync(right, operator.add, args=(step, 1)) == step + 1
    steps.write(f"{time.time():.3f} {step}\n")
    step += 1
    if grad[-1] > 0:
        break
if rpc is not None:
    rpc.shutdown()
time.sleep(float(os.environ.get("LINGER", "0")))
