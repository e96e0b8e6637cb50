"""One rank of benches/reform_bench.py's job: a model that takes --build-s to build (a sleep
standing for imports, construction, allocation and warm-up), then data-parallel steps (an
all_reduce of --grad-mb MB and an elastix.checkpoint save), run inside elastix.elastic.run
(--elastic: a re-form calls the training function again in this process) or as a plain script
(a re-form restarts the process, which builds the model again).

Writes $OUT_DIR/steps-<pid>.txt: "<unix time> <round> <step>" per step. Every rank stops after
the same step once $OUT_DIR/stop exists."""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import elastix
import elastix.collectives as ec

parser = argparse.ArgumentParser()
parser.add_argument("--elastic", action="store_true")
parser.add_argument("--build-s", type=float, default=5.0)
parser.add_argument("--grad-mb", type=float, default=4.0)
parser.add_argument("--step-s", type=float, default=0.05)
args = parser.parse_args()
out = os.environ["OUT_DIR"]

time.sleep(args.build_s)  # building the model
floats = int(args.grad_mb * (1 << 20)) // 4
weights = np.zeros(floats, np.float32)


def train(ckpt: elastix.checkpoint.Checkpoint) -> None:
    state = ckpt.load()
    if state is not None:
        weights[:] = state["w"]
    step = 0 if ckpt.step is None else ckpt.step + 1
    round_ = os.environ["ELASTIX_ROUND"]
    grad, flag = np.ones(floats, np.float32), np.zeros(1)
    with open(os.path.join(out, f"steps-{os.getpid()}.txt"), "a", buffering=1) as log:
        while True:
            time.sleep(args.step_s)  # the forward and backward passes
            ec.all_reduce(grad)
            grad[:] = 1.0
            weights[:] += 0.001
            ckpt.save(step, {"w": weights})
            log.write(f"{time.time():.4f} {round_} {step}\n")
            flag[0] = float(os.path.exists(os.path.join(out, "stop")))
            ec.all_reduce(flag)
            if flag[0] > 0:
                break
            step += 1
    ec.barrier()


if args.elastic:
    elastix.elastic.run(train)
else:
    ec.init_process_group()
    train(elastix.checkpoint.open())
