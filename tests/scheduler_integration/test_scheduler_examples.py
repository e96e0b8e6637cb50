"""The scheduler examples in examples/ say what they claim: the Kubernetes manifests parse and
their `elastix run` command lines form the job from what each pod is given; the Slurm batch
script is valid and requeues on the status a preempted job exits with."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest
import yaml

from conftest import REPO
from elastix.cli.run_flags import build_parser
from elastix.cli.scheduler_flags import derive

EXAMPLES = os.path.join(REPO, "examples")


def manifests(name):
    with open(os.path.join(EXAMPLES, "kubernetes", name)) as f:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(f)}


def elastix_args(command, env):
    assert command[:2] == ["elastix", "run"], command
    args = build_parser().parse_args(command[2:])
    return args, derive(args, env, lambda warning: pytest.fail(warning))


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("PET_", "ELASTIX_", "SLURM_")) and name != "ELASTIX_TEST_MARKER":
            monkeypatch.delenv(name)


def test_the_indexed_job_meets_at_pod_0_through_its_headless_service():
    docs = manifests("indexed-job.yaml")
    service, job = docs["Service"], docs["Job"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert job["spec"]["completionMode"] == "Indexed"
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    name, nodes = job["metadata"]["name"], job["spec"]["completions"]
    for index in range(nodes):
        args, said = elastix_args(pod["containers"][0]["command"], {"JOB_COMPLETION_INDEX": str(index)})
        host, port = args.rdzv_endpoint.rsplit(":", 1)
        # pod 0's host name is the endpoint's first label: it serves the store
        assert host == f"{name}-0.{pod['subdomain']}"
        assert int(port) == service["spec"]["ports"][0]["port"]
        assert args.nnodes == str(nodes) and args.rdzv_conf == f"node_order={index}", said


def test_the_pytorchjob_needs_only_the_operators_variables(monkeypatch):
    job = manifests("pytorchjob.yaml")["PyTorchJob"]
    policy = job["spec"]["elasticPolicy"]
    # what the operator gives each pod
    monkeypatch.setenv("PET_NNODES", f"{policy['minReplicas']}:{policy['maxReplicas']}")
    monkeypatch.setenv("PET_NPROC_PER_NODE", job["spec"]["nprocPerNode"])
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "train-elastic-worker-0:23456")
    monkeypatch.setenv("PET_MAX_RESTARTS", str(policy["maxRestarts"]))
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    args, said = elastix_args(container["command"], dict(os.environ))
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("2:4", "4", "c10d")
    assert (args.rdzv_endpoint, args.max_restarts) == ("train-elastic-worker-0:23456", 10)
    assert said is None


def test_the_slurm_batch_script_is_valid_and_requeues_a_preempted_job():
    path = os.path.join(EXAMPLES, "slurm", "train_digits.sbatch")
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0
    text = open(path).read()
    assert "#SBATCH --signal=USR1@" in text and "#SBATCH --requeue" in text
    srun = next(line for line in text.replace("\\\n", " ").splitlines() if line.startswith("srun "))
    args = build_parser().parse_args(shlex.split(srun)[3:])
    assert args.training_script == "examples/train_digits.py" and "--checkpoint" in args.training_script_args
    assert '"$status" -eq 138' in text  # 128 + SIGUSR1: what `elastix run` exits with when preempted
