"""Warm standby workers: a standby runs a program exactly as a cold start would (down to its
command line and environment), the launcher asks for standbys only when they can be used,
and restarted workers under `elastix run` really come from them."""

import json
import os
import subprocess
import sys

import pytest

from elastix.agent.launcher import LaunchConfig, agent_config
from elastix.agent.standby import standby_env
from elastix.cli.run_config import config_from_args
from elastix.cli.run_flags import build_parser

PROBE = r"""
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "file": __file__,
                  "rank": os.environ.get("RANK"), "main_file": sys.modules["__main__"].__file__,
                  "orig_argv": sys.orig_argv, "spec": getattr(__spec__, "name", None),
                  "code_file": sys._getframe().f_code.co_filename,
                  "listing": sorted(os.listdir(os.path.dirname(__file__))), "path": sys.path,
                  "cmdline": open("/proc/self/cmdline", "rb").read().decode().split("\0"),
                  "environ": dict(os.environ), "customized": os.environ.get("CUSTOMIZED")}))
if os.environ.get("FAIL"):
    raise ValueError("bad input")
"""


def activate(tmp_path, args, env=None, message=True):
    """Starts `python *args` as a standby (as the agent does: the standby variables, the pipe
    as fd 3), activates it with the environment a cold start would get, returns (exit code,
    stdout, stderr)."""
    read_end, write_end = os.pipe()
    standby = {**os.environ, **standby_env(args, os.environ), "ELASTIX_STANDBY_FD": "3"}
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=tmp_path,
        env=standby,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        close_fds=False,
        preexec_fn=lambda: os.dup2(read_end, 3),  # as the agent: the pipe as fd 3
    )
    os.close(read_end)
    if message:
        worker_env = {**os.environ, **(env or {})}
        os.write(write_end, b"".join(f"{key}={value}".encode() + b"\0" for key, value in worker_env.items()))
    os.close(write_end)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def cold(tmp_path, args, env=None):
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_a_script_runs_as_a_cold_start_would_run_it(tmp_path):
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "probe.py"
    script.write_text(PROBE)
    args = ["-u", str(script), "--lr", "0.1"]
    warm, cold_start = activate(tmp_path, args, {"RANK": "3"}), cold(tmp_path, args, {"RANK": "3"})
    assert warm[0] == cold_start[0] == 0, warm[2]
    assert json.loads(warm[1]) == json.loads(cold_start[1])
    assert json.loads(warm[1])["path0"] == str(tmp_path / "sub")


def test_a_script_named_relatively_runs_as_a_cold_start_would_run_it(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "probe.py").write_text(PROBE)
    args = ["-u", os.path.join("sub", "probe.py"), "--epochs", "2"]
    warm, cold_start = activate(tmp_path, args), cold(tmp_path, args)
    assert warm[0] == cold_start[0] == 0, warm[2]
    seen = json.loads(warm[1])
    assert seen == json.loads(cold_start[1])
    assert os.path.isabs(seen["file"]) and seen["argv"][0] == os.path.join("sub", "probe.py")
    assert seen["orig_argv"][1:] == args


def test_a_module_runs_as_python_m_would_run_it(tmp_path):
    (tmp_path / "probepkg").mkdir()
    (tmp_path / "probepkg" / "__init__.py").write_text("")
    (tmp_path / "probepkg" / "tool.py").write_text(PROBE)
    args = ["-u", "-m", "probepkg.tool", "x"]
    warm, cold_start = activate(tmp_path, args, {"RANK": "1"}), cold(tmp_path, args, {"RANK": "1"})
    assert warm[0] == cold_start[0] == 0, warm[2]
    assert json.loads(warm[1]) == json.loads(cold_start[1])


