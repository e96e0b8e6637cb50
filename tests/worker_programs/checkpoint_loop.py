"""A data-parallel loop that saves through elastix.checkpoint every step, for the tests of
checkpoints held by peers. Rank r's state at step s is a known array (`state_of`), so a
restore is checked bit for bit; each start is reported to $OUT_DIR/start_<round>_<rank>_<pid>.json
with what was restored (step, from where, whose state, whether every byte matched), every
step is logged to $OUT_DIR/steps_<round>_<rank>.txt, and the ranks stop together once
$OUT_DIR/stop exists (or 180 s pass). With REPLICATED=1 every rank's state is rank 0's (plain
data parallelism, replicas), else each rank's is its own (sharded)."""

import json
import os
import time
import zlib

import numpy as np

import elastix
import elastix.collectives as ec

FLOATS = 128 * 1024  # 1 MiB of float64 per rank
REPLICATED = os.environ.get("REPLICATED") == "1"


def state_of(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng([0 if REPLICATED else rank, step]).random(FLOATS)


out = os.environ["OUT_DIR"]
rank = int(os.environ["RANK"])
round_ = int(os.environ["ELASTIX_ROUND"])
ckpt = elastix.checkpoint.open()
state = ckpt.load()
exact = state is None or (
    np.array_equal(state["w"], state_of(ckpt.source_rank, ckpt.step)) and int(state["step"]) == ckpt.step
)
record = {
    "round": round_,
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "pid": os.getpid(),
    "host": os.environ.get("ELASTIX_COLLECTIVES_HOST_ID"),
    "step": ckpt.step,
    "source": ckpt.source,
    "source_rank": ckpt.source_rank,
    "exact": bool(exact),
    "crc32": None if state is None else zlib.crc32(state["w"].tobytes()),
}
path = os.path.join(out, f"start_{round_}_{rank}_{os.getpid()}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)

ec.init_process_group()
steps = open(os.path.join(out, f"steps_{round_}_{rank}.txt"), "a", buffering=1)
deadline = time.monotonic() + 180
flag = np.zeros(1)
step = 0 if state is None else ckpt.step + 1
while True:
    if time.monotonic() > deadline:
        raise SystemExit("the test never asked this worker to stop")
    flag[0] = float(os.path.exists(os.path.join(out, "stop")))
    ec.all_reduce(flag)  # every rank leaves after the same step
    ckpt.save(step, {"w": state_of(rank, step), "step": np.int64(step)})
    steps.write(f"{time.time():.3f} {step}\n")
    if flag[0] > 0:
        break
    step += 1
    time.sleep(0.05)
ec.barrier()
ec.destroy_process_group()
