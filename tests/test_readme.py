"""Every `elastix` command in README.md and in the pages of docs/ it links to, run for real, so
the documentation cannot drift from the code.

A fenced block (plain, bash, sh or console) with a command that starts with `elastix` or
`elastix-store` is a command block: each of its commands is run, in order, on this machine.
The README's placeholders stand for real things here: node and host names (`node0`, `node1`,
`host`) for 127.0.0.1, 127.0.0.2, ...; `etcd1`.. for the members of a real etcd cluster
(tests/etcd_cluster.py; where etcd is not installed, that block is skipped, saying so, as the
other etcd tests are); ports for free ones reserved without probing; `train.py` for a small
worker that records what it was given; `/tmp/...` and `~/...` for files in a directory of the
test; `PYTHON_EXEC=/some/env/bin/python` for a virtual environment the test makes, whose
interpreter the workers must run on. A job of several nodes (`--nnodes N`, or `MIN:MAX`: MAX
nodes, so no last call is waited for) runs as that many agents, each with its own
ELASTIX_LOCAL_ADDR; nothing else is added to a README command. `elastix status` and `elastix dump` are asked about a job the test
starts under the command's run ID and endpoint; a store is started, checked and stopped.

A command this test cannot run fails it, saying how to mark it: nothing is skipped in silence.
The commands not run are listed below in NOT_RUN, each with the reason; shell commands that
prepare an elastix command are in SETUP and run as written.

The README's quick start (clone, install, run) is checked for its form too: the install uses
the `examples` extra and shows the build's progress, and the run is the main job this test runs.
Links between README.md and docs/ must lead to a file and a heading.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from agents import assert_nothing_left, wait_for
from conftest import REPO, held_port

README = os.path.join(REPO, "README.md")
# the pages the README's reference material lives in: their commands are run as the README's
DOCS = sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
PYPROJECT = os.path.join(REPO, "pyproject.toml")

# Commands of the README's command blocks that are not run here, and why. Keep it tiny.
IN_A_CHECKOUT = "this test runs in a checkout already"
INSTALLS = "installs elastix; this test runs in the environment it was installed in"
NOT_RUN = {
    "git clone https://github.com/elastix/elastix": IN_A_CHECKOUT,
    "cd elastix": IN_A_CHECKOUT,
    "python3 -m venv .venv": INSTALLS,
    ". .venv/bin/activate": INSTALLS,
    "pip install -v -e '.[examples]'": INSTALLS,
}

# Shell commands that prepare the elastix commands of their block: run with bash as written,
# `~` being a directory of the test.
SETUP: set = set()

HOW_TO_MARK = (
    "tests/test_readme.py runs `elastix run` (a numeric --nproc-per-node; train.py or "
    "examples/train_digits.py as the program; PYTHON_EXEC naming a virtual environment's "
    "bin/python), `elastix status`, `elastix dump`, `elastix secret` and "
    "`elastix store` / "
    "`elastix-store`, with node0, node1, ... host or etcd1, ... as host names; make the command one of "
    "those, or add it to NOT_RUN in tests/test_readme.py with the reason it cannot run"
)

# The README's train.py: records its rank, what it was given and the interpreter it runs on;
# with README_HOLD it imports elastix (which arms stack dumps) and waits for that file, bounded.
WORKER = """\
import json, os, sys, time

record = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "ELASTIX_ROUND")}
record["argv"] = sys.argv[1:]
record["executable"], record["prefix"] = sys.executable, sys.prefix
path = os.path.join(os.environ["README_OUT"], "round{ELASTIX_ROUND}_rank{RANK}.json".format(**record))
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
hold = os.environ.get("README_HOLD")
if hold:
    import elastix  # noqa: F401

    deadline = time.monotonic() + 120
    while not os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


# -- reading the README -------------------------------------------------------------------------


@dataclasses.dataclass
class Command:
    path: str  # README.md or docs/PAGE.md
    line: int  # where it starts there
    text: str  # continuation lines joined, without its comment
    comment: str
    output: list = dataclasses.field(default_factory=list)  # shown after a `$ ` prompt

    def where(self) -> str:
        return f"{self.path}:{self.line}: `{self.text}`"


