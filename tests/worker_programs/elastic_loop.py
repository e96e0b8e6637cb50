"""A stand-in for a training loop: reports each start (round, rank, world size, pid) to
$OUT_DIR, then works until $OUT_DIR/stop exists. `--fail-once RANK` makes that rank exit 1 in
the first attempt; `--hang` ignores SIGTERM and sleeps (a hung worker)."""

import argparse
import json
import os
import signal
import time

parser = argparse.ArgumentParser()
parser.add_argument("--fail-once", type=int, default=None)
parser.add_argument("--hang", action="store_true")
args = parser.parse_args()

out = os.environ["OUT_DIR"]
rank = int(os.environ["RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
record = {
    "round": int(os.environ["ELASTIX_ROUND"]),
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "group_rank": int(os.environ["GROUP_RANK"]),
    "restart": restart,
    "pid": os.getpid(),
}
# write then rename, so that a reader never sees a half-written file
path = os.path.join(out, f"start_{record['round']}_{rank}_{os.getpid()}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
print(f"worker rank {rank} started in round {record['round']}", flush=True)

if args.fail_once == rank and restart == 0:
    time.sleep(0.2)  # fails a moment into its work, as a real failure comes
    raise SystemExit(1)
if args.hang:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(3600)
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(out, "stop")):
    if time.monotonic() > deadline:
        raise SystemExit("the test never asked this worker to stop")
    time.sleep(0.05)
