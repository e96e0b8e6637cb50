"""A data-parallel loop under elastix.elastic.run, for the tests of re-forming in process.

The parameters `w` are replicated: each step every rank adds its gradient (a known array of the
step and the rank) to an all_reduce and takes the mean, so all ranks hold the same `w`. Each call
of the training function (a first start, or a re-form in the same process) is reported to
$OUT_DIR/start_<round>_<rank>_<pid>.json with the process's pid, how many calls it made, what
was restored (step, from where) and whether the restored `w` is the one its rank saved at that
step (kept beside the checkpoint as a CRC); every step is logged to
$OUT_DIR/steps_<round>_<rank>.txt as `time step crc32(w) pid`. The ranks stop together once
$OUT_DIR/stop exists (or 180 s pass). With FAIL_RANK=r, rank r raises a ValueError mid-update at
step FAIL_AT once (a file marks that it did). With SLOW_HOST=h, the ranks on host h (by
ELASTIX_COLLECTIVES_HOST_ID) come late to each all_reduce, so that the others wait inside it.
With SLEEP_RANK=r, rank r computes for SLEEP_S seconds (default an hour) at step SLEEP_AT once,
after it wrote $OUT_DIR/sleeping. NO_SAVE=1 never saves a checkpoint. What ended each call but the last is written to
$OUT_DIR/left_<round>_<rank>_<pid>.txt (the exception's type). INTERRUPT=0 runs the loop with
``elastix.elastic.run(train, interrupt=False)``."""

import json
import os
import time
import zlib

import numpy as np

import elastix
import elastix.collectives as ec

FLOATS = 64 * 1024
out = os.environ["OUT_DIR"]
calls = 0
deadline = time.monotonic() + 180


def gradient(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng([rank, step]).random(FLOATS)


def report(ckpt, state) -> None:
    rank, round_ = int(os.environ["RANK"]), int(os.environ["ELASTIX_ROUND"])
    exact = state is None or (int(state["step"]) == ckpt.step and zlib.crc32(state["w"].tobytes()) == int(state["crc"]))
    record = {
        "round": round_,
        "rank": rank,
        "world_size": ec.get_world_size(),
        "pid": os.getpid(),
        "call": calls,
        "host": os.environ.get("ELASTIX_COLLECTIVES_HOST_ID"),
        "step": ckpt.step,
        "source": ckpt.source,
        "exact": bool(exact),
        "crc32": None if state is None else int(state["crc"]),
    }
    path = os.path.join(out, f"start_{round_}_{rank}_{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def train(ckpt: elastix.checkpoint.Checkpoint) -> None:
    global calls
    calls += 1
    try:
        train_steps(ckpt)
    except BaseException as err:
        round_, rank = os.environ["ELASTIX_ROUND"], os.environ["RANK"]
        with open(os.path.join(out, f"left_{round_}_{rank}_{os.getpid()}.txt"), "w") as f:
            f.write(type(err).__name__)
        raise


def train_steps(ckpt: elastix.checkpoint.Checkpoint) -> None:
    state = ckpt.load()
    report(ckpt, state)
    rank, round_, world = ec.get_rank(), int(os.environ["ELASTIX_ROUND"]), ec.get_world_size()
    w = np.zeros(FLOATS) if state is None else state["w"].copy()
    step = 0 if state is None else ckpt.step + 1
    steps = open(os.path.join(out, f"steps_{round_}_{rank}.txt"), "a", buffering=1)
    flag = np.zeros(1)
    failed_once = os.path.join(out, "failed_once")
    slept_once = os.path.join(out, "sleeping")
    while True:
        if time.monotonic() > deadline:
            raise SystemExit("the test never asked this worker to stop")
        grad = gradient(rank, step)
        if os.environ.get("SLOW_HOST", "-") == os.environ.get("ELASTIX_COLLECTIVES_HOST_ID"):
            time.sleep(0.3)
        if os.environ.get("SLEEP_RANK") == str(rank) and step >= int(os.environ["SLEEP_AT"]):
            if not os.path.exists(slept_once):
                open(slept_once, "w").close()
                time.sleep(float(os.environ.get("SLEEP_S", "3600")))  # a long step's compute
        ec.all_reduce(grad)
        if os.environ.get("FAIL_RANK") == str(rank) and step >= int(os.environ["FAIL_AT"]):
            if not os.path.exists(failed_once):
                open(failed_once, "w").close()
                w[: FLOATS // 2] -= 1.0  # half updated: this process's state cannot be trusted
                raise ValueError(f"rank {rank} failed mid-update at step {step}")
        w -= 0.01 * grad / world
        crc = zlib.crc32(w.tobytes())
        if os.environ.get("NO_SAVE") != "1":
            ckpt.save(step, {"w": w, "step": np.int64(step), "crc": np.int64(crc)})
        steps.write(f"{time.time():.3f} {step} {crc} {os.getpid()}\n")
        flag[0] = float(os.path.exists(os.path.join(out, "stop")))
        ec.all_reduce(flag)  # every rank leaves after the same step
        if flag[0] > 0:
            break
        step += 1
        time.sleep(0.05)
    ec.barrier()


elastix.elastic.run(train, interrupt=os.environ.get("INTERRUPT") != "0")