@dataclasses.dataclass
class Block:
    path: str
    line: int
    commands: list

    def id(self) -> str:
        return f"line{self.line}" if self.path == "README.md" else f"{self.path}:line{self.line}"


def split_comment(text: str):
    """(command, comment): the comment starts at a `#` outside quotes, after a blank."""
    quote = None
    for i, c in enumerate(text):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].strip(), text[i + 1 :].strip()
    return text.strip(), ""


def parse_block(path: str, start: int, body: list) -> Block:
    prompted = any(line.startswith("$ ") for _, line in body)
    commands, pending = [], None
    for number, line in body:
        if prompted and not line.startswith("$ "):
            if commands and pending is None:
                commands[-1].output.append(line)
            continue
        line = line[2:] if prompted else line
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line.strip())
        elif line.strip():
            pending = (number, line.strip())
        else:
            continue
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1].rstrip())
            continue
        text, comment = split_comment(pending[1])
        commands.append(Command(path, pending[0], re.sub(r"\s+", " ", text), comment))
        pending = None
    return Block(path, start, commands)


def segments(command: Command):
    return [part.strip() for part in command.text.split(" && ")]


def words(segment: str):
    """(environment assignments, argv) of one simple command."""
    tokens = shlex.split(segment)
    env = {}
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    return env, tokens


def is_elastix(segment: str) -> bool:
    try:
        _, argv = words(segment)
    except ValueError:
        return False
    return bool(argv) and argv[0] in ("elastix", "elastix-store")


def command_blocks(file: str) -> list:
    path = os.path.relpath(file, REPO)
    blocks, start, lang, body = [], None, "", []
    with open(file) as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            if start is None:
                start, lang, body = number, line[3:].strip(), []
                continue
            if lang in ("", "bash", "sh", "shell", "console"):
                block = parse_block(path, start, body)
                if any(is_elastix(s) for c in block.commands for s in segments(c)):
                    blocks.append(block)
            start = None
        elif start is not None:
            body.append((number, line))
    return blocks


BLOCKS = [block for file in (README, *DOCS) for block in command_blocks(file)]


# -- the README's placeholders, made real ------------------------------------------------------


def reserve(stack):
    """A port held until the command ends (conftest.held_port)."""
    holder = held_port()
    stack.callback(holder.close)
    return holder.getsockname()[1]


class Places:
    """README names -> this machine, for one command: hosts -> 127.0.0.N, etcd members -> the
    test's cluster, ports -> reserved ones, /tmp and ~ paths -> the test's directory."""

    ENDPOINTS = re.compile(r"^[A-Za-z][\w.-]*:\d+(,[A-Za-z][\w.-]*:\d+)*$")

    def __init__(self, ctx, command, stack):
        self.ctx, self.command, self.stack = ctx, command, stack
        self.ports = {}

    def addr(self, name):
        m = re.fullmatch(r"(?:node|host)(\d*)", name)
        if not m:
            fail(self.command, f"host name {name!r} is none of node0, node1, ..., host, host0, ...")
        return f"127.0.0.{int(m.group(1) or 0) + 1}"

    def port(self, number):
        if number not in self.ports:
            self.ports[number] = reserve(self.stack)
        return self.ports[number]

    def endpoints(self, value):
        items = [item.rsplit(":", 1) for item in value.split(",")]
        if all(re.fullmatch(r"etcd\d+", host) for host, _ in items):
            ports = self.ctx.etcd().client_ports
            return ",".join(f"127.0.0.1:{ports[int(host[4:]) - 1]}" for host, _ in items)
        return ",".join(f"{self.addr(host)}:{self.port(port)}" for host, port in items)

    def path(self, text):
        where = {"~/": self.ctx.home + "/", "/tmp/": self.ctx.files + "/"}
        return re.sub(r"(^|=)(~/|/tmp/)", lambda m: m[1] + where[m[2]], text)

    def argv(self, argv):
        out = []
        for i, token in enumerate(argv):
            if self.ENDPOINTS.match(token):
                token = self.endpoints(token)
            elif token.isdigit() and i and argv[i - 1] in ("--port", "--master-port", "--metrics-port"):
                token = str(self.port(token))
            elif token == "train.py":
                out.append(self.ctx.worker)
                continue
            out.append(self.path(token))
        return out

    def text(self, text):
        """Output shown in the README, with the same names made real."""
        text = re.sub(r"\b(node\d+|host\d*):(\d+)", lambda m: f"{self.addr(m[1])}:{self.port(m[2])}", text)
        return re.sub(r"\[::\]:(\d+)", lambda m: f"[::]:{self.port(m[1])}", text)


