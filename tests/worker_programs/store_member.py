"""A worker that uses its job's store: reports its start (round, rank, pid, the workers' store
address) to $OUT_DIR, writes a key to the workers' store with an elastix client (which proves
the job secret when the agent gave it one), then works until $OUT_DIR/stop exists. It first
copies the environment it started with to $OUT_DIR/environ_<pid>: once it loads the secret it
is undumpable, and only root may read its /proc/<pid>/environ then."""

import json
import os
import time

out = os.environ["OUT_DIR"]
with open("/proc/self/environ", "rb") as f, open(os.path.join(out, f"environ_{os.getpid()}"), "wb") as copy:
    copy.write(f.read())

import elastix  # noqa: E402  (after the copy: the secret makes this process undumpable)

rank = int(os.environ["RANK"])
store = elastix.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=30)
store.set(f"member/{rank}", "here")
record = {
    "round": int(os.environ["ELASTIX_ROUND"]),
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "group_rank": int(os.environ["GROUP_RANK"]),
    "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
    "pid": os.getpid(),
    "master": [os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])],
}
path = os.path.join(out, f"start_{record['round']}_{rank}_{os.getpid()}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(out, "stop")):
    if time.monotonic() > deadline:
        raise SystemExit("the test never asked this worker to stop")
    time.sleep(0.05)
