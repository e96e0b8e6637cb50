"""`elastix run`: torchrun's flags, aliases, PET_*/ELASTIX_* environment, derived settings, errors
and the AgentConfig handed to the agent (mocked here; the real agent runs in test_agent_e2e)."""

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

import torch_gate
from elastix import _core
from elastix.agent import nproc
from elastix.agent.worker_site import SITE_DIR
from elastix.cli import main as elastix_main
from elastix.cli.run import main as run_main
from elastix.cli.run_config import config_from_args
from elastix.cli.run_flags import build_parser

OK_REPORT = {
    "state": "SUCCEEDED", "exit_code": 0, "restart_count": 0, "group_rank": 0,
    "group_world_size": 1, "log_dir": None, "global_ranks": [0], "failures": [], "summary": None,
}  # fmt: skip

# torchrun 2.11's flags (reference section 1.2) with their aliases: (dashed, underscored, dest)
TORCHRUN_FLAGS = [
    ("--nnodes", None, "nnodes"),
    ("--nproc-per-node", "--nproc_per_node", "nproc_per_node"),
    ("--rdzv-backend", "--rdzv_backend", "rdzv_backend"),
    ("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint"),
    ("--rdzv-id", "--rdzv_id", "rdzv_id"),
    ("--rdzv-conf", "--rdzv_conf", "rdzv_conf"),
    ("--standalone", None, "standalone"),
    ("--max-restarts", "--max_restarts", "max_restarts"),
    ("--monitor-interval", "--monitor_interval", "monitor_interval"),
    ("--start-method", "--start_method", "start_method"),
    ("--event-log-handler", "--event_log_handler", "event_log_handler"),
    ("--role", None, "role"),
    ("--module", "-m", "module"),
    ("--no-python", "--no_python", "no_python"),
    ("--run-path", "--run_path", "run_path"),
    ("--log-dir", "--log_dir", "log_dir"),
    ("--redirects", "-r", "redirects"),
    ("--tee", "-t", "tee"),
    ("--local-ranks-filter", "--local_ranks_filter", "local_ranks_filter"),
    ("--duplicate-stdout-filters", "--duplicate_stdout_filters", "duplicate_stdout_filters"),
    ("--duplicate-stderr-filters", "--duplicate_stderr_filters", "duplicate_stderr_filters"),
    ("--node-rank", "--node_rank", "node_rank"),
    ("--master-addr", "--master_addr", "master_addr"),
    ("--master-port", "--master_port", "master_port"),
    ("--local-addr", "--local_addr", "local_addr"),
    ("--logs-specs", "--logs_specs", "logs_specs"),
    ("--numa-binding", "--numa_binding", "numa_binding"),
    ("--signals-to-handle", "--signals_to_handle", "signals_to_handle"),
    ("--virtual-local-rank", "--virtual_local_rank", "virtual_local_rank"),
    ("--shutdown-timeout", "--shutdown_timeout", "shutdown_timeout"),
    ("--log-line-prefix-template", "--log_line_prefix_template", "log_line_prefix_template"),
]
SAMPLE_VALUES = {
    "nnodes": "2", "nproc_per_node": "3", "rdzv_backend": "c10d", "rdzv_endpoint": "h:1",
    "rdzv_id": "j", "rdzv_conf": "a=1", "max_restarts": "2", "monitor_interval": "0.5",
    "start_method": "fork", "event_log_handler": "null", "role": "r", "log_dir": "/x",
    "redirects": "3", "tee": "1", "local_ranks_filter": "0", "duplicate_stdout_filters": "a",
    "duplicate_stderr_filters": "b", "node_rank": "1", "master_addr": "10.0.0.1",
    "master_port": "1234", "local_addr": "1.2.3.4", "logs_specs": "x", "numa_binding": "node",
    "signals_to_handle": "SIGUSR1", "shutdown_timeout": "5", "log_line_prefix_template": "${rank}",
}  # fmt: skip
CONVERTED = {"max_restarts": 2, "node_rank": 1, "master_port": 1234,
             "duplicate_stdout_filters": ["a"], "duplicate_stderr_filters": ["b"]}  # fmt: skip


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("PET_", "ELASTIX_", "TORCHELASTIC_", "TORCH_ELASTIC_")) or name in (
            "OMP_NUM_THREADS", "PYTHON_EXEC", "CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK",
        ):  # fmt: skip
            monkeypatch.delenv(name)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


@pytest.fixture
def agent(monkeypatch):
    """A fake run_agent that records the configs it gets and returns `agent.report`."""

    class Fake:
        def __init__(self):
            self.configs = []
            self.report = dict(OK_REPORT)
            self.handlers = []

        def __call__(self, text):
            self.configs.append(json.loads(text))
            self.handlers.append(signal.getsignal(signal.SIGINT))
            if isinstance(self.report, Exception):
                raise self.report
            return json.dumps(self.report)

    fake = Fake()
    monkeypatch.setattr(_core, "run_agent", fake, raising=False)
    return fake