def fail(command, why, how=HOW_TO_MARK):
    pytest.fail(f"{command.where()}: {why}.\n{how}", pytrace=False)


# -- running ---------------------------------------------------------------------------------


class Process:
    """One command started by the test, its output in files (a pipe nobody reads could stall
    it), bounded in time and killed at the end."""

    def __init__(self, argv, env, log_dir, name, stack):
        self.name = name
        self.out_path, self.err_path = (os.path.join(log_dir, f"{name}.{s}") for s in ("out", "err"))
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, cwd=REPO, stdin=subprocess.DEVNULL)
        stack.callback(self.kill)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def out(self):
        with open(self.out_path) as f:
            return f.read()

    def err(self):
        with open(self.err_path) as f:
            return f.read()

    def finish(self, timeout=120):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} did not finish in {timeout}s:\n{self.out()}\n{self.err()}") from None

    def describe(self):
        return f"{self.name}: exit status {self.proc.returncode}\nstdout:\n{self.out()[-3000:]}\nstderr:\n{self.err()[-3000:]}"


class Context:
    """What the commands of one test share: directories, the worker, the marker that lets the
    `marker` fixture kill anything left behind, and an etcd cluster when one is asked for."""

    def __init__(self, request, files, tmp_path, marker):
        self.request, self.files, self.tmp, self.marker = request, files, str(tmp_path), marker
        self.home = os.path.join(files, "home")
        os.makedirs(self.home, exist_ok=True)
        self.worker = os.path.join(self.tmp, "train.py")
        with open(self.worker, "w") as f:
            f.write(WORKER)
        self.count = 0
        self._etcd = None
        self.envs = {}

    def other_python(self, command, shown):
        """The README's `PYTHON_EXEC=/some/env/bin/python`: a virtual environment of the test's,
        made once per name, whose interpreter is not this one."""
        m = re.fullmatch(r"(/.+)/bin/python[\d.]*", shown)
        if not m:
            fail(command, f"PYTHON_EXEC={shown} does not name a virtual environment's bin/python")
        name = os.path.basename(m[1])
        if name not in self.envs:
            home = os.path.join(self.tmp, name)
            made = subprocess.run(
                [sys.executable, "-m", "venv", "--without-pip", home], capture_output=True, text=True, timeout=120
            )
            assert made.returncode == 0, (command.where(), made.stderr)
            self.envs[name] = os.path.join(home, "bin", "python")
        return self.envs[name]

    def etcd(self):
        if self._etcd is None:
            self._etcd = self.request.getfixturevalue("etcd")
        return self._etcd

    def fresh(self, name):
        self.count += 1
        path = os.path.join(self.tmp, f"{self.count}-{name}")
        os.makedirs(path)
        return path

    def env(self, extra):
        env = {k: v for k, v in os.environ.items() if k != "PYTHON_EXEC"}  # only a README command's
        env = {**env, "ELASTIX_TEST_MARKER": self.marker, **extra}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(REPO, "python"), env.get("PYTHONPATH")) if p)
        return env

    def start(self, argv, extra_env, name, stack):
        argv = [sys.executable, "-m", "elastix", "store", *argv[1:]] if argv[0] == "elastix-store" else argv
        argv = [sys.executable, "-m", "elastix", *argv[1:]] if argv[0] == "elastix" else argv
        return Process(argv, self.env(extra_env), self.fresh(name), name, stack)


def records(out_dir):
    found = []
    for name in os.listdir(out_dir):
        if name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                found.append(json.load(f))
    return found