def test_a_failing_program_exits_1_with_its_own_traceback(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    code, _, err = activate(tmp_path, ["-u", str(script)], {"FAIL": "1"})
    assert code == 1
    assert "ValueError: bad input" in err
    # the first frame is the program's, as in a cold start: no bootstrap or runpy frames
    assert err.splitlines()[1].startswith(f'  File "{script}"'), err
    assert "runpy" not in err and "_standby" not in err


def test_sys_exit_codes_pass_through(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text("import sys\nsys.exit(5)\n")
    assert activate(tmp_path, ["-u", str(script)])[0] == 5


def test_eof_without_a_message_exits_quietly(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("print('the program ran')\n")
    assert activate(tmp_path, ["-u", str(script)], message=False) == (0, "", "")


def test_a_site_customization_runs_as_in_a_cold_start(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['CUSTOMIZED'] = 'yes'\n")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    args = ["-u", str(script)]
    env = {"PYTHONPATH": str(site)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(site))  # the agent's own environment has it
        warm, cold_start = activate(tmp_path, args), cold(tmp_path, args, env)
    assert warm[0] == cold_start[0] == 0, warm[2]
    assert json.loads(warm[1]) == json.loads(cold_start[1])
    assert json.loads(warm[1])["customized"] == "yes"


@pytest.mark.parametrize(
    "args, usable",
    [
        (["-u", "train.py", "-x"], True),
        (["-u", "-m", "pkg.train"], True),
        (["-u", "-m"], False),
        (["-u", "-O", "train.py"], False),
        (["-u", "-E", "train.py"], False),  # would ignore PYTHONPATH
        (["train.py"], False),
        ([], False),
    ],
)
def test_standbys_only_stand_in_for_command_lines_they_reproduce(args, usable):
    assert (standby_env(args, {}) is not None) == usable


def run_config(argv):
    return config_from_args(build_parser().parse_args(argv), warn=lambda message: None)


def test_elastix_run_asks_for_standbys_only_when_a_restart_can_happen(tmp_path):
    script = str(tmp_path / "train.py")
    open(script, "w").close()
    # one node and no restart budget: nothing will ever restart
    assert run_config(["--standalone", script])["standby"] is None
    config = run_config(["--standalone", "--max-restarts", "2", script])
    assert config["standby"]["PYTHONPATH"].split(os.pathsep)[0].endswith(os.path.join("worker", "site"))
    # an elastic multi-node job restarts on membership changes, without a budget
    assert run_config(["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", script])["standby"]
    assert run_config(["--standalone", "--max-restarts", "2", "-m", "pkg.train"])["standby"]
    assert run_config(["--standalone", "--max-restarts", "2", "--no-python", "/bin/true"])["standby"] is None
    assert run_config(["--standalone", "--max-restarts", "2", "--no-standby-workers", script])["standby"] is None


def test_launch_config_can_turn_standbys_off():
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, max_restarts=1)
    assert agent_config(config, sys.executable, ["-u", "-m", "mod"])["standby"]
    config.standby_workers = False
    assert agent_config(config, sys.executable, ["-u", "-m", "mod"])["standby"] is None


def comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


WAITS = """
import os, time
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(os.environ["OUT_DIR"], "stop")):
    if time.monotonic() > deadline:
        raise SystemExit("the test never asked this worker to stop")
    time.sleep(0.05)
"""


def test_a_standby_is_named_as_one_and_its_loss_is_said(tmp_path, marker):
    """`ps -e`, `top` and `pgrep` show a waiting standby as elastix-standby, not as a second copy
    of the worker; one that ends while it waits (killed here) is said and replaced."""
    from agents import assert_nothing_left, elastix_run, finish, wait_for
    from conftest import marked_processes

    script = tmp_path / "waits.py"
    script.write_text(WAITS)
    proc = elastix_run("--standalone", "--max-restarts", 1, script, out_dir=tmp_path, marker=marker)
    try:
        standbys = wait_for(
            lambda: [pid for pid in marked_processes(marker) if comm(pid) == "elastix-standby"],
            what="the standby waiting, under its own name",
        )
        assert len(standbys) == 1, standbys
        worker = [pid for pid in marked_processes(marker) if comm(pid) not in ("elastix-standby", None)]
        assert any(comm(pid).startswith("python") for pid in worker), {pid: comm(pid) for pid in worker}
        os.kill(standbys[0], 9)
        wait_for(
            lambda: [pid for pid in marked_processes(marker) if comm(pid) == "elastix-standby" and pid != standbys[0]],
            what="another standby in its place",
        )
    finally:
        (tmp_path / "stop").touch()
        code, _out, err = finish(proc)
    assert code == 0, err
    assert f"the standby interpreter of local rank 0 (pid {standbys[0]}) ended while it waited" in err, err
    assert_nothing_left(marker)
