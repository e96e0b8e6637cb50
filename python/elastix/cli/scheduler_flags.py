"""``elastix run`` under a scheduler: the rendezvous flags a user did not give, derived from
what Slurm (``srun``, one task per node) or a Kubernetes Indexed Job tells every process, and
one INFO line saying what came from where. Flags given on the command line or as ELASTIX_* /
PET_* variables (the PyTorchJob operator's) always win."""

from __future__ import annotations

import argparse
from typing import Callable, List, Mapping, Optional, Tuple

from ..agent.signals import parse_signals
from ..schedulers.kubernetes import INDEX_VARIABLE, completion_index
from ..schedulers.slurm import SlurmStep
from .envargs import is_given, set_from

#: What Slurm sends some time before a job's end (`sbatch --signal=USR1@120`), added to the
#: signals an agent handles and forwards to its workers (SIGHUP is handled by default anyway).
SLURM_SIGNALS = ("SIGUSR1", "SIGUSR2")


def derive(args: argparse.Namespace, env: Mapping[str, str], warn: Callable[[str], None]) -> Optional[str]:
    """Fills in the flags that the scheduler's environment determines; returns the line to log
    (None outside a scheduler, or with --standalone). ValueError for a contradictory
    environment."""
    if args.standalone:
        return None
    step = SlurmStep.from_env(env)
    if step is not None:
        return _from_slurm(args, step, warn)
    index = completion_index(env)
    if index is not None and _meets_on_c10d(args) and _add_node_order(args, index, INDEX_VARIABLE):
        return f"in a Kubernetes Indexed Job: node order {index} ({INDEX_VARIABLE}), so group ranks follow it"
    return None


def _from_slurm(args: argparse.Namespace, step: SlurmStep, warn: Callable[[str], None]) -> str:
    said: List[str] = []

    def derived(dest: str, value: str, source: str) -> None:
        set_from(args, dest, value, source)
        said.append(f"--{dest.replace('_', '-')} {value} ({source})")

    if not is_given(args, "nnodes"):
        derived("nnodes", str(step.num_nodes), step.num_nodes_from)
    if not is_given(args, "rdzv_id"):
        derived("rdzv_id", step.run_id, "SLURM_JOB_ID" + (", SLURM_STEP_ID" if step.step_id else ""))
    if not is_given(args, "rdzv_backend") and not is_given(args, "node_rank"):
        set_from(args, "rdzv_backend", "c10d", "Slurm")
    if args.rdzv_backend == "c10d":
        endpoint = args.rdzv_endpoint
        if not is_given(args, "rdzv_endpoint"):
            where = f"the first host of {step.nodelist_from}={step.nodelist}; the port from the job ID"
            derived("rdzv_endpoint", f"{step.first_host}:{step.port}", where)
        elif "," not in endpoint:
            host, port = _split_endpoint(endpoint)
            if port in (None, "0"):
                derived("rdzv_endpoint", f"{host}:{step.port}", "the port from the job ID")
        if step.node_id is not None and _add_node_order(args, step.node_id, "SLURM_NODEID"):
            said.append(f"node order {step.node_id} (SLURM_NODEID), so group ranks follow it")
    handled = parse_signals(args.signals_to_handle)
    unhandled = [name for name in SLURM_SIGNALS if name not in handled]
    if not is_given(args, "signals_to_handle"):
        derived("signals_to_handle", ",".join([args.signals_to_handle, *unhandled]), "Slurm's preemption signals")
    elif unhandled:
        warn(
            f"--signals-to-handle {args.signals_to_handle} leaves out {', '.join(unhandled)}: a Slurm preemption "
            "warning (sbatch --signal) with one of them ends this agent at once, its workers unwarned"
        )
    if step.num_tasks is not None and step.num_tasks != step.num_nodes:
        warn(
            f"Slurm step {step.run_id} runs {step.num_tasks} tasks on {step.num_nodes} node(s): elastix run is one "
            "agent per node, which starts --nproc-per-node workers itself (srun --ntasks-per-node=1)"
        )
    return f"under Slurm job {step.job_id} step {step.step_id}: " + "; ".join(said or ["nothing to derive"])


def _meets_on_c10d(args: argparse.Namespace) -> bool:
    """The c10d rendezvous, named or chosen by an endpoint without --node-rank."""
    if is_given(args, "rdzv_backend"):
        return bool(args.rdzv_backend == "c10d")
    return bool(args.rdzv_endpoint) and not is_given(args, "node_rank")


def _add_node_order(args: argparse.Namespace, order: int, source: str) -> bool:
    """Adds `node_order` to --rdzv-conf unless it is there already."""
    conf = args.rdzv_conf or ""
    if any(item.split("=", 1)[0].strip() == "node_order" for item in conf.split(",")):
        return False
    set_from(args, "rdzv_conf", f"{conf},node_order={order}" if conf.strip() else f"node_order={order}", source)
    return True


def _split_endpoint(endpoint: str) -> Tuple[str, Optional[str]]:
    """(host, port or None): `host`, `host:port`, `[v6]:port`."""
    host, sep, port = endpoint.rpartition(":")
    return (host, port) if sep and host and "]" not in port else (endpoint, None)
