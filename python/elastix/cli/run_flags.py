"""The flags of ``elastix run``: torchrun's, with their names, aliases, defaults and ``PET_*``
variables, plus a few of elastix's own (marked [elastix])."""

from __future__ import annotations

import argparse
import shutil
from typing import Any

from ..agent.signals import DEFAULT_SIGNALS
from .envargs import EnvArgumentParser, EnvFlag
from .flags import RDZV_BACKEND, RDZV_CONF, RDZV_ENDPOINT, RDZV_ID, Flag, Group, add_groups

DESCRIPTION = """\
Starts --nproc-per-node copies of a program on this node, joins them with the other nodes of the
job through a rendezvous, gives every worker torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, ...), restarts all of them when one fails, and reports the root cause.
Options come before the program; everything after the program is passed to it."""

EPILOG = """\
environment:
  Every option can also be set in the environment: --foo-bar as ELASTIX_FOO_BAR, or torchrun's
  PET_FOO_BAR (not for --logs-specs, --numa-binding, --line-prefix). Precedence: command line,
  then ELASTIX_*, then PET_*, then the default. Switches take 1/0 (PET_*: an integer, as torchrun;
  ELASTIX_*: also true/false). Also read: PYTHON_EXEC (the interpreter for workers),
  OMP_NUM_THREADS (set to 1 for the workers when unset and --nproc-per-node > 1),
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT, TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT,
  TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE.

schedulers:
  Under srun (one task per node) the rendezvous flags not given come from Slurm's environment
  (nodes, endpoint, run ID, port, node order, SIGUSR1/SIGUSR2 handled); in a Kubernetes Indexed
  Job group ranks follow JOB_COMPLETION_INDEX. One INFO line says what was derived.

differences from torchrun:
  --max-restarts is one budget for the whole job, not per node; a failed worker is restarted
  without polling (--monitor-interval is accepted but nothing waits on it); unknown
  --rdzv-conf keys and --signals-to-handle names are errors; --nproc-per-node cpu/auto count the
  CPUs allowed by the affinity mask and the cgroup quota; -r/-t maps take ranks above 9;
  --local-ranks-filter keeps hidden ranks' output in their log files.

examples:
  elastix run --standalone --nproc-per-node 4 train.py --lr 0.1
  elastix run --nnodes 2 --nproc-per-node gpu --rdzv-endpoint host0:29400 --rdzv-id job7 train.py
  elastix run --standalone --nproc-per-node 2 -m mypkg.train --epochs 3
  elastix run --standalone --nproc-per-node 2 --no-python ./a.out ${local_rank}"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Shows an option's metavar once after all its aliases ("--a, --b N", not "--a N, --b N")."""

    def __init__(self, prog: str) -> None:
        width = min(100, shutil.get_terminal_size().columns - 2)
        super().__init__(prog, max_help_position=34, width=width)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        metavar = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {metavar}"


class _PrintCompletion(argparse.Action):
    """``--print-completion SHELL``: a completion script for ``elastix run`` on stdout, made by
    the optional ``shtab`` package from this parser, so it never falls out of date."""

    SHELLS = ("bash", "zsh", "tcsh")

    def __init__(self, option_strings: "list[str]", dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=None, choices=self.SHELLS, default=None, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        try:
            import shtab
        except ImportError:
            parser.exit(1, f"{option} requires the 'shtab' package: pip install shtab\n")
        # completion binds to the command users type: `elastix`, whose `run` is this parser
        command = argparse.ArgumentParser(prog="elastix")
        # (shtab lists a subcommand's options only when it has a help text)
        commands = command.add_subparsers(dest="command")
        commands.add_parser("run", parents=[parser], add_help=False, help="launch workers on this node")
        print(shtab.complete(command, shell=values))
        parser.exit()


def build_parser(prog: str = "elastix run") -> EnvArgumentParser:
    parser = EnvArgumentParser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=_Formatter,
        allow_abbrev=True,  # as torchrun; abbreviations only apply before the program
    )
    add_groups(parser, GROUPS)
    parser.add_argument(
        "training_script",
        metavar="program",
        help="a Python script; a module name with -m; an executable with --no-python",
    )
    parser.add_argument(
        "training_script_args",
        nargs=argparse.REMAINDER,
        metavar="args",
        help="arguments of the program; ${local_rank} becomes each worker's local rank",
    )
    return parser


