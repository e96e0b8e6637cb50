"""What a Slurm step tells each of its tasks, read from the environment ``srun`` gives them.

Under ``srun`` with one task per node, every node computes the same job from it: the nodes,
the first of them (which serves the rendezvous store), a run ID, and a port, so that
``elastix run train.py`` needs no rendezvous flag."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Mapping, Optional

from . import hostlist

#: Rendezvous ports derived from the job ID lie in [PORT_BASE, PORT_BASE + PORT_SPAN): below
#: Linux's ephemeral range (32768-60999), so no outgoing connection holds one by chance.
PORT_BASE = 20000
PORT_SPAN = 10000


@dataclasses.dataclass(frozen=True)
class SlurmStep:
    job_id: str
    step_id: Optional[str]
    #: The step's hostlist expression, and the variable it came from.
    nodelist: str
    nodelist_from: str
    num_nodes: int
    num_nodes_from: str
    #: This node's index among the step's nodes (SLURM_NODEID).
    node_id: Optional[int]
    #: Tasks of the step (one per node is what an agent per node wants).
    num_tasks: Optional[int]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Optional["SlurmStep"]:
        """The step this process runs in; None outside a step of ``srun`` (no SLURM_JOB_ID,
        or a batch script's own shell, which runs on the first node only). ValueError for
        variables that are missing or contradict each other."""
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        step_id = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
        if not job_id or step_id is None or step_id in ("batch", "extern", "interactive", "4294967294"):
            return None
        nodelist_from = _first_set(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        num_nodes_from = _first_set(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        if nodelist_from is None or num_nodes_from is None:
            missing = (
                "node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST)"
                if nodelist_from is None
                else "node count (SLURM_STEP_NUM_NODES, SLURM_NNODES, SLURM_JOB_NUM_NODES)"
            )
            raise ValueError(f"Slurm job {job_id} step {step_id}: the environment has no {missing}")
        num_nodes = _integer(env, num_nodes_from)
        nodelist = env[nodelist_from]
        hosts = hostlist.expand(nodelist)
        if len(hosts) != num_nodes:
            raise ValueError(f"{nodelist_from}={nodelist} names {len(hosts)} host(s) but {num_nodes_from}={num_nodes}")
        tasks_from = _first_set(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        return cls(
            job_id=job_id,
            step_id=step_id,
            nodelist=nodelist,
            nodelist_from=nodelist_from,
            num_nodes=num_nodes,
            num_nodes_from=num_nodes_from,
            node_id=_integer(env, "SLURM_NODEID") if env.get("SLURM_NODEID") else None,
            num_tasks=_integer(env, tasks_from) if tasks_from else None,
        )

    @property
    def first_host(self) -> str:
        return hostlist.first(self.nodelist)

    @property
    def run_id(self) -> str:
        """One per step: two steps of a job (two sruns) are two jobs to elastix."""
        return f"slurm-{self.job_id}" + (f".{self.step_id}" if self.step_id else "")

    @property
    def port(self) -> int:
        """The rendezvous port every node of the step derives alike."""
        return PORT_BASE + zlib.crc32(self.run_id.encode()) % PORT_SPAN


def _first_set(env: Mapping[str, str], *names: str) -> Optional[str]:
    return next((name for name in names if env.get(name)), None)


def _integer(env: Mapping[str, str], name: str) -> int:
    text = env[name]
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None
    if value < 0:
        raise ValueError(f"{name}={text!r} is negative")
    return value