def parse(argv, warnings=None):
    args = build_parser().parse_args(argv)
    return config_from_args(args, warn=(warnings.append if warnings is not None else lambda m: None))


def exit_of(argv, capsys):
    with pytest.raises(SystemExit) as info:
        run_main(argv)
    return info.value.code, capsys.readouterr()


# --- the produced AgentConfig ---------------------------------------------------------------


def test_defaults_make_a_standalone_one_node_config(script):
    config = parse([script])
    _core.check_agent_config(json.dumps(config))  # the agent takes it as it is
    # a one-node static job with no master port or endpoint runs standalone (newer torchrun)
    assert config["rdzv_backend"] == "c10d" and config["rdzv_endpoint"] == "localhost:0"
    assert str(uuid.UUID(config["run_id"])) == config["run_id"], "a UUID in torchrun's form"
    assert config["role"] == "default"
    assert config["local_world_size"] == 1
    assert config["entrypoint"] == sys.executable
    assert config["args"] == ["-u", script]
    assert own_env(config) == {}
    assert (config["min_nodes"], config["max_nodes"]) == (1, 1)
    assert config["node_rank"] is None and config["master_addr"] is None and config["master_port"] is None
    assert config["max_restarts"] == 0
    assert config["signals_to_handle"] == ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    assert config["shutdown_timeout"] == 30.0 and config["exit_barrier_timeout"] == 300.0
    assert config["log_dir"] is None
    assert config["redirects"] == [0] and config["tee"] == [0]
    assert config["local_ranks_filter"] is None and config["line_prefix"] is None
    assert config["virtual_local_rank"] is False
    json.dumps(config)  # serializable as is


def test_static_backend_with_a_master_port(script):
    config = parse(["--master-port", "1234", script])
    assert config["rdzv_backend"] == "static" and config["rdzv_endpoint"] == ""
    assert (config["master_addr"], config["master_port"], config["node_rank"]) == ("127.0.0.1", 1234, 0)
    assert config["run_id"] == "none"


def test_master_addr_alone_keeps_static(script):
    config = parse(["--master-addr", "10.0.0.9", script])
    assert (config["rdzv_backend"], config["master_addr"], config["master_port"]) == ("static", "10.0.0.9", 29500)


def test_ignored_static_flags_warn(script):
    warnings = []
    parse(["--rdzv-backend", "c10d", "--master-addr", "h", "--node-rank", "1", script], warnings)
    assert any("--master-addr only applies" in w for w in warnings)
    assert any("--node-rank only applies" in w for w in warnings)
    warnings.clear()
    parse(["--nnodes", "1:2", "--master-port", "5", script], warnings)
    assert any("static rendezvous is not elastic" in w for w in warnings)


def test_log_dir_dev_null_means_no_files(script):
    assert parse(["--log-dir", os.devnull, script])["log_dir"] == os.devnull


def test_static_multi_node(script):
    config = parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", script])
    assert config["rdzv_backend"] == "static"
    assert (config["min_nodes"], config["max_nodes"], config["node_rank"]) == (2, 2, 1)
    assert (config["master_addr"], config["master_port"]) == ("10.0.0.1", 29500)


def test_durations_take_units_as_rdzv_conf_does(script, capsys):
    config = parse(["--shutdown-timeout", "500ms", "--worker-timeout", "2m", "--exit-barrier-timeout", "1h",
                    "--monitor-interval", "50ms", script])  # fmt: skip
    assert (config["shutdown_timeout"], config["worker_timeout"], config["exit_barrier_timeout"]) == (
        0.5,
        120.0,
        3600.0,
    )
    assert parse(["--shutdown-timeout", "7", script])["shutdown_timeout"] == 7.0
    code, out = exit_of(["--worker-timeout", "soon", script], capsys)
    assert code == 2 and "--worker-timeout: soon is not a duration" in out.err, out.err


