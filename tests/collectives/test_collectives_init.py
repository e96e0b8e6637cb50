"""How a group finds its peers: env:// with the agent's store (the harness's default), env://
where rank 0 hosts the store, tcp://host:port, file:///path (FileStore), and a store passed in;
many groups share one store under their own prefixes."""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import pytest

import collectives_harness as harness
import elastix
from conftest import reserved_port


def sum_ranks(init_method=None, pass_store=False, use_args=False):
    import elastix.collectives as ec

    kwargs = {"timeout": timedelta(seconds=20)}
    if pass_store:
        store = elastix.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), timeout=timedelta(seconds=20))
        kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    if init_method:
        kwargs["init_method"] = init_method
    if use_args:
        kwargs.update(rank=int(os.environ.pop("RANK")), world_size=int(os.environ.pop("WORLD_SIZE")))
    ec.init_process_group(**kwargs)
    x = np.array([ec.get_rank() + 1.0])
    ec.all_reduce(x)
    groups = [ec.new_group() for _ in range(3)]  # three more groups on the same store
    for g in groups:
        y = np.ones(2)
        ec.all_reduce(y, group=g)
        assert y[0] == ec.get_world_size()
    ec.destroy_process_group()
    return float(x[0])


def test_env_with_the_agent_store():
    assert harness.run(sum_ranks, 3, timeout=60) == [6.0] * 3


def test_env_where_rank0_hosts_the_store():
    with reserved_port() as port:  # rank 0 binds MASTER_PORT itself, as under torchrun
        env = {"TORCHELASTIC_USE_AGENT_STORE": "False", "MASTER_PORT": str(port)}
        assert harness.run(sum_ranks, 2, timeout=60, env=env) == [3.0] * 2


def test_tcp_init_method_with_rank_and_world_size_arguments():
    with reserved_port() as port:
        url = f"tcp://127.0.0.1:{port}"
        assert harness.run(sum_ranks, 2, timeout=60, kwargs={"init_method": url, "use_args": True}) == [3.0] * 2


def test_tcp_init_method_with_query():
    results = []
    with reserved_port() as port:
        workers = [
            harness.start(
                sum_ranks,
                1,
                kwargs={"init_method": f"tcp://127.0.0.1:{port}?rank={r}&world_size=2"},
                env={"RANK": "", "WORLD_SIZE": ""},
                timeout=60,
            )
            for r in range(2)
        ]
        for w in workers:
            results += w.wait()
    assert [r.value for r in results] == [3.0, 3.0], [r.describe() for r in results]


def test_file_init_method(tmp_path):
    if not hasattr(elastix, "FileStore"):
        pytest.skip("elastix.FileStore is not in this build (file:// init needs it)")
    url = f"file://{tmp_path}/rdzv"
    assert harness.run(sum_ranks, 2, timeout=60, kwargs={"init_method": url}) == [3.0] * 2


def test_a_store_passed_in():
    assert harness.run(sum_ranks, 2, timeout=60, kwargs={"pass_store": True}) == [3.0] * 2


def test_env_without_the_variables_says_what_is_missing(monkeypatch):
    import elastix.collectives as ec

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="RANK"):
        ec.init_process_group()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        ec.init_process_group()
    with pytest.raises(ValueError, match="host and port"):
        ec.init_process_group(init_method="tcp://nohostport")
    assert not ec.is_initialized()
