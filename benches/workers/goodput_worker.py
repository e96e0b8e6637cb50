"""One rank of the goodput benchmark's job (benches/goodput.py), under `elastix run` or
`torchrun`: data-parallel steps over a state of --state-mb MB per rank, each --step-s of
compute (a sleep: an accelerator's time, the CPU left free) and an all_reduce; checkpoints
through elastix.checkpoint (inside elastix.elastic.run, re-formed in process; or, with
--mode elastix-restart, a plain script the agents restart), torch.save (rank 0, every --every
steps) or torch's DCP async_save. elastix's saves are pipelined (``save(block=False)``: the copy
overlaps the next step's compute, and the loop waits for it before it changes the state) unless
--block.

Writes to $OUT_DIR: steps-<rank>.txt ("<unix time> <step>" per step done: trained and, if it
saves, saved), starts-<rank>.txt
("<step restored or -1> <seconds the restore took> <unix time>" per start), saves-<rank>.txt ("<seconds
the save blocked the loop, with the wait for its copy> <step>"), phases-<rank>.txt ("<unix time> <step> <seconds the compute overran> <seconds in the
all_reduce> <seconds waiting for the last save's copy>": where a slow step's time went),
final.txt (rank 0's last step). Stops, every rank after the same step, once $OUT_DIR/stop
exists."""

from __future__ import annotations

import argparse
import glob
import os
import time

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["elastix", "elastix-restart", "torch-save", "torch-dcp", "none"], required=True)
parser.add_argument("--every", type=int, default=1)
parser.add_argument("--state-mb", type=int, default=256)
parser.add_argument("--step-s", type=float, default=1.0)
parser.add_argument("--block", action="store_true", help="elastix: save(block=True), the copy in the loop")
args = parser.parse_args()
out = os.environ["OUT_DIR"]
rank = int(os.environ["RANK"])
floats = args.state_mb * (1 << 20) // 4


def log(name: str, line: str) -> None:
    with open(os.path.join(out, f"{name}-{rank}.txt"), "a") as f:
        f.write(line + "\n")


class Elastix:
    """elastix.checkpoint; in elastix.elastic.run (``ckpt`` given: the group is joined) or not."""

    def __init__(self, ckpt=None) -> None:
        import elastix
        import elastix.collectives as ec

        self.ec, self.ckpt, self.joined = ec, ckpt or elastix.checkpoint.open(), ckpt is not None

    def load(self) -> tuple[np.ndarray, int]:
        state = self.ckpt.load()
        if not self.joined:
            self.ec.init_process_group()
        if state is None:
            return np.full(floats, 0.5, np.float32), -1
        return state["w"], int(state["step"])

    def all_reduce(self, flag: np.ndarray) -> None:
        self.ec.all_reduce(flag)

    def save(self, step: int, w: np.ndarray) -> None:
        self.ckpt.save(step, {"w": w, "step": step}, block=args.block)

    def wait(self) -> None:
        self.ckpt.wait()

    def close(self) -> None:
        self.ec.barrier()
        self.ec.destroy_process_group()


class Torch:
    """torch.distributed (gloo) with torch.save by rank 0, or DCP async_save by every rank."""

    def __init__(self, dcp: bool) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.dcp = torch, dist, dcp
        dist.init_process_group("gloo")
        self.dir = os.path.join(out, "torch-checkpoints")
        os.makedirs(self.dir, exist_ok=True)
        self.pending = None

    def load(self) -> tuple[np.ndarray, int]:
        torch = self.torch
        if self.dcp:
            import torch.distributed.checkpoint as dcp

            done = sorted(glob.glob(os.path.join(self.dir, "step-*", ".metadata")))
            if not done:
                return np.full(floats, 0.5, np.float32), -1
            state = {"w": torch.zeros(floats), "step": torch.zeros(1, dtype=torch.int64)}
            dcp.load(state, checkpoint_id=os.path.dirname(done[-1]))
            return state["w"].numpy(), int(state["step"][0])
        path = os.path.join(self.dir, "latest.pt")
        if not os.path.exists(path):
            return np.full(floats, 0.5, np.float32), -1
        state = torch.load(path)
        return state["w"].numpy(), int(state["step"])

    def all_reduce(self, flag: np.ndarray) -> None:
        tensor = self.torch.from_numpy(flag)
        self.dist.all_reduce(tensor)

    def save(self, step: int, w: np.ndarray) -> None:
        torch = self.torch
        if self.dcp:
            import torch.distributed.checkpoint as dcp

            if self.pending is not None:
                self.pending.result()  # one save in flight at a time, as DCP's examples do
            state = {"w": torch.from_numpy(w.copy()), "step": torch.tensor([step])}
            self.pending = dcp.async_save(state, checkpoint_id=os.path.join(self.dir, f"step-{step:09d}"))
            return
        if rank == 0:
            path = os.path.join(self.dir, "latest.pt")
            torch.save({"w": torch.from_numpy(w), "step": step}, path + ".tmp")
            os.replace(path + ".tmp", path)

    def wait(self) -> None:
        pass  # DCP's async_save copies before it returns; torch.save blocks

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()
        self.dist.barrier()
        self.dist.destroy_process_group()


def main() -> None:
    # where the benchmark finds this node's worker to kill
    with open(os.path.join(out, f"pid-{os.environ.get('ELASTIX_COLLECTIVES_HOST_ID', rank)}.txt"), "w") as f:
        f.write(str(os.getpid()))
    if args.mode == "elastix":  # a re-form calls train again in this process
        import elastix

        elastix.elastic.run(lambda ckpt: train(Elastix(ckpt)))
        return
    train(Elastix() if args.mode in ("elastix-restart", "none") else Torch(args.mode == "torch-dcp"))


def train(job) -> None:
    started = time.perf_counter()
    w, restored = job.load()
    log("starts", f"{restored} {time.perf_counter() - started:.3f} {time.time():.3f}")
    flag = np.zeros(1, np.float32)
    step = restored + 1
    # a step is done once trained and, where it saves, saved: a pipelined save's step once its
    # copy is whole, which the next wait tells
    copying = None
    while True:
        step_began = time.perf_counter()
        time.sleep(args.step_s)  # the step's compute
        computed = time.perf_counter()
        flag[0] = float(os.path.exists(os.path.join(out, "stop")))
        job.all_reduce(flag)
        reduced = time.perf_counter()
        job.wait()  # the last save's copy, before the state changes
        waited = time.perf_counter() - reduced
        late = computed - step_began - args.step_s
        log("phases", f"{time.time():.3f} {step} {late:.4f} {reduced - computed:.4f} {waited:.4f}")
        if copying is not None:
            log("steps", f"{time.time():.3f} {copying}")
            copying = None
        w[step % w.size] += 1.0
        if args.mode != "none" and step % args.every == 0:
            began = time.perf_counter()
            job.save(step, w)
            log("saves", f"{waited + time.perf_counter() - began:.4f} {step}")
            copying = step if args.mode.startswith("elastix") and not args.block else None
        if copying is None:
            log("steps", f"{time.time():.3f} {step}")
        if flag[0] > 0:
            break
        step += 1
    job.wait()
    if copying is not None:
        log("steps", f"{time.time():.3f} {copying}")
    if rank == 0:
        with open(os.path.join(out, "final.txt"), "w") as f:
            f.write(f"{step}\n")
    job.close()


if __name__ == "__main__":
    main()
