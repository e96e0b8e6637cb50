"""A Slurm step read from the environment srun gives each task."""

from __future__ import annotations

import pytest

from elastix.schedulers.slurm import PORT_BASE, PORT_SPAN, SlurmStep

STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "gpu[07-08,11]",
    "SLURM_NNODES": "3",
    "SLURM_NODEID": "2",
    "SLURM_NTASKS": "3",
}


def test_a_step_names_its_nodes_run_id_and_port():
    step = SlurmStep.from_env(STEP)
    assert step is not None
    assert (step.first_host, step.num_nodes, step.node_id, step.num_tasks) == ("gpu07", 3, 2, 3)
    assert step.run_id == "slurm-4242.0"
    assert PORT_BASE <= step.port < PORT_BASE + PORT_SPAN
    # every node derives the same port; another step of the job, another port
    assert SlurmStep.from_env({**STEP, "SLURM_NODEID": "0"}).port == step.port
    assert SlurmStep.from_env({**STEP, "SLURM_STEP_ID": "1"}).port != step.port


def test_the_steps_own_nodes_come_before_the_jobs():
    # srun -N 2 inside a 3-node allocation: the step runs on two of them
    env = {**STEP, "SLURM_STEP_NODELIST": "gpu[08,11]", "SLURM_STEP_NUM_NODES": "2"}
    step = SlurmStep.from_env(env)
    assert (step.first_host, step.num_nodes, step.nodelist_from) == ("gpu08", 2, "SLURM_STEP_NODELIST")
    assert SlurmStep.from_env({**STEP, "SLURM_NNODES": "", "SLURM_JOB_NUM_NODES": "3"}).num_nodes == 3


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"SLURM_JOB_ID": "4242"},  # a batch script's own shell: no step
        {**STEP, "SLURM_STEP_ID": "batch"},
    ],
)
def test_outside_a_step_there_is_nothing_to_read(env):
    assert SlurmStep.from_env(env) is None


@pytest.mark.parametrize(
    "change, says",
    [
        ({"SLURM_NNODES": "2"}, "names 3 host(s) but SLURM_NNODES=2"),
        ({"SLURM_NNODES": "three"}, "SLURM_NNODES='three' is not a number"),
        ({"SLURM_JOB_NODELIST": "gpu[07-08"}, "'[' not closed"),
        ({"SLURM_JOB_NODELIST": ""}, "has no node list"),
    ],
)
def test_contradictions_are_errors(change, says):
    with pytest.raises(ValueError) as error:
        SlurmStep.from_env({**STEP, **change})
    assert says in str(error.value)
