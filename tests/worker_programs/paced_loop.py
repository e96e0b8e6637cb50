"""A data-parallel loop whose steps are CPU work ($PRODUCTS products of 256x256 matrices) and an
all_reduce, for the straggler tests: a rank whose CPU
is limited computes longer and the others wait for it in the all_reduce. Steps are logged to
$OUT_DIR/steps_<rank>.txt ("<time> <step>"); the ranks stop together once $OUT_DIR/stop exists
(or 300 s pass)."""

import os
import time

import numpy as np

import elastix.collectives as ec

out = os.environ["OUT_DIR"]
a = np.random.default_rng(0).random((256, 256))
products = int(os.environ["PRODUCTS"])

ec.init_process_group()
rank = ec.get_rank()
flag = np.zeros(1)
deadline = time.monotonic() + 300
with open(os.path.join(out, f"steps_{rank}.txt"), "a", buffering=1) as log:
    step = 0
    while True:
        if time.monotonic() > deadline:
            raise SystemExit("the test never asked this worker to stop")
        for _ in range(products):
            a @ a
        flag[0] = float(os.path.exists(os.path.join(out, "stop")))
        ec.all_reduce(flag)
        log.write(f"{time.time():.3f} {step}\n")
        if flag[0] > 0:
            break
        step += 1
ec.barrier()
ec.destroy_process_group()