def _comma_list(value: str) -> list:
    """torch's filter list: split on ",", where ",," is a literal comma."""
    marker = "\0"
    return [item.replace(marker, ",") for item in value.replace(",,", marker).split(",")]


# torchrun's flags, in --help's groups
GROUPS = [
    Group(
        "nodes and workers",
        [
            Flag(
                "--nnodes",
                type=str,
                default="1:1",
                metavar="N|MIN:MAX",
                help="number of nodes, or the range an elastic job may run with (default: 1)",
            ),
            Flag(
                "--nproc-per-node",
                "--nproc_per_node",
                type=str,
                default="1",
                metavar="N|auto|cpu|gpu|xpu",
                help="workers on this node: a number; cpu: the usable CPUs (affinity and "
                "cgroup quota); gpu: visible NVIDIA GPUs; xpu: ZE_AFFINITY_MASK entries; auto: "
                "GPUs if any, else CPUs (default: 1)",
            ),
        ],
    ),
    Group(
        "rendezvous (how the nodes find each other)",
        [
            Flag(
                "--standalone",
                action=EnvFlag,
                help="single-node job: same as --rdzv-backend c10d --rdzv-endpoint "
                "localhost:0 with a random --rdzv-id (explicit values of those are ignored)",
            ),
            RDZV_BACKEND.but(
                default="static",
                metavar="{c10d,etcd,static}",
                help="c10d: elastic, the store is served by the agent at the endpoint; "
                "etcd (or etcd-v3): elastic, on the etcd v3 cluster at the endpoints; "
                "static: fixed node ranks from --node-rank (default: static)",
            ),
            RDZV_ENDPOINT.but(
                default="",
                metavar="HOST[:PORT][,HOST[:PORT]...]",
                help="where the rendezvous store is (IPv6 in brackets); c10d takes an ordered list of agents' "
                "addresses: the first hosts the store, and when it is lost the next one takes over",
            ),
            RDZV_ID.but(default="none", metavar="ID", help="job id shared by all nodes of a job (default: none)"),
            RDZV_CONF.but(
                default="",
                metavar="K=V,...",
                help="rendezvous settings, e.g. join_timeout=600,last_call_timeout=30s; "
                "unknown keys are an error; durations take units (500ms, 2m)",
            ),
            Flag(
                "--local-addr",
                "--local_addr",
                type=str,
                default=None,
                metavar="ADDR",
                help="this node's address for the other nodes (default: its host name)",
            ),
        ],
    ),
    Group(
        "static rendezvous (--rdzv-backend static, no --rdzv-endpoint)",
        [
            Flag(
                "--node-rank",
                "--node_rank",
                type=int,
                default=0,
                metavar="R",
                help="this node's rank, 0 to nnodes-1 (default: 0)",
            ),
            Flag(
                "--master-addr",
                "--master_addr",
                type=str,
                default=None,
                metavar="ADDR",
                help="address of node 0, which serves the store (default: 127.0.0.1; IPv6 as [::1])",
            ),
            Flag(
                "--master-port",
                "--master_port",
                type=int,
                default=None,
                metavar="PORT",
                help="port of node 0's store (default: 29500; when neither it nor an endpoint "
                "is given and --nnodes is 1, the job runs as --standalone, as in newer torchrun)",
            ),
        ],
    ),
    Group(
        "the program",
        [
            Flag(
                "--role",
                type=str,
                default="default",
                help="workers' role name: ROLE_NAME and log prefixes (default: default)",
            ),
            Flag("-m", "--module", action=EnvFlag, help="run the program as a Python module, as `python -m`"),
            Flag(
                "--no-python", "--no_python", action=EnvFlag, help="execute the program directly instead of with Python"
            ),
            Flag(
                "--run-path",
                "--run_path",
                action=EnvFlag,
                help="run the script with runpy inside a wrapper that writes its error file "
                "(like decorating its main with @elastix.record); wins over --no-python",
            ),
            Flag(
                "--start-method",
                "--start_method",
                type=str,
                default="spawn",
                choices=["spawn", "fork", "forkserver"],
                help="accepted for torchrun compatibility: elastix always starts workers as new processes (spawn)",
            ),
            Flag(
                "--virtual-local-rank",
                "--virtual_local_rank",
                action=EnvFlag,
                help="every worker gets LOCAL_RANK=0 and sees only its own GPU in CUDA_VISIBLE_DEVICES",
            ),
        ],
    ),
    Group(
        "failures, restarts and signals",
        "a DURATION is seconds (30, 0.5) or has a unit as in --rdzv-conf (500ms, 30s, 2m, 1h)",
        [
            Flag(
                "--max-restarts",
                "--max_restarts",
                type=int,
                default=0,
                metavar="N",
                help="restarts of the worker group after failures, counted for the whole job (torchrun: per node) "
                "(default: 0)",
            ),
            Flag(
                "--no-standby-workers",
                action=EnvFlag,
                pet=False,
                help="[elastix] start every worker cold: without this, when a restart can "
                "happen, a warm Python interpreter per local rank waits to become the next "
                "attempt's worker, which makes restarts several times faster",
            ),
            Flag(
                "--monitor-interval",
                "--monitor_interval",
                type=str,
                default=0.1,
                metavar="DURATION",
                help="accepted for torchrun compatibility (must be > 0): elastix is told of "
                "worker exits at once instead of polling (default: 0.1)",
            ),
            Flag(
                "--signals-to-handle",
                "--signals_to_handle",
                type=str,
                default=DEFAULT_SIGNALS,
                metavar="SIG,...",
                help="signals forwarded to the workers, e.g. add SIGUSR1 for Slurm preemption "
                f"(default: {DEFAULT_SIGNALS})",
            ),
            Flag(
                "--shutdown-timeout",
                "--shutdown_timeout",
                type=str,
                default=None,
                metavar="DURATION",
                help="grace between the stop signal and SIGKILL (default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30)",
            ),
            Flag(
                "--worker-timeout",
                "--worker_timeout",
                type=str,
                default=None,
                metavar="DURATION",
                help="a worker that sends no elastix.heartbeat() for this long is hung, and so is a Python worker "
                "that never sends one whose main thread has not run at all (it waits for good: in recv(), on a "
                "lock) while its processes used no CPU for this long: its stacks are dumped and it is restarted "
                "like a failed one (default: off; expect_progress and elastix.timer.expires apply regardless)",
            ),
            Flag(
                "--exit-barrier-timeout",
                "--exit_barrier_timeout",
                type=str,
                default=None,
                metavar="DURATION",
                help="[elastix] how long a finished node waits for the others (default: "
                "TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT or 300)",
            ),
        ],
    ),
    Group(
        "logs",
        [
            Flag(
                "--log-level",
                "--log_level",
                type=str,
                default=None,
                pet=False,
                metavar="LEVEL",
                help="[elastix] what elastix itself logs to stderr: error, warn, info (default), debug or trace; "
                "RUST_LOG, when set, selects the core's events in detail",
            ),
            Flag(
                "--log-dir",
                "--log_dir",
                type=str,
                default=None,
                metavar="DIR",
                help="base directory for log files; each run gets its own subdirectory (default: "
                "a temporary one, made only if some output goes to files)",
            ),
            Flag(
                "-r",
                "--redirects",
                type=str,
                default="0",
                metavar="MASK|MAP",
                help="send workers' streams to files instead of the console: 0 none, 1 stdout, "
                "2 stderr, 3 both; or per local rank, e.g. 0:1,1:2 (default: 0)",
            ),
            Flag(
                "-t",
                "--tee",
                type=str,
                default="0",
                metavar="MASK|MAP",
                help="write streams to files and to the console, with a prefix (same syntax as -r) (default: 0)",
            ),
            Flag(
                "--local-ranks-filter",
                "--local_ranks_filter",
                type=str,
                default="",
                metavar="R,...",
                help="only these local ranks reach the console (the others still go to their log files)",
            ),
            Flag(
                "--log-line-prefix-template",
                "--log_line_prefix_template",
                type=str,
                default="",
                metavar="TEMPLATE",
                help="prefix of tee'd console lines in torchrun's syntax: ${role_name}, "
                "${rank}, ${local_rank}, ${hostname} (default: [${role_name}${local_rank}]:)",
            ),
            Flag(
                "--line-prefix",
                "--line_prefix",
                type=str,
                default=None,
                pet=False,
                metavar="TEMPLATE",
                help="[elastix] the same in elastix's syntax: {role}, {rank}, {local_rank}, {host}; "
                "e.g. '{host}:{rank}| '",
            ),
            Flag(
                "--metrics-port",
                type=int,
                default=None,
                pet=False,
                metavar="PORT",
                help="[elastix] serve Prometheus metrics over HTTP at :PORT/metrics (0: a free port, logged); "
                "off by default",
            ),
            Flag(
                "--metrics-addr",
                type=str,
                default=None,
                pet=False,
                metavar="ADDR",
                help="[elastix] the address the metrics endpoint binds (default: --local-addr when given, "
                "loopback under --standalone, else every IPv4 address)",
            ),
        ],
    ),
    Group(
        "slow and bad nodes",
        "a rank that keeps others waiting is named in the log and in elastix status whatever these say",
        [
            Flag(
                "--preflight",
                action=EnvFlag,
                pet=False,
                help="[elastix] before the job's first round trains, check every node's compute and its links to "
                "the others (in pairs, through elastix's collectives); slow and dead nodes are named and leave "
                "where --nnodes allows (the others re-form without them), else the job warns and trains",
            ),
            Flag(
                "--exclude-stragglers",
                action=EnvFlag,
                pet=False,
                help="[elastix] a node named a straggler leaves the job at the next re-form, where --nnodes allows",
            ),
        ],
    ),
    Group(
        "checkpoints (elastix.checkpoint)",
        "workers save into memory this agent holds; a restarted worker restores from it",
        [
            Flag(
                "--checkpoint-dir",
                type=str,
                default=None,
                pet=False,
                metavar="DIR",
                help="[elastix] persist the newest checkpoint of every rank under DIR/<run ID>, in the background "
                "and when the run ends (default: memory only)",
            ),
            Flag(
                "--checkpoint-keep",
                type=int,
                default=2,
                pet=False,
                metavar="N",
                help="[elastix] how many of the newest steps stay in --checkpoint-dir (default: 2)",
            ),
            Flag(
                "--checkpoint-copy-rate",
                type=int,
                default=1000,
                pet=False,
                metavar="MB_PER_S",
                help="[elastix] at most this many MB a second of this node's checkpoints go to the next node's "
                "agent, which holds a copy for when this node is lost (0: unlimited; default: 1000)",
            ),
        ],
    ),
    Group(
        "torchrun options elastix implements in part (each says what it accepts)",
        [
            Flag(
                "--event-log-handler",
                "--event_log_handler",
                type=str,
                default="null",
                metavar="NAME",
                help="null (default); console: the run's outcome as torchelastic JSON events on stderr; "
                "jsonl: every state change as elastix's JSON events on stderr (see --event-log)",
            ),
            Flag(
                "--event-log",
                "--event_log",
                type=str,
                default=None,
                metavar="FILE",
                help="[elastix] append every state change (round formed, member lost or joined, worker failed "
                "or hung, restart, job finished) to FILE as JSON lines",
            ),
            Flag(
                "--logs-specs",
                "--logs_specs",
                type=str,
                default=None,
                metavar="NAME",
                help="only 'default' (elastix's log layout); other torchrun.logs_specs plugins are refused",
                action=None,
            ),
            Flag(
                "--numa-binding",
                "--numa_binding",
                type=str,
                default=None,
                choices=["node", "socket", "exclusive", "core-complex"],
                help="bind each worker to CPUs near the GPU whose index is its local rank (PCI bus id order); "
                "[elastix] without GPUs, near the NUMA node its local rank is spread to (see elastix.agent.numa)",
                action=None,
            ),
            Flag(
                "--duplicate-stdout-filters",
                "--duplicate_stdout_filters",
                type=_comma_list,
                default=[],
                metavar="S,...",
                help="copy tee'd stdout lines containing any of these to attempt_N/filtered_stdout.log "
                "(',,' is a comma)",
            ),
            Flag(
                "--print-completion",
                "--print_completion",
                action=_PrintCompletion,
                metavar="{bash,zsh,tcsh}",
                help="print a shell completion script for elastix (needs the shtab package) and exit",
            ),
            Flag(
                "--duplicate-stderr-filters",
                "--duplicate_stderr_filters",
                type=_comma_list,
                default=[],
                metavar="S,...",
                help="the same for stderr (filtered_stderr.log)",
            ),
        ],
    ),
]


def help_text(prog: str = "elastix run") -> str:
    return build_parser(prog).format_help()


__all__ = ["build_parser", "help_text"]