def run_job(ctx, command, env, argv, stack):
    from elastix.cli.run_flags import build_parser

    try:
        args = build_parser().parse_args(argv[2:])
    except SystemExit:
        fail(command, "`elastix run` refuses its command line", "Its error is in the captured stderr below.")
    if not args.nproc_per_node.isdigit():
        fail(command, f"--nproc-per-node {args.nproc_per_node} depends on the machine")
    ours, digits = args.training_script == ctx.worker, args.training_script == "examples/train_digits.py"
    if args.module or args.no_python or not (ours or digits):
        fail(command, f"the program {args.training_script} is neither train.py nor examples/train_digits.py")
    nodes = 1 if args.standalone else int(args.nnodes.split(":")[-1])
    workers = int(args.nproc_per_node)
    out = ctx.fresh("records")
    given = args.training_script_args
    checkpoint = given[given.index("--checkpoint") + 1] if "--checkpoint" in given else None
    resumable = checkpoint is not None and os.path.exists(checkpoint)
    agents = []
    for i in range(nodes):
        local = {} if args.standalone else {"ELASTIX_LOCAL_ADDR": f"127.0.0.{i + 1}"}
        agents.append(ctx.start(argv, {**env, **local, "README_OUT": out}, f"agent{i}", stack))
    for agent in agents:
        try:
            code = agent.finish()
        except AssertionError as hung:  # the other agents' logs tell why, as often as its own
            others = "\n".join(other.describe() for other in agents if other is not agent)
            raise AssertionError(f"{command.where()}\n{hung}\n{others}") from None
        assert code == 0, f"{command.where()}\n{agent.describe()}"
    if ours:
        latest = max(int(r["ELASTIX_ROUND"]) for r in records(out))
        final = [r for r in records(out) if int(r["ELASTIX_ROUND"]) == latest]
        world = nodes * workers
        assert sorted(int(r["RANK"]) for r in final) == list(range(world)), (command.where(), final)
        assert {r["WORLD_SIZE"] for r in final} == {str(world)}, (command.where(), final)
        assert {r["GROUP_RANK"] for r in final} == {str(n) for n in range(nodes)}, (command.where(), final)
        assert all(r["argv"] == args.training_script_args for r in final), (command.where(), final)
        # the workers ran on PYTHON_EXEC's interpreter, in its environment; else on elastix's own
        python = env.get("PYTHON_EXEC", sys.executable)
        prefix = os.path.dirname(os.path.dirname(python)) if "PYTHON_EXEC" in env else sys.prefix
        assert {r["executable"] for r in final} == {python}, (command.where(), python, final)
        assert {os.path.realpath(r["prefix"]) for r in final} == {os.path.realpath(prefix)}, (command.where(), final)
    else:
        shown = agents[0].out()
        assert "final test accuracy:" in shown, f"{command.where()}\n{agents[0].describe()}"
        if "--resume" in given:  # what the README says it prints
            said = f"resuming from {checkpoint} at step" if resumable else f"no checkpoint at {checkpoint} yet"
            assert said in shown, f"{command.where()}\n{agents[0].describe()}"
    if args.event_log:
        with open(args.event_log) as f:
            events = [json.loads(line)["event"] for line in f]
        assert events and events[-1] == "job_finished", (command.where(), events)


