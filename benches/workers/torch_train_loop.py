"""tests/worker_programs/train_loop.py for torchrun: the same data-parallel loop on torch.distributed
(gloo), leaving the same records ($OUT_DIR/start_<round>_<rank>_<pid>.json, one
"<unix time> <step>" line per step in steps_<round>_<rank>.txt), so that the fault matrix
judges torchrun's cells as it judges elastix's.

torchrun tells a worker nothing that names its round, so rank 0 draws one (its clock, in
microseconds: later rounds draw larger ones) and broadcasts it."""

import json
import os
import time

import torch
import torch.distributed as dist

out = os.environ["OUT_DIR"]
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
round_id = torch.tensor([time.time_ns() // 1000 if rank == 0 else 0], dtype=torch.int64)
dist.broadcast(round_id, src=0)
record = {
    "round": int(round_id.item()),
    "rank": rank,
    "world_size": world_size,
    "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
    "pid": os.getpid(),
    "host": os.environ.get("HOST_ID"),
}
path = os.path.join(out, f"start_{record['round']}_{rank}_{os.getpid()}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)

grad = torch.ones(64 * 1024)  # 256 KiB, as in train_loop.py
steps = open(os.path.join(out, f"steps_{record['round']}_{rank}.txt"), "a", buffering=1)
deadline = time.monotonic() + 180
step = 0
while True:
    if time.monotonic() > deadline:
        raise SystemExit("the test never asked this worker to stop")
    grad.fill_(1.0)
    grad[-1] = float(os.path.exists(os.path.join(out, "stop")))
    dist.all_reduce(grad)
    steps.write(f"{time.time():.3f} {step}\n")
    step += 1
    if grad[-1] > 0:
        break
dist.destroy_process_group()
time.sleep(float(os.environ.get("LINGER", "0")))