def test_an_endpoint_without_a_node_rank_means_c10d(script, caplog):
    with caplog.at_level("INFO", logger="elastix"):
        config = parse(["--nnodes", "2", "--rdzv-endpoint", "h0:29400", script])
    assert (config["rdzv_backend"], config["rdzv_endpoint"]) == ("c10d", "h0:29400")
    said = [r.getMessage() for r in caplog.records if "c10d rendezvous" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("--rdzv-endpoint h0:29400 without --node-rank"), said
    # a node rank, or static asked for, keeps torchrun's static rendezvous at that endpoint
    assert (
        parse(["--nnodes", "2", "--rdzv-endpoint", "h0:29400", "--node-rank", "1", script])["rdzv_backend"] == "static"
    )
    explicit = parse(["--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "h0:29400", script])
    assert explicit["rdzv_backend"] == "static"


def test_node_rank_must_be_below_nnodes_for_static(script):
    with pytest.raises(ValueError, match="--node-rank 2"):
        parse(["--nnodes", "2", "--node-rank", "2", script])


def test_c10d_multi_node(script):
    config = parse(["--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:29400",
                    "--rdzv-id", "job7", "--rdzv-conf", "join_timeout=5m", "--local-addr", "10.1.1.1",
                    "--max-restarts", "3", "--role", "trainer", script])  # fmt: skip
    assert (config["rdzv_backend"], config["rdzv_endpoint"], config["run_id"]) == ("c10d", "h0:29400", "job7")
    assert (config["min_nodes"], config["max_nodes"]) == (1, 4)
    assert config["rdzv_conf"] == "join_timeout=5m"
    assert config["local_addr"] == "10.1.1.1"
    assert (config["max_restarts"], config["role"]) == (3, "trainer")
    assert config["node_rank"] is None and config["master_addr"] is None


def test_standalone_overrides_rendezvous_flags_with_a_warning(script):
    warnings = []
    config = parse(["--standalone", "--rdzv-backend", "static", "--rdzv-id", "x", script], warnings)
    assert (config["rdzv_backend"], config["rdzv_endpoint"]) == ("c10d", "localhost:0")
    assert config["run_id"] != "x"
    assert any("--standalone ignores --rdzv-backend, --rdzv-id" in w for w in warnings)
    assert parse(["--standalone", script])["run_id"] != config["run_id"]


def test_standalone_cannot_wait_for_more_nodes(script, capsys):
    code, out = exit_of(["--standalone", "--nnodes", "2", script], capsys)
    assert code == 2 and "--standalone runs a single node" in out.err


@pytest.mark.parametrize("spec,expected", [("3", (3, 3)), ("1:4", (1, 4)), (" 2:2 ", (2, 2))])
def test_nnodes(script, spec, expected):
    config = parse(["--nnodes", spec, "--rdzv-backend", "c10d", script])
    assert (config["min_nodes"], config["max_nodes"]) == expected


@pytest.mark.parametrize("spec", ["0", "4:2", "1:2:3", "x", "0:2", "-1", ""])
def test_bad_nnodes(script, capsys, spec):
    code, out = exit_of(["--nnodes", spec, script], capsys)
    assert code == 2 and "--nnodes" in out.err


def test_module_no_python_run_path_and_python_exec(script, monkeypatch):
    assert parse(["-m", "pkg.mod", "--x", "1"])["args"] == ["-u", "-m", "pkg.mod", "--x", "1"]
    config = parse(["--no-python", "/bin/echo", "${local_rank}", "$$"])
    assert (config["entrypoint"], config["args"]) == ("/bin/echo", ["${local_rank}", "$$"])
    config = parse(["--run-path", "--no-python", script, "a"])  # --run-path wins, as torch
    assert config["entrypoint"] == sys.executable
    assert config["args"] == ["-u", "-m", "elastix.worker.function_worker", "--run-path", script, "a"]
    monkeypatch.setenv("PYTHON_EXEC", "/opt/py")
    assert parse([script])["entrypoint"] == "/opt/py"


def test_everything_after_the_script_belongs_to_it(script):
    config = parse(["--nproc-per-node", "2", script, "--nproc-per-node", "5", "-h", "--", "-m"])
    assert config["local_world_size"] == 2
    assert config["args"] == ["-u", script, "--nproc-per-node", "5", "-h", "--", "-m"]


def test_the_programs_flags_are_its_own_even_where_they_abbreviate_ours(script):
    """`--checkpoint` abbreviates both --checkpoint-dir and --checkpoint-keep: after the
    program it is the program's, never an ambiguous option of elastix run's."""
    config = parse(["--checkpoint-dir", "/tmp/c", "--max-restarts=1", "-r3", script, "--checkpoint", "x", "--max", "2"])
    assert config["args"] == ["-u", script, "--checkpoint", "x", "--max", "2"]
    assert config["checkpoint_dir"] == "/tmp/c" and config["max_restarts"] == 1
    config = parse(["--", script, "--checkpoint-dir", "y"])
    assert config["args"] == ["-u", script, "--checkpoint-dir", "y"] and config["checkpoint_dir"] is None


def test_contradictory_program_flags(script, capsys):
    code, out = exit_of(["--no-python", "-m", "pkg"], capsys)
    assert code == 2 and "--no-python and -m/--module" in out.err
    code, out = exit_of(["--run-path", "-m", "pkg"], capsys)
    assert code == 2 and "--run-path" in out.err


def test_missing_script_is_a_clear_error(tmp_path, capsys):
    code, out = exit_of([str(tmp_path / "trian.py")], capsys)
    assert code == 2 and "trian.py" in out.err and "not found" in out.err


def own_env(config):
    """The workers' configured variables, less elastix's site hook first on PYTHONPATH (every
    Python worker gets it: hang detection with no change to the program)."""
    env = dict(config["env"])
    first, _, rest = env.pop("PYTHONPATH").partition(os.pathsep)
    assert first == SITE_DIR and rest == os.environ.get("PYTHONPATH", ""), config["env"]
    return env


def test_omp_num_threads(script, monkeypatch, caplog):
    warnings = []
    caplog.set_level("INFO", logger="elastix")
    config = parse(["--nproc-per-node", "2", script], warnings)
    assert own_env(config) == {"OMP_NUM_THREADS": "1"}
    # said once, in one plain line, not as a warning (elastix set it, as torchrun does)
    said = [r.getMessage() for r in caplog.records if "OMP_NUM_THREADS" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and not warnings, (said, warnings)
    assert "OMP_NUM_THREADS" not in os.environ  # only the workers get it
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    warnings.clear()
    assert own_env(parse(["--nproc-per-node", "2", script], warnings)) == {}
    assert not warnings
    assert own_env(parse(["--nproc-per-node", "1", script])) == {}


def test_redirects_tee_and_filter(script):
    config = parse(["--nproc-per-node", "12", "-r", "3", "-t", "0:1,11:2,40:3", "--local-ranks-filter", "0,11", script])
    assert config["redirects"] == [3] * 12
    assert config["tee"] == [1] + [0] * 10 + [2]  # ranks above 9 work; 40 is not on this node
    assert config["local_ranks_filter"] == [0, 11]


@pytest.mark.parametrize("argv,flag", [
    (["-r", "4"], "--redirects"), (["-t", "0:1,x"], "--tee"), (["-r", "0:5"], "--redirects"),
    (["--local-ranks-filter", "0,a"], "--local-ranks-filter"),
])  # fmt: skip
def test_bad_log_specs(script, capsys, argv, flag):
    code, out = exit_of([*argv, script], capsys)
    assert code == 2 and flag in out.err


def test_log_dir_is_absolute_and_must_be_a_directory(script, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert parse(["--log-dir", "logs", script])["log_dir"] == str(tmp_path / "logs")
    code, out = exit_of(["--log-dir", script, script], capsys)
    assert code == 2 and "not a directory" in out.err


def test_line_prefix_sources(script, monkeypatch, capsys):
    assert (
        parse(["--log-line-prefix-template", "${hostname}:${rank}:$local_rank $$ ${role_name} ${x}", script])[
            "line_prefix"
        ]
        == "{host}:{rank}:{local_rank} $ {role} ${x}"
    )
    assert parse(["--line-prefix", "{host}|{rank} ", script])["line_prefix"] == "{host}|{rank} "
    assert parse(["--line-prefix", "", script])["line_prefix"] == ""
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${rank}]:")
    assert parse([script])["line_prefix"] == "[{rank}]:"
    monkeypatch.setenv("PET_LOG_LINE_PREFIX_TEMPLATE", "<${local_rank}>")
    assert parse([script])["line_prefix"] == "<{local_rank}>"
    monkeypatch.setenv("ELASTIX_LINE_PREFIX", "{role}/")
    assert parse([script])["line_prefix"] == "{role}/"
    assert parse(["--log-line-prefix-template", "${rank}", script])["line_prefix"] == "{rank}"
    code, out = exit_of(["--line-prefix", "a", "--log-line-prefix-template", "b", script], capsys)
    assert code == 2 and "not both" in out.err


def test_signals_to_handle(script, capsys):
    config = parse(["--signals-to-handle", "SIGTERM, usr1,SIGUSR1,int", script])
    assert config["signals_to_handle"] == ["SIGTERM", "SIGUSR1", "SIGINT"]
    # an unknown name is an error, as --help says (torchrun skips it: a typo would go unseen)
    code, out = exit_of(["--signals-to-handle", "SIGTERM,SIGFOO", script], capsys)
    assert code == 2 and "'SIGFOO' is not a signal of this system" in out.err
    code, out = exit_of(["--signals-to-handle", "SIGKILL", script], capsys)
    assert code == 2 and "SIGKILL cannot be handled" in out.err


def test_timeouts(script, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "5")
    monkeypatch.setenv("TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT", "60")
    config = parse([script])
    assert (config["shutdown_timeout"], config["exit_barrier_timeout"]) == (5.0, 60.0)
    config = parse(["--shutdown-timeout", "0.5", "--exit-barrier-timeout", "10", script])
    assert (config["shutdown_timeout"], config["exit_barrier_timeout"]) == (0.5, 10.0)
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "7")
    assert parse([script])["shutdown_timeout"] == 7.0
    code, out = exit_of(["--shutdown-timeout", "-1", script], capsys)
    assert code == 2 and "--shutdown-timeout" in out.err


@pytest.mark.parametrize("argv,needle", [
    (["--max-restarts", "-1"], "--max-restarts"),
    (["--monitor-interval", "0"], "--monitor-interval"),
    (["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h:1"], "v2 API is off by default"),
    (["--rdzv-backend", "zookeeper", "--rdzv-endpoint", "h:1"], "unknown backend"),
    (["--master-port", "70000"], "--master-port"),
    (["--nproc-per-node", "0"], "--nproc-per-node"),
    (["--nproc-per-node", "tpu"], "--nproc-per-node"),
    (["--start-method", "thread"], "--start-method"),
    (["--max-restarts", "x"], "--max-restarts"),
    (["--no-such-flag"], "unrecognized arguments"),
])  # fmt: skip
def test_bad_values_exit_2(script, capsys, argv, needle):
    code, out = exit_of([*argv, script], capsys)
    assert code == 2 and needle in out.err


@pytest.mark.parametrize("argv,message", [
    (["--nnodes", "-1"], "--nnodes -1: a job has at least one node"),
    (["--nnodes", "3:2"], "--nnodes 3:2: MIN (3) is greater than MAX (2)"),
    (["--standalone", "--nnodes", "3:2"], "--nnodes 3:2: MIN (3) is greater than MAX (2)"),
    (["--exit-barrier-timeout", "nan"], "--exit-barrier-timeout: nan is not a finite number of seconds"),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout: inf is not a finite number of seconds"),
    (["--monitor-interval", "nan"], "--monitor-interval: nan is not a finite number of seconds"),
    (["--max-restarts", "-3"], "--max-restarts: must be at least 0, got -3"),
    (["--nnodes", "2", "--node-rank", "-1"], "--node-rank: must be at least 0, got -1"),
    (["--nnodes", "2", "--master-port", "70000"], "--master-port: must be from 0 to 65535, got 70000"),
    (["--signals-to-handle", "SIGTERM,SIGUSR3"], "--signals-to-handle: 'SIGUSR3' is not a signal of this system"),
    (["--rdzv-conf", "join_timeout=-5"], '--rdzv-conf join_timeout=-5: "-5" is not a duration'),
    (["--rdzv-conf", "timeout=abc"], '--rdzv-conf timeout=abc: "abc" is not a duration'),
    (["--rdzv-conf", "keep_alive_max_attempt=0"], "--rdzv-conf keep_alive_max_attempt=0: expected a positive integer"),
    (["--rdzv-conf", "auth_token_file=/nonexistent/secret"], "job secret file /nonexistent/secret: cannot read it"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-conf", "timeout=x"], '--rdzv-conf timeout=x: "x" is not a duration'),
    (["--nnodes", "1:2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-conf", "lease_ttl=zz"],
     '--rdzv-conf lease_ttl=zz: "zz" is not a duration'),
])  # fmt: skip
def test_usage_errors_read_as_a_person_wrote_them(script, capsys, argv, message):
    """Each is one clear line, exit 2, before anything starts: no JSON layer's words
    (positions, Rust types), no unrelated warning before it."""
    code, out = exit_of([*argv, script], capsys)
    assert code == 2, out.err
    said = [line for line in out.err.strip().splitlines() if line.startswith("elastix run: error: ")]
    assert len(said) == 1 and message in said[0], out.err
    for artefact in ("line 1", "column", "u32", "u16", "f64", "expected value", "WARNING"):
        assert artefact not in out.err, out.err


def test_unimplemented_flags_are_refused_unless_default(script, capsys):
    code, out = exit_of(["--logs-specs", "mine", script], capsys)
    assert code == 2 and "elastix does not implement" in out.err and "--logs-specs mine" in out.err


def test_duplicate_filters_reach_the_agent_with_torchs_comma_escape(script):
    warnings = []
    config = parse(["--tee", "1", "--duplicate-stdout-filters", "loss,a,,b,", "--duplicate-stderr-filters", "",
                    script], warnings)  # fmt: skip
    assert config["duplicate_stdout_filters"] == ["loss", "a,b"]  # an empty filter matches nothing
    assert config["duplicate_stderr_filters"] == []
    assert warnings == []


def test_duplicate_filters_without_tee_say_they_do_nothing(script):
    warnings = []
    parse(["--duplicate-stderr-filters", "loss", script], warnings)
    assert warnings == ["--duplicate-stderr-filters copies tee'd lines only, and no rank tees stderr (see --tee)"]


def test_print_completion_writes_a_script_for_elastix_run(script, capsys):
    pytest.importorskip("shtab")
    code, out = exit_of(["--print-completion", "bash", script], capsys)
    assert code == 0 and "_shtab_elastix" in out.out and "--nproc-per-node" in out.out
    code, out = exit_of(["--print-completion", "fish", script], capsys)
    assert code == 2 and "invalid choice: 'fish'" in out.err


def test_an_unknown_event_log_handler_is_a_usage_error(script, capsys):
    code, out = exit_of(["--event-log-handler", "kafka", script], capsys)
    assert code == 2 and "--event-log-handler 'kafka': use one of null, console" in out.err


def test_unimplemented_flags_accept_their_defaults(script):
    parse(["--event-log-handler", "null", "--duplicate-stdout-filters", "", "--duplicate_stderr_filters", "",
           "--start-method", "forkserver", "--monitor-interval", "5", script])  # fmt: skip


# --- aliases, abbreviations and the environment --------------------------------------------


@pytest.mark.parametrize("dashed,alias,dest", TORCHRUN_FLAGS)
def test_every_torchrun_flag_and_alias(dashed, alias, dest, script):
    parser = build_parser()
    for option in filter(None, (dashed, alias)):
        if dest in SAMPLE_VALUES:
            args = parser.parse_args([option, SAMPLE_VALUES[dest], script])
            assert getattr(args, dest) == CONVERTED.get(dest, SAMPLE_VALUES[dest])
        else:
            assert getattr(parser.parse_args([option, script]), dest) is True


def test_abbreviations(script, capsys):
    # Python 3.11 calls --nproc ambiguous between --nproc-per-node and --nproc_per_node
    assert parse(["--nproc", "2", script])["local_world_size"] == 2
    assert parse(["--max_r", "2", script])["max_restarts"] == 2
    code, out = exit_of(["--r", "1", script], capsys)
    assert code == 2 and "ambiguous option" in out.err


@pytest.mark.parametrize("dashed,alias,dest", TORCHRUN_FLAGS)
def test_pet_env_fallback(dashed, alias, dest, script, monkeypatch):
    if dest in ("logs_specs", "numa_binding"):  # no env fallback in torch
        monkeypatch.setenv(f"PET_{dest.upper()}", "x")
        assert getattr(build_parser().parse_args([script]), dest) is None
        return
    value = SAMPLE_VALUES.get(dest, "1")
    monkeypatch.setenv(f"PET_{dest.upper()}", value)
    args = build_parser().parse_args([script])
    expected = CONVERTED.get(dest, value) if dest in SAMPLE_VALUES else True
    assert getattr(args, dest) == expected


def test_precedence_cli_elastix_pet_default(script, monkeypatch):
    assert parse([script])["local_world_size"] == 1
    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")
    assert parse([script])["local_world_size"] == 2
    monkeypatch.setenv("ELASTIX_NPROC_PER_NODE", "3")
    assert parse([script])["local_world_size"] == 3
    assert parse(["--nproc-per-node", "4", script])["local_world_size"] == 4


def test_boolean_env_values(script, monkeypatch, capsys):
    monkeypatch.setenv("PET_STANDALONE", "0")
    assert build_parser().parse_args([script]).standalone is False
    assert build_parser().parse_args(["--standalone", script]).standalone is True
    monkeypatch.setenv("PET_STANDALONE", "2")  # torch: bool(int(value))
    assert build_parser().parse_args([script]).standalone is True
    monkeypatch.setenv("PET_STANDALONE", "true")  # torch's PET_* take integers only
    code, out = exit_of([script], capsys)
    assert code == 2 and "PET_STANDALONE='true'" in out.err
    monkeypatch.setenv("ELASTIX_STANDALONE", "yes")
    assert build_parser().parse_args([script]).standalone is True
    monkeypatch.setenv("ELASTIX_STANDALONE", "off")
    assert build_parser().parse_args([script]).standalone is False


def test_bad_env_value_names_the_variable(script, monkeypatch, capsys):
    monkeypatch.setenv("PET_MASTER_PORT", "abc")
    code, out = exit_of([script], capsys)
    assert code == 2 and "PET_MASTER_PORT='abc'" in out.err and "--master-port" in out.err
    # an explicit flag wins over a bad environment value, as with torch
    assert parse(["--master-port", "5", script])["master_port"] == 5
    monkeypatch.setenv("ELASTIX_START_METHOD", "thread")
    code, out = exit_of(["--master-port", "5", script], capsys)
    assert code == 2 and "ELASTIX_START_METHOD" in out.err and "choose from" in out.err


def test_pet_master_port_turns_off_implicit_standalone(script, monkeypatch):
    monkeypatch.setenv("PET_MASTER_PORT", "29511")
    config = parse([script])
    assert (config["rdzv_backend"], config["master_port"]) == ("static", 29511)


# --- nproc-per-node ---------------------------------------------------------------------------


def test_nproc_cpu_uses_affinity(script, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    monkeypatch.setattr(nproc, "cgroup_cpu_limit", lambda root=None: None)
    assert parse(["--nproc-per-node", "cpu", script])["local_world_size"] == 3
    monkeypatch.setattr(nproc, "cgroup_cpu_limit", lambda root=None: 2)
    assert parse(["--nproc-per-node", "cpu", script])["local_world_size"] == 2


def test_cgroup_v2_quota(tmp_path):
    root = tmp_path / "cgroup"
    (root / "job" / "step").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "job" / "cpu.max").write_text("250000 100000\n")  # 2.5 CPUs -> 3
    (root / "job" / "step" / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "cgroup.txt"
    proc.write_text("0::/job/step\n")
    assert nproc.cgroup_cpu_limit(str(root), str(proc)) == 3
    proc.write_text("0::/\n")  # a container's namespace: only the root counts
    assert nproc.cgroup_cpu_limit(str(root), str(proc)) is None
    (root / "cpu.max").write_text("50000 100000\n")
    assert nproc.cgroup_cpu_limit(str(root), str(proc)) == 1


def test_cgroup_v1_quota(tmp_path):
    root = tmp_path / "cgroup"
    leaf = root / "cpu,cpuacct" / "docker" / "abc"
    leaf.mkdir(parents=True)
    (leaf / "cpu.cfs_quota_us").write_text("400000\n")
    (leaf / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup.txt"
    proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n")
    assert nproc.cgroup_cpu_limit(str(root), str(proc)) == 4


def test_usable_cpu_count_on_this_machine():
    assert 1 <= nproc.usable_cpu_count() <= (os.cpu_count() or 1)


def test_nproc_gpu(script, monkeypatch, capsys):
    monkeypatch.setattr(nproc, "_nvidia_smi_count", lambda: 4)
    assert parse(["--nproc-per-node", "gpu", script])["local_world_size"] == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert parse(["--nproc-per-node", "gpu", script])["local_world_size"] == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,7,2")  # CUDA stops at the first invalid index
    assert parse(["--nproc-per-node", "gpu", script])["local_world_size"] == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    assert parse(["--nproc-per-node", "auto", script])["local_world_size"] == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    code, out = exit_of(["--nproc-per-node", "gpu", script], capsys)
    assert code == 2 and "no NVIDIA GPU found" in out.err
    monkeypatch.setattr(nproc, "_nvidia_smi_count", lambda: None)  # no nvidia-smi
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert parse(["--nproc-per-node", "gpu", script])["local_world_size"] == 3
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    code, out = exit_of(["--nproc-per-node", "gpu", script], capsys)
    assert code == 2 and "no NVIDIA GPU found" in out.err


def test_nproc_auto_without_gpu_counts_cpus(script, monkeypatch):
    monkeypatch.setattr(nproc, "_nvidia_smi_count", lambda: None)
    monkeypatch.setattr(nproc, "usable_cpu_count", lambda root=None: 5)
    assert parse(["--nproc-per-node", "auto", script])["local_world_size"] == 5


def test_nproc_xpu(script, monkeypatch, capsys):
    code, out = exit_of(["--nproc-per-node", "xpu", script], capsys)
    assert code == 2 and "ZE_AFFINITY_MASK" in out.err
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0,1")
    assert parse(["--nproc-per-node", "xpu", script])["local_world_size"] == 2


# --- main(): the agent call, exit codes, help ------------------------------------------------


def test_main_hands_the_config_to_the_agent_and_exits_with_its_code(script, agent, capsys):
    code, _ = exit_of(["--nproc-per-node", "2", script, "--lr", "0.1"], capsys)
    assert code == 0
    (config,) = agent.configs
    _core.check_agent_config(json.dumps(config))
    assert config["args"] == ["-u", script, "--lr", "0.1"] and config["local_world_size"] == 2
    # the agent itself takes SIGINT over while it runs (see test_run.py); Python's handler
    # is left as it is
    assert agent.handlers == [signal.default_int_handler]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    for report, expected in [
        ({"state": "FAILED", "exit_code": 1}, 1),
        ({"state": "INTERRUPTED", "exit_code": 143}, 143),
    ]:
        agent.report = {**OK_REPORT, **report}
        assert exit_of([script], capsys)[0] == expected


def test_main_reports_agent_errors(script, agent, capsys):
    agent.report = ValueError('--rdzv-conf: unknown key "heartbeat_timout"')
    code, out = exit_of([script], capsys)
    assert code == 2 and 'unknown key "heartbeat_timout"' in out.err
    agent.report = RuntimeError("boom")
    code, out = exit_of([script], capsys)
    assert code == 1 and "RuntimeError: boom" in out.err


def test_main_without_an_agent_in_the_extension(script, monkeypatch, capsys):
    monkeypatch.delattr(_core, "run_agent", raising=False)
    code, out = exit_of([script], capsys)
    assert code == 1 and "no agent" in out.err


def test_nested_launcher_passes_the_root_cause_up(script, agent, tmp_path, monkeypatch, capsys):
    child = tmp_path / "child.json"
    child.write_text(
        json.dumps({"message": {"message": "ValueError: x", "extraInfo": {"py_callstack": "tb", "timestamp": "1"}}})
    )
    failure = {"global_rank": 1, "local_rank": 1, "host": "h", "pid": 7, "exitcode": 3, "signal": None,
               "timestamp": 5.0, "error_file": str(child), "message": "ValueError: x"}  # fmt: skip
    later = {**failure, "global_rank": 0, "local_rank": 0, "timestamp": 6.0, "error_file": None}
    agent.report = {**OK_REPORT, "state": "FAILED", "exit_code": 1, "failures": [later, failure]}
    own = tmp_path / "own.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(own))
    assert exit_of([script], capsys)[0] == 1
    data = json.loads(own.read_text())
    assert data["message"]["message"] == "ValueError: x" and data["message"]["errorCode"] == 3


def test_help_is_complete_and_grouped(capsys):
    code, out = exit_of(["--help"], capsys)
    assert code == 0
    text = out.out
    for dashed, alias, _ in TORCHRUN_FLAGS:
        assert dashed in text and (alias is None or alias in text)
    for new in ("--exit-barrier-timeout", "--line-prefix", "ELASTIX_", "PET_"):
        assert new in text
    for group in ("nodes and workers", "rendezvous", "static rendezvous", "the program", "logs",
                  "failures, restarts and signals", "implements in part"):  # fmt: skip
        assert group in text


@pytest.mark.torch
def test_torchrun_parity_when_torch_is_installed():
    """Every option string of the installed torchrun exists here with the same default."""
    run = torch_gate.need("torch.distributed.run")
    theirs = run.get_args_parser()
    ours = {opt: a for a in build_parser()._actions for opt in a.option_strings}
    # ours resolve later (master_addr, master_port: 29500 in torch 2.11, None in newer torch)
    different_defaults = {"master_addr", "master_port", "log_line_prefix_template", "shutdown_timeout", "help"}
    for action in theirs._actions:
        for option in action.option_strings:
            if option.startswith(("--print-completion", "--print_completion")):
                continue  # shell completion generation (needs shtab): not part of torchrun 2.11
            assert option in ours, option
            if action.dest not in different_defaults and action.default is not None:
                assert ours[option].default == action.default, option


def test_entry_points_as_subprocesses(tmp_path):
    for argv in (["-m", "elastix.cli.run", "--help"], ["-m", "elastix", "run", "--help"]):
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "--nproc-per-node" in out.stdout
    out = subprocess.run([sys.executable, "-m", "elastix", "run"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "required: program" in out.stderr


def test_importing_the_cli_stays_light():
    code = "import sys, elastix.cli, elastix.cli.run; print(sorted(m for m in ('numpy', 'elastix.agent.launcher', 'elastix.agent.spec') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_elastix_command(capsys):
    elastix_main(["--version"])
    assert capsys.readouterr().out.startswith("elastix ")
    with pytest.raises(SystemExit) as info:
        elastix_main([])
    assert info.value.code == 2 and "run" in capsys.readouterr().out


@pytest.mark.parametrize("argv,hint", [
    (["--standalone", "--nproc-per-node", "2", "train.py"], "did you mean `elastix run --standalone --nproc-per-node 2 train.py`?"),
    (["train.py", "--lr", "0.1"], "did you mean `elastix run train.py --lr 0.1`?"),
    (["runn", "train.py"], "did you mean `elastix run`?"),
    (["launch"], "choose from run, store, status, dump"),
])  # fmt: skip
def test_a_forgotten_or_misspelt_command_gets_a_suggestion(capsys, argv, hint):
    with pytest.raises(SystemExit) as info:
        elastix_main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(f"elastix: error: {argv[0]!r} is not a command: ") and hint in err, (
        err
    )


def test_a_usage_error_is_one_line_and_where_the_flags_are(script):
    done = subprocess.run(
        [sys.executable, "-m", "elastix", "run", "--standalone", "--nnodes", "3", "--nproc-per-node", "2", script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("elastix run: error: --standalone runs a single node"), lines
    assert lines[1] == "elastix run: see `elastix run --help` for every flag", lines
    # nothing before it: no banner, no note about OMP_NUM_THREADS for a job that never starts
    assert "OMP_NUM_THREADS" not in done.stderr and "usage:" not in done.stderr
