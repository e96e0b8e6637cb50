"""`elastix run`'s flags under a scheduler: what Slurm's or an Indexed Job's environment
determines is filled in, what the user gave (command line, ELASTIX_*, PET_*) is kept."""

from __future__ import annotations

import pytest

from elastix.cli.run_flags import build_parser
from elastix.cli.scheduler_flags import derive
from elastix.schedulers.slurm import SlurmStep

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "2",
}
PORT = SlurmStep.from_env(SLURM).port


def derived(argv, env):
    warnings = []
    args = build_parser().parse_args([*argv, "train.py"])
    said = derive(args, env, warnings.append)
    return args, said, warnings


@pytest.fixture(autouse=True)
def no_flags_from_the_environment(monkeypatch):
    for name in ("PET_NNODES", "ELASTIX_NNODES", "PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND", "PET_RDZV_ID"):
        monkeypatch.delenv(name, raising=False)


def test_under_srun_no_rendezvous_flag_is_needed():
    args, said, warnings = derived([], SLURM)
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint) == ("2", "c10d", f"gpu07:{PORT}")
    assert args.rdzv_id == "slurm-4242.0"
    assert args.rdzv_conf == "node_order=1"
    assert args.signals_to_handle.split(",")[-2:] == ["SIGUSR1", "SIGUSR2"]
    assert said.startswith("under Slurm job 4242 step 0: --nnodes 2 (SLURM_NNODES)")
    assert "the first host of SLURM_JOB_NODELIST=gpu[07-08]" in said and not warnings


def test_flags_given_win_and_min_max_stays_elastic():
    argv = ["--nnodes", "1:4", "--rdzv-id", "mine", "--signals-to-handle", "SIGTERM", "--rdzv-conf", "node_order=0"]
    args, said, _ = derived([*argv, "--rdzv-endpoint", "head:1234"], SLURM)
    assert (args.nnodes, args.rdzv_id, args.signals_to_handle) == ("1:4", "mine", "SIGTERM")
    assert (args.rdzv_endpoint, args.rdzv_conf) == ("head:1234", "node_order=0")
    assert said == "under Slurm job 4242 step 0: nothing to derive"


def test_preemption_signals_left_out_on_purpose_are_warned_about():
    _, _, warnings = derived(["--signals-to-handle", "SIGTERM,usr1"], SLURM)
    assert len(warnings) == 1 and "leaves out SIGUSR2" in warnings[0], warnings


@pytest.mark.parametrize("endpoint", ["head", "head:0"])
def test_an_endpoint_without_a_port_gets_the_jobs(endpoint):
    args, said, _ = derived(["--rdzv-endpoint", endpoint], SLURM)
    assert args.rdzv_endpoint == f"head:{PORT}"
    assert "the port from the job ID" in said


def test_the_pytorchjob_operators_variables_are_flags_given(monkeypatch):
    monkeypatch.setenv("PET_NNODES", "3")
    args, _, _ = derived([], SLURM)
    assert args.nnodes == "3"


def test_a_static_rendezvous_keeps_its_node_rank():
    args, _, _ = derived(["--node-rank", "1", "--master-addr", "gpu07"], SLURM)
    assert args.rdzv_backend == "static" and args.rdzv_endpoint == "" and "node_order" not in args.rdzv_conf


def test_standalone_and_no_scheduler_derive_nothing():
    assert derived(["--standalone"], SLURM)[1] is None
    args, said, _ = derived([], {})
    assert said is None and args.nnodes == "1:1"


def test_several_tasks_per_node_are_warned_about():
    _, _, warnings = derived([], {**SLURM, "SLURM_NTASKS": "8"})
    assert len(warnings) == 1 and "one agent per node" in warnings[0] and "--ntasks-per-node=1" in warnings[0]


def test_an_indexed_jobs_pods_rank_in_index_order():
    env = {"JOB_COMPLETION_INDEX": "3"}
    args, said, _ = derived(["--nnodes", "4", "--rdzv-endpoint", "train-0.train:29400"], env)
    assert args.rdzv_conf == "node_order=3" and "JOB_COMPLETION_INDEX" in said
    # a static job has its ranks already
    args, said, _ = derived(["--nnodes", "4", "--node-rank", "3", "--master-addr", "train-0.train"], env)
    assert said is None and args.rdzv_conf == ""
