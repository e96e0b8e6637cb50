#!/usr/bin/env python3
"""Data-parallel training of a small MLP on 8x8 digit images, with NumPy and
elastix.collectives: the job's main example.

    elastix run --standalone --nproc-per-node 2 examples/train_digits.py --checkpoint /tmp/digits.npz
    python examples/train_digits.py                      # one process, same result
    elastix run --standalone --nproc-per-node 2 examples/train_digits.py --checkpoint /tmp/digits.npz \
        --resume --epochs 12                             # two more epochs for that run

Each step takes one global batch (the same on every rank, from a seeded shuffle), every rank
computes the gradient sum over its share of it, ``all_reduce`` adds the shares up, and every
rank applies the same update, so the replicas stay identical and the run computes what one
process would (up to the order of floating-point additions).

Checkpoints, every step: under ``elastix run`` each rank saves its replica after every step
through ``elastix.checkpoint`` into memory its agent holds (a copy: training does not wait for
a disk), and a restart within the job (a worker died) resumes from the newest step every rank
holds there, losing no step. ``elastix run --checkpoint-dir DIR`` persists them too.

Re-forms in process: under ``elastix run`` the training runs inside ``elastix.elastic.run``, so
when a node is lost or joins, or another worker fails, this process is not restarted: its
collectives are aborted, it joins the new world and trains on from the step every rank holds
(the data set, already loaded, is kept).

Checkpoint files: with ``--checkpoint PATH`` rank 0 writes one every ``--checkpoint-every`` steps
(atomically), with the run ID of the job that wrote it (``TORCHELASTIC_RUN_ID``: a fresh UUID
for every ``--standalone`` launch, the ``--rdzv-id`` otherwise). When the job restarts its
workers (a worker died, nodes joined or left), they find their job's checkpoint and resume
from it, whatever the world size, and say so. A checkpoint left by another run is resumed only
with ``--resume``; without it the run stops before training (exit status 2) and leaves the file
alone, so an earlier run is neither continued nor overwritten by accident. torchrun's default
run ID ``none`` names no job: give such a job an ``--rdzv-id``, or ``--resume``.

Preemption: SIGUSR1 or SIGUSR2 (what Slurm sends before a job's time limit with
``--signal=USR1@120``, forwarded by ``elastix run`` too) ends the run at the next step that
every rank reaches: rank 0 writes a checkpoint there and the workers exit, to resume when the
job is requeued (see examples/slurm/train_digits.sbatch).

Data: scikit-learn's bundled digits (1797 images, no download) when scikit-learn is
installed (``pip install 'elastix[examples]'``), else a built-in generator of 8x8 digit
images (glyphs with random shifts, thickness and noise), so the example runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

GLYPHS = [  # 5x7 bitmaps of 0..9
    ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    ["11111", "00010", "00100", "00010", "00001", "10001", "01110"],
    ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
]


def synthetic_digits(n: int = 3000, seed: int = 0):
    """8x8 images with values 0..16 (like scikit-learn's digits) and their labels."""
    rng = np.random.default_rng(seed)
    glyphs = np.array([[[c == "1" for c in row] for row in g] for g in GLYPHS], dtype=np.float64)
    labels = rng.integers(0, 10, n)
    images = np.zeros((n, 8, 8))
    for i, label in enumerate(labels):
        g = glyphs[label]
        if rng.random() < 0.5:  # thicker strokes
            g = np.maximum(g, np.roll(g, 1, axis=1) * (rng.random() < 0.5))
        dy, dx = rng.integers(0, 2), rng.integers(0, 4)
        images[i, dy : dy + 7, dx : dx + 5] = g
        images[i] *= rng.uniform(8, 16)
        images[i] += rng.normal(0, 1.2, (8, 8))
        flip = rng.random((8, 8)) < 0.02
        images[i][flip] = 16 - images[i][flip]
    return np.clip(images, 0, 16).reshape(n, 64), labels


def load_data(which: str):
    if which in ("auto", "sklearn"):
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            if which == "sklearn":
                sys.exit("--dataset sklearn needs scikit-learn: pip install 'elastix[examples]'")
        else:
            d = load_digits()
            return d.data.astype(np.float64), d.target.astype(np.int64), "scikit-learn digits"
    x, y = synthetic_digits()
    return x, y, "synthetic digits"


# -- the model: 64 -> hidden (tanh) -> 10 (softmax), all in one flat parameter vector ---------


def shapes(hidden: int):
    return [(64, hidden), (hidden,), (hidden, 10), (10,)]


def unpack(flat: np.ndarray, hidden: int):
    out, i = [], 0
    for shape in shapes(hidden):
        size = int(np.prod(shape))
        out.append(flat[i : i + size].reshape(shape))
        i += size
    return out


def init_params(hidden: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w1 = rng.normal(0, 1 / 8, (64, hidden))
    w2 = rng.normal(0, 1 / np.sqrt(hidden), (hidden, 10))
    return np.concatenate([w1.ravel(), np.zeros(hidden), w2.ravel(), np.zeros(10)])


def forward(params, x, hidden):
    w1, b1, w2, b2 = unpack(params, hidden)
    h = np.tanh(x @ w1 + b1)
    logits = h @ w2 + b2
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    return h, p


def grad_sum(params, x, y, hidden, out):
    """Writes the sum over the samples of the loss gradient into ``out``; returns the loss sum."""
    out[:] = 0
    if len(x) == 0:
        return 0.0
    _w1, _b1, w2, _b2 = unpack(params, hidden)
    gw1, gb1, gw2, gb2 = unpack(out, hidden)
    h, p = forward(params, x, hidden)
    loss = -np.log(p[np.arange(len(y)), y] + 1e-12).sum()
    d = p.copy()
    d[np.arange(len(y)), y] -= 1
    gw2[...] = h.T @ d
    gb2[...] = d.sum(axis=0)
    dh = (d @ w2.T) * (1 - h * h)
    gw1[...] = x.T @ dh
    gb1[...] = dh.sum(axis=0)
    return float(loss)


def accuracy(params, x, y, hidden) -> float:
    return float((forward(params, x, hidden)[1].argmax(axis=1) == y).mean())


# -- checkpoints -------------------------------------------------------------------------------


# What a checkpoint must share with the run that resumes it: the model's shape and the order of
# the data. The learning rate, momentum and epochs may change on --resume.
CONFIG_KEYS = ("hidden", "batch", "seed", "dataset")


def job_id() -> str:
    """The launcher's run ID; "" outside a launcher and for torchrun's default "none", which
    every job without an --rdzv-id shares."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return "" if run_id == "none" else run_id


def save(path: str, step: int, params: np.ndarray, velocity: np.ndarray, world: int, config: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    np.savez(tmp, step=step, params=params, velocity=velocity, world=world, run_id=job_id(), config=json.dumps(config))
    os.replace(tmp, path)


def load(path: str) -> dict:
    with np.load(path) as f:
        return {
            "step": int(f["step"]),
            "params": f["params"].copy(),
            "velocity": f["velocity"].copy(),
            "world": int(f["world"]),
            # checkpoints from before run IDs were recorded belong to no run
            "run_id": str(f["run_id"]) if "run_id" in f.files else "",
            "config": json.loads(str(f["config"])) if "config" in f.files else {},
        }


def resume_from(args, config: dict, rank: int, world: int):
    """The checkpoint to start from (a dict from ``load``, with the ``note`` to print when
    training starts from it), or None to start afresh; raises
    SystemExit(2) for a checkpoint this run may not take. Every rank reads the same file, so
    every rank decides the same."""
    path = args.checkpoint
    if not path or not os.path.exists(path):
        if args.resume and rank == 0:
            print(f"no checkpoint at {path} yet: starting at step 0", flush=True)
        return None
    ckpt = load(path)
    job = job_id()
    if args.resume:
        why = "--resume"
    elif job and ckpt["run_id"] == job:
        why = f"written by this job, run ID {job}"
    else:
        written_by = f"run ID {ckpt['run_id']}" if ckpt["run_id"] else "no run ID"
        hint = "" if job else " (a job started with --rdzv-id resumes its own checkpoint by itself)"
        fail(
            f"{path} holds step {ckpt['step']} of another run ({written_by}); pass --resume to continue from it, "
            f"or remove it or give another --checkpoint to start afresh{hint}"
        )
    differ = [k for k in CONFIG_KEYS if ckpt["config"] and ckpt["config"].get(k) != config[k]]
    if differ:
        was = ", ".join(f"{k}={ckpt['config'].get(k)!r}" for k in differ)
        now = ", ".join(f"{k}={config[k]!r}" for k in differ)
        fail(f"{path} was written with {was}, this run has {now}: resume with the same options")
    # said when the file is what training starts from (the agent's memory may hold newer steps)
    written = f"written with {ckpt['world']} rank(s), now {world}"
    ckpt["note"] = f"resuming from {path} at step {ckpt['step']} ({why}; {written})"
    return ckpt


def resume_from_memory(memory, params_like: np.ndarray, rank: int):
    """The step to start at, with the replica and momentum, from the agent's memory (the
    newest step every rank holds), or None when this job saved nothing there yet."""
    like = {"params": params_like, "velocity": params_like}
    state = memory.load(like=like)
    if state is None:
        return None
    if rank == 0:
        print(f"resuming at step {memory.step + 1} from the agent's memory (every step is kept there)", flush=True)
    return {"step": memory.step + 1, "params": state["params"], "velocity": state["velocity"]}


def fail(message: str):
    print(f"train_digits.py: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64, help="global batch size (split across ranks)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dataset", choices=["auto", "sklearn", "synthetic"], default="auto")
    ap.add_argument("--checkpoint", default=None, help="checkpoint file; the job that wrote it resumes from it")
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint (if it exists), whoever wrote it")
    ap.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    ap.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step (demos, tests)")
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args(argv)
    if args.resume and not args.checkpoint:
        ap.error("--resume needs --checkpoint")

    # Data and checkpoint file first: a run that may not start stops before it joins its peers.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 or "MASTER_ADDR" in os.environ
    rank, world = (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))) if distributed else (0, 1)
    x, y, name = load_data(args.dataset)
    config = {"hidden": args.hidden, "batch": args.batch, "seed": args.seed, "dataset": name}
    from_file = resume_from(args, config, rank, world)
    x = x / 16.0
    order = np.random.default_rng(1234).permutation(len(x))
    n_test = len(x) // 5
    held_out, rest = order[:n_test], order[n_test:]
    data = (x[rest], y[rest], x[held_out], y[held_out])
    if "ELASTIX_CONTROL_SOCKET" in os.environ:
        # under `elastix run`: a re-form (a node lost or joining, another worker failed) calls
        # train again in this process, in the new world, from the step every rank holds
        import elastix

        return elastix.elastic.run(lambda memory: train(args, data, name, memory, from_file), backend=args.backend)
    if distributed:  # torchrun: a re-form restarts the workers, which resume from the file
        import elastix.collectives as ec

        ec.init_process_group(args.backend)
    return train(args, data, name, None, from_file)


def train(args, data, name: str, memory, from_file) -> int:
    """Trains from the newest step: the one every rank holds in its agent's memory
    (``memory``, an elastix.checkpoint under ``elastix run``), else the checkpoint file's."""
    ec = None
    if "MASTER_ADDR" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import elastix.collectives as ec  # initialised by the caller
    rank, world = (ec.get_rank(), ec.get_world_size()) if ec is not None else (0, 1)
    xtr, ytr, xte, yte = data
    steps_per_epoch = -(-len(xtr) // args.batch)
    total = args.epochs * steps_per_epoch
    held = memory and resume_from_memory(memory, init_params(args.hidden, args.seed), rank)
    ckpt = held or from_file
    if ckpt is from_file and ckpt is not None and rank == 0:
        print(ckpt["note"], flush=True)
    config = {"hidden": args.hidden, "batch": args.batch, "seed": args.seed, "dataset": name}

    if ckpt is None:
        start, params = 0, init_params(args.hidden, args.seed)
        velocity = np.zeros_like(params)
    else:
        start, params, velocity = ckpt["step"], ckpt["params"], ckpt["velocity"]
    if rank == 0:
        print(
            f"training on {name}: {len(xtr)} train / {len(xte)} test images, {world} rank(s), "
            f"{total} steps of {args.batch}",
            flush=True,
        )

    preempted = []  # the signals that asked this rank to stop
    for number in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, lambda signum, _frame: preempted.append(signum))
    stop = np.zeros(1)

    grad = np.zeros_like(params)
    stats = np.zeros(2)  # loss sum, samples
    for step in range(start, total):
        epoch, i = divmod(step, steps_per_epoch)
        perm = np.random.default_rng(args.seed * 1_000_003 + epoch).permutation(len(xtr))
        batch = perm[i * args.batch : (i + 1) * args.batch]
        mine = batch[rank::world]
        loss = grad_sum(params, xtr[mine], ytr[mine], args.hidden, grad)
        if ec is not None:
            ec.all_reduce(grad)  # the sum of every rank's share: the whole batch's gradient
        grad /= len(batch)
        velocity *= args.momentum
        velocity -= args.lr * grad
        params += velocity
        stats += (loss, len(mine))
        if (step + 1) % steps_per_epoch == 0:
            if ec is not None:
                ec.all_reduce(stats)
            if rank == 0:
                print(
                    f"epoch {epoch + 1}: loss {stats[0] / stats[1]:.4f}, "
                    f"test accuracy {accuracy(params, xte, yte, args.hidden):.4f}",
                    flush=True,
                )
            stats[:] = 0
        # every rank stops at the same step: one asked to stop tells the others
        stop[0] = 1.0 if preempted else 0.0
        if ec is not None:
            ec.all_reduce(stop, ec.ReduceOp.MAX)
        if memory is not None:
            memory.save(step, {"params": params, "velocity": velocity})
        due = (step + 1) % args.checkpoint_every == 0 or step + 1 == total
        if args.checkpoint and rank == 0 and (due or stop[0]):
            save(args.checkpoint, step + 1, params, velocity, world, config)
        if stop[0]:
            if rank == 0:
                where = f"checkpoint written to {args.checkpoint}" if args.checkpoint else "no --checkpoint to write"
                print(f"preempted at step {step + 1} of {total}: {where}", flush=True)
            if ec is not None:
                ec.destroy_process_group()
            return 0
        if args.step_delay:
            time.sleep(args.step_delay)

    acc = accuracy(params, xte, yte, args.hidden)
    if ec is not None:
        check = np.array([acc])
        ec.all_reduce(check, ec.ReduceOp.MIN)  # every replica must agree
        ec.barrier()
        ec.destroy_process_group()
    if rank == 0:
        print(f"final test accuracy: {acc:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
