"""One rank of benches/straggler_bench.py's job: steps of --step-s "compute" (a sleep, so ranks
sharing this machine's two cores do not slow each other), times --slow on the rank given by
--slow-rank from step --slow-from on, with --jitter of random noise per step, then an all_reduce.
Writes $OUT_DIR/steps-<rank>.txt ("<unix time> <step>"); stops once $OUT_DIR/stop exists."""

from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np

import elastix.collectives as ec

parser = argparse.ArgumentParser()
parser.add_argument("--step-s", type=float, default=0.1)
parser.add_argument("--slow", type=float, default=1.0)
parser.add_argument("--slow-rank", type=int, default=-1)
parser.add_argument("--slow-from", type=int, default=0)
parser.add_argument("--jitter", type=float, default=0.2)
args = parser.parse_args()
out = os.environ["OUT_DIR"]

ec.init_process_group()
rank = ec.get_rank()
grad, flag = np.ones(1024), np.zeros(1)
with open(os.path.join(out, f"steps-{rank}.txt"), "a", buffering=1) as log:
    step = 0
    while True:
        factor = args.slow if rank == args.slow_rank and step >= args.slow_from else 1.0
        time.sleep(args.step_s * factor * random.uniform(1 - args.jitter, 1 + args.jitter))
        ec.all_reduce(grad)
        flag[0] = float(os.path.exists(os.path.join(out, "stop")))
        ec.all_reduce(flag)
        log.write(f"{time.time():.4f} {step}\n")
        if flag[0] > 0:
            break
        step += 1
ec.barrier()