def job_to_ask(ctx, command, env, argv, stack):
    """`elastix status` / `dump`: a job of 2 workers under the command's run ID and endpoint,
    running until the test ends it; returns its agent and the file that ends it."""
    from elastix.cli import dump, status

    try:
        args = (status if argv[1] == "status" else dump).build_parser().parse_args(argv[2:])
    except SystemExit:
        fail(command, f"`elastix {argv[1]}` refuses its command line", "Its error is in the captured stderr below.")
    if args.rdzv_backend != "c10d":
        fail(command, f"asking a job on {args.rdzv_backend} is not done here")
    out, hold = ctx.fresh("records"), os.path.join(ctx.tmp, f"stop-{ctx.count}")
    job = [
        *("elastix", "run", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", args.rdzv_id, ctx.worker),
    ]
    host = args.rdzv_endpoint.split(",")[0].rsplit(":", 1)[0]  # the agent that serves the store
    agent = ctx.start(job, {**env, "ELASTIX_LOCAL_ADDR": host, "README_OUT": out, "README_HOLD": hold}, "job", stack)
    stack.callback(lambda: open(hold, "w").close())
    wait_for(lambda: len(records(out)) == 2 or agent.proc.poll() is not None, what="the job's workers")
    assert agent.proc.poll() is None, agent.describe()
    return agent, hold


def check_shown_output(command, places, text):
    """The README's sample output (after `$ `) has the shape of the real one: the same first
    words (up to the first `: `) and the same column headings."""
    shown = [line for line in command.output if line.strip()]
    if not shown:
        return
    head = places.text(shown[0].split(": ", 1)[0])
    assert text.splitlines()[0].startswith(head + ": "), (command.where(), head, text)
    for line in shown:
        if line.strip().isupper():  # a table's headings
            assert any(real.split() == line.split() for real in text.splitlines()), (command.where(), line, text)


def run_elastix(ctx, command, segment, stack):
    env, argv = words(segment)
    places = Places(ctx, command, stack)
    env = {name: places.path(value) for name, value in env.items()}
    if "PYTHON_EXEC" in env:
        env["PYTHON_EXEC"] = ctx.other_python(command, env["PYTHON_EXEC"])
    argv = places.argv(argv)
    what = "store" if argv[0] == "elastix-store" else argv[1] if len(argv) > 1 else ""
    if what == "run":
        run_job(ctx, command, env, argv, stack)
    elif what in ("status", "dump"):
        job, hold = job_to_ask(ctx, command, env, argv, stack)
        asked = ctx.start(argv, env, what, stack)
        code = asked.finish(timeout=60)
        assert code == 0, f"{command.where()}\n{asked.describe()}"
        if what == "status":
            assert re.match(r"job \S+ at \S+ \(c10d\): HEALTHY", asked.out()), asked.describe()
            check_shown_output(command, places, asked.out())
        else:
            rank = re.search(r"--rank (\d+)", command.text)
            assert f"=== rank {rank[1] if rank else 0} " in asked.out() and 'File "' in asked.out(), asked.describe()
        open(hold, "w").close()
        assert job.finish() == 0, job.describe()
    elif what == "store":
        store = ctx.start(argv, env, "store", stack)
        shown = re.search(r'prints "([^"]*)"', command.comment)
        expected = places.text(shown[1]) if shown else "elastix-store listening on "
        wait_for(lambda: store.out() or store.proc.poll() is not None, what="the store's first line", timeout=30)
        assert store.out().startswith(expected), f"{command.where()}: expected {expected!r}\n{store.describe()}"
        store.proc.send_signal(signal.SIGTERM)
        assert store.finish(timeout=30) == 0, store.describe()
    elif what == "secret":
        made = ctx.start(argv, env, "secret", stack)
        assert made.finish(timeout=30) == 0, made.describe()
        assert os.stat(argv[2]).st_mode & 0o777 == 0o600, command.where()
    else:
        fail(command, f"`elastix {what}` is not a command this test knows how to run")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The README's /tmp and ~: shared by the blocks, which run in the README's order (a
    checkpoint one block writes is the one the next resumes)."""
    return str(tmp_path_factory.mktemp("readme"))


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id() for b in BLOCKS])
def test_the_command_block_runs_as_written(block, request, files, tmp_path, marker):
    ctx = Context(request, files, tmp_path, marker)
    with contextlib.ExitStack() as stack:
        for command in block.commands:
            for segment in segments(command):
                if segment in NOT_RUN:
                    continue
                if is_elastix(segment):
                    run_elastix(ctx, command, segment, stack)
                elif segment in SETUP:
                    setup = segment.replace("~/", ctx.home + "/")
                    done = subprocess.run(["bash", "-c", setup], capture_output=True, text=True, timeout=30)
                    assert done.returncode == 0, (command.where(), done.stderr)
                else:
                    fail(command, f"`{segment}` is neither an elastix command nor in NOT_RUN or SETUP")
    assert_nothing_left(marker)


def test_the_lists_of_commands_not_run_are_all_in_the_readme():
    shown = {s for b in BLOCKS for c in b.commands for s in segments(c)}
    assert set(NOT_RUN) | SETUP <= shown, (set(NOT_RUN) | SETUP) - shown


# -- the README's form: its quick start, its links --------------------------------------------


def read(path):
    with open(path) as f:
        return f.read()


def unfenced(text):
    """The text without its fenced blocks, where `#` starts no heading."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def prose(text):
    """The text without its fenced blocks and inline code, where `](` starts no link."""
    return re.sub(r"`[^`\n]*`", "", unfenced(text))


def section(text, heading):
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {heading}' section"
    return m[1]


def first_block(text):
    """The command lines of the first fenced block of text."""
    m = re.search(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S)
    assert m, text[:200]
    return [line.strip() for line in m[1].splitlines() if line.strip()]


def extras():
    """pyproject.toml's [project.optional-dependencies]: extra -> requirements."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11: the table's `name = [...]` lines
        table = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[)", read(PYPROJECT), re.M | re.S)[1]
        return {m[1]: re.findall(r'"([^"]+)"', m[2]) for m in re.finditer(r"^([\w-]+)\s*=\s*\[(.*)\]", table, re.M)}
    with open(PYPROJECT, "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def test_the_quick_start_clones_installs_with_progress_and_runs_the_main_job():
    """Three command lines: clone, install into a virtual environment with the examples extra
    (pip shows the build backend's output, cargo's `Compiling ...` lines, only with -v: without
    it, five silent minutes), and the main job, which test_the_command_block_runs_as_written
    runs."""
    text = read(README)
    assert re.findall(r"^## (.+)$", unfenced(text), re.M)[0] == "Quick start", (
        "the quick start is not the first section"
    )
    clone, install, run = first_block(section(text, "Quick start"))

    def parts(line):
        return [words(segment)[1] for segment in line.split(" && ")]

    assert parts(clone) == [["git", "clone", "https://github.com/elastix/elastix"], ["cd", "elastix"]], clone
    steps = parts(install)
    assert steps[0][1:3] == ["-m", "venv"] and steps[1][:2] == [".", steps[0][3] + "/bin/activate"], install
    pip = steps[-1]
    assert pip[:2] == ["pip", "install"] and ("-v" in pip or "--verbose" in pip), install
    [target] = [word for word in pip if word.startswith(".[")]
    assert "-e" in pip and target == ".[examples]", install
    assert "scikit-learn" in extras()["examples"], extras()
    args = run.split()
    assert args[:2] == ["elastix", "run"] and "--standalone" in args, run
    assert args[args.index("--nproc-per-node") + 1] == "2" and "examples/train_digits.py" in args, run
    ran = [c.text for b in BLOCKS if b.path == "README.md" for c in b.commands]
    assert any(run in text for text in ran), (run, ran)


def test_the_test_command_installs_the_test_extra():
    """The other set-up command: the block under "## Test" that .ci/run runs verbatim."""
    [command] = first_block(section(read(README), "Test"))
    assert command.startswith("pip install -e '.[test]' && ") and "python -m pytest" in command, command
    assert "pytest>=7" in extras()["test"], extras()


def anchors(text):
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", unfenced(text), re.M)
    }


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda page: os.path.relpath(page, REPO))
def test_links_lead_to_a_file_and_a_heading(page):
    """The README's contents and its links into docs/, and docs/ pages' links back: a moved
    section leaves no link behind that points nowhere."""
    text = read(page)
    links = re.findall(r"\]\(([^)\s]+)\)", prose(text))
    broken = []
    for link in links:
        if re.match(r"^[a-z]+:", link):
            continue  # a web address
        target, _, anchor = link.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
        if not os.path.exists(path):
            broken.append(link)
        elif anchor and (not path.endswith(".md") or anchor not in anchors(read(path))):
            broken.append(link)
    assert links and not broken, broken


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(link) for link in re.findall(r"\]\((docs/[^)#\s]+)", read(README))}
    assert DOCS and {os.path.relpath(page, REPO) for page in DOCS} <= linked, linked


def test_the_readme_has_command_blocks():
    """The README's own main job and its first steps are among them, and a job whose workers
    run on the interpreter of another environment (PYTHON_EXEC)."""
    first = [c.text for b in BLOCKS for c in b.commands]
    assert any("examples/train_digits.py" in text for text in first), first
    assert any(
        "PYTHON_EXEC" in words(s)[0] for b in BLOCKS for c in b.commands for s in segments(c) if is_elastix(s)
    ), first
