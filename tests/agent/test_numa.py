"""`--numa-binding` (torchrun 2.9+): the CPUs each local rank is bound to, computed from fake
sysfs trees for every mode (elastix.agent.numa), the errors where a machine cannot say, the
flag and LaunchConfig's numa_options, and end to end: workers (cold and from warm standbys)
really run on the CPUs chosen for them."""

import enum
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agents import assert_nothing_left
from elastix.agent import numa
from elastix.agent.numa import AffinityMode, NumaBindingError, NumaOptions, cpus_per_local_rank

# --- fake sysfs trees --------------------------------------------------------------------------


class FakeSysfs:
    """A sysfs tree with what elastix.agent.numa reads: NUMA nodes, CPU topology and caches,
    PCI devices."""

    def __init__(self, root: Path):
        self.root = root
        (root / "devices" / "system" / "node").mkdir(parents=True, exist_ok=True)
        (root / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)

    def write(self, relative, text):
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{text}\n")

    def node(self, node, cpus):
        self.write(f"devices/system/node/node{node}/cpulist", numa.format_cpu_list(cpus))
        # what a real node directory holds besides (never read as a node)
        self.write("devices/system/node/possible", "0-63")

    def cpu(self, cpu, *, package, siblings, l3):
        base = f"devices/system/cpu/cpu{cpu}"
        self.write(f"{base}/topology/physical_package_id", package)
        self.write(f"{base}/topology/core_id", min(siblings))
        self.write(f"{base}/topology/thread_siblings_list", numa.format_cpu_list(siblings))
        caches = [(1, "Data", siblings), (1, "Instruction", siblings), (2, "Unified", siblings), (3, "Unified", l3)]
        for index, (level, kind, shared) in enumerate(caches):
            self.write(f"{base}/cache/index{index}/level", level)
            self.write(f"{base}/cache/index{index}/type", kind)
            self.write(f"{base}/cache/index{index}/shared_cpu_list", numa.format_cpu_list(shared))

    def pci(self, address, *, vendor, pci_class, numa_node):
        base = f"bus/pci/devices/{address}"
        self.write(f"{base}/vendor", f"0x{vendor:04x}")
        self.write(f"{base}/class", f"0x{pci_class:06x}")
        self.write(f"{base}/numa_node", numa_node)

    def gpu(self, address, numa_node):
        self.pci(address, vendor=0x10DE, pci_class=0x030200, numa_node=numa_node)


def two_sockets(root: Path, *, gpus=True) -> FakeSysfs:
    """2 sockets x 2 NUMA nodes x 4 cores x 2 hyperthreads (cpu c and c+16 share core c).
    L3 groups: two of 2 cores on nodes 0, 2 and 3; node 1 has one of 3 cores (4-6) and one of
    1 core (7). With `gpus`: two NVIDIA GPUs per node, listed out of PCI order, among devices
    that are not CUDA GPUs."""
    sysfs = FakeSysfs(root)
    for node in range(4):
        cores = range(4 * node, 4 * node + 4)
        sysfs.node(node, [c for core in cores for c in (core, core + 16)])
        for core in cores:
            if node == 1:
                group = [4, 5, 6] if core != 7 else [7]
            else:
                group = [core & ~1, (core & ~1) + 1]
            l3 = [c for g in group for c in (g, g + 16)]
            for thread in (core, core + 16):
                sysfs.cpu(thread, package=node // 2, siblings=[core, core + 16], l3=l3)
    if gpus:
        addresses = {
            0: ["0000:2a:00.0", "0000:18:00.0"],
            1: ["0000:5d:00.0", "0000:3a:00.0"],
            2: ["0000:ab:00.0", "0000:9a:00.0"],
            3: ["0000:db:00.0", "0000:ba:00.0"],
        }
        for node, pair in addresses.items():
            for address in pair:
                sysfs.gpu(address, node)
        # the GPUs' audio functions, an NVSwitch and the board's own VGA: not CUDA devices
        sysfs.pci("0000:18:00.1", vendor=0x10DE, pci_class=0x040300, numa_node=0)
        sysfs.pci("0000:05:00.0", vendor=0x10DE, pci_class=0x068000, numa_node=0)
        sysfs.pci("0000:03:00.0", vendor=0x1A03, pci_class=0x030000, numa_node=0)
    return sysfs


ALL_CPUS = set(range(32))


def node_cpus(node):
    return {c for core in range(4 * node, 4 * node + 4) for c in (core, core + 16)}


def threads(*cores):
    return {c for core in cores for c in (core, core + 16)}


def bind(tmp_path, mode, nproc, allowed=ALL_CPUS, visible=None):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    return cpus_per_local_rank(mode, nproc, sysfs_root=str(tmp_path), allowed_cpus=allowed, environ=environ)


# --- every mode on a GPU machine ---------------------------------------------------------------


def test_node_binds_each_rank_to_its_gpus_node(tmp_path):
    two_sockets(tmp_path)
    # the GPUs in PCI bus id order: 18, 2a (node 0), 3a, 5d (node 1), 9a, ab, ba, db
    assert bind(tmp_path, "node", 8) == [node_cpus(rank // 2) for rank in range(8)]


def test_socket_binds_each_rank_to_every_node_of_its_gpus_socket(tmp_path):
    two_sockets(tmp_path)
    first, second = node_cpus(0) | node_cpus(1), node_cpus(2) | node_cpus(3)
    assert bind(tmp_path, AffinityMode.SOCKET, 8) == [first] * 4 + [second] * 4


def test_exclusive_divides_a_nodes_physical_cores_among_its_gpus(tmp_path):
    two_sockets(tmp_path)
    expected = [threads(2 * rank, 2 * rank + 1) for rank in range(8)]
    assert bind(tmp_path, "exclusive", 8) == expected
    # torch counts every GPU on the node, not only those with a worker
    assert bind(tmp_path, "exclusive", 1) == [threads(0, 1)]


def test_exclusive_gives_the_first_gpus_one_core_more(tmp_path):
    sysfs = two_sockets(tmp_path)
    sysfs.gpu("0000:1a:00.0", 0)  # a third GPU on node 0 (4 cores): 2, 1, 1
    result = bind(tmp_path, "exclusive", 3)
    assert result == [threads(0, 1), threads(2), threads(3)]


def test_core_complex_gives_each_gpu_an_l3_group_largest_first(tmp_path):
    two_sockets(tmp_path)
    result = bind(tmp_path, "core-complex", 8)
    assert result[0:2] == [threads(0, 1), threads(2, 3)]
    assert result[2:4] == [threads(4, 5, 6), threads(7)]  # node 1: the larger group first
    # more GPUs than groups: they share, round robin
    sysfs = FakeSysfs(tmp_path)
    sysfs.gpu("0000:1a:00.0", 0)
    assert bind(tmp_path, "core-complex", 3) == [threads(0, 1), threads(2, 3), threads(0, 1)]


def test_only_the_cpus_this_process_may_use_count(tmp_path):
    two_sockets(tmp_path)
    no_hyperthreads = set(range(16))
    assert bind(tmp_path, "node", 2, allowed=no_hyperthreads) == [{0, 1, 2, 3}] * 2
    assert bind(tmp_path, "exclusive", 2, allowed=no_hyperthreads) == [{0, 1}, {2, 3}]
    assert bind(tmp_path, "core-complex", 4, allowed=no_hyperthreads)[2:] == [{4, 5, 6}, {7}]
    # a node's socket is that of the lowest CPU the process may use there; nodes without
    # any are left out
    assert bind(tmp_path, "socket", 1, allowed={5, 6, 20}, visible="2") == [{5, 6, 20}]


def test_cuda_visible_devices_picks_gpus_in_pci_order(tmp_path):
    two_sockets(tmp_path)
    assert bind(tmp_path, "node", 2, visible="6,1") == [node_cpus(3), node_cpus(0)]
    # CUDA reads the list up to its first invalid entry
    with pytest.raises(NumaBindingError, match="local rank 1 has no GPU"):
        bind(tmp_path, "node", 2, visible="6,9,1")
    with pytest.raises(NumaBindingError, match="names GPUs by UUID"):
        bind(tmp_path, "node", 1, visible="GPU-8e1b7f0c-0000-0000-0000-000000000000")
    # GPUs hidden: CPU training, spread over the nodes
    assert bind(tmp_path, "node", 2, visible="") == [node_cpus(0), node_cpus(2)]


def test_a_gpu_without_a_node_is_the_only_node_on_a_one_node_machine(tmp_path):
    sysfs = FakeSysfs(tmp_path)
    sysfs.node(0, range(4))
    for cpu in range(4):
        sysfs.cpu(cpu, package=0, siblings=[cpu], l3=range(4))
    sysfs.gpu("0000:01:00.0", -1)
    sysfs.gpu("0000:02:00.0", -1)
    assert bind(tmp_path, "node", 2, allowed=range(4)) == [{0, 1, 2, 3}] * 2
    assert bind(tmp_path, "exclusive", 2, allowed=range(4)) == [{0, 1}, {2, 3}]


# --- a machine without GPUs (an elastix extension) ---------------------------------------------


@pytest.mark.parametrize("nproc,nodes", [
    (1, [0]), (2, [0, 2]), (3, [0, 1, 2]), (4, [0, 1, 2, 3]), (6, [0, 0, 1, 2, 2, 3]), (8, [0, 0, 1, 1, 2, 2, 3, 3]),
])  # fmt: skip
def test_without_gpus_local_ranks_spread_evenly_over_the_nodes(tmp_path, nproc, nodes):
    two_sockets(tmp_path, gpus=False)
    assert bind(tmp_path, "node", nproc) == [node_cpus(node) for node in nodes]


def test_without_gpus_every_mode_treats_the_ranks_on_a_node_as_its_devices(tmp_path):
    sysfs = two_sockets(tmp_path, gpus=False)
    sysfs.node(4, [])  # a node of memory only: no rank goes there
    assert bind(tmp_path, "socket", 2) == [node_cpus(0) | node_cpus(1), node_cpus(2) | node_cpus(3)]
    assert bind(tmp_path, "exclusive", 8) == [threads(2 * rank, 2 * rank + 1) for rank in range(8)]
    assert bind(tmp_path, "exclusive", 12)[:3] == [threads(0, 1), threads(2), threads(3)]
    assert bind(tmp_path, "core-complex", 8)[:4] == [threads(0, 1), threads(2, 3), threads(4, 5, 6), threads(7)]
    # the nodes this process may not use are left out of the spread
    assert bind(tmp_path, "node", 2, allowed=node_cpus(1) | node_cpus(3)) == [node_cpus(1), node_cpus(3)]


# --- machines where the binding cannot be computed ---------------------------------------------


def test_a_topology_that_cannot_say_is_a_clear_error(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(NumaBindingError, match=r"no NUMA node in .*/devices/system/node \(a kernel without NUMA"):
        bind(bare, "node", 1)

    gpu_without_node = tmp_path / "no-node"
    two_sockets(gpu_without_node, gpus=False).gpu("0000:18:00.0", -1)
    with pytest.raises(NumaBindingError, match=r"GPU 0 \(0000:18:00.0\) has no NUMA node .* with 4 NUMA nodes"):
        bind(gpu_without_node, "node", 1)

    gpu_on_unknown_node = tmp_path / "unknown-node"
    two_sockets(gpu_on_unknown_node, gpus=False).gpu("0000:18:00.0", 7)
    with pytest.raises(NumaBindingError, match="is on NUMA node 7, which sysfs does not list"):
        bind(gpu_on_unknown_node, "node", 1)

    two_sockets(tmp_path / "gpus")
    with pytest.raises(NumaBindingError, match=r"local rank 8 has no GPU .* 8 NVIDIA GPU\(s\) .* for 9 local ranks"):
        bind(tmp_path / "gpus", "node", 9)
    with pytest.raises(NumaBindingError, match=r"GPU 0 \(0000:18:00.0\) is on NUMA node 0, which has none of the CPUs"):
        bind(tmp_path / "gpus", "node", 1, allowed=node_cpus(1))
    two_sockets(tmp_path / "cpus", gpus=False)
    with pytest.raises(NumaBindingError, match=r"no NUMA node has any of the CPUs this process may use \(99\)"):
        bind(tmp_path / "cpus", "node", 1, allowed={99})
    with pytest.raises(
        NumaBindingError, match=r"NUMA node 0 has 1 physical core\(s\) .* for 2 devices \(GPU 0 \(0000:18"
    ):
        bind(tmp_path / "gpus", "exclusive", 1, allowed=threads(0) | node_cpus(1))

    no_caches = tmp_path / "no-caches"
    two_sockets(no_caches)
    for path in (no_caches / "devices/system/cpu/cpu0/topology").iterdir():
        path.unlink()
    with pytest.raises(NumaBindingError, match=r"cannot read .*cpu0/topology/thread_siblings_list"):
        bind(no_caches, "exclusive", 1)


def test_agent_binding_names_the_flag_and_falls_back_only_when_asked(tmp_path, monkeypatch):
    two_sockets(tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: ALL_CPUS)
    environ = {numa.SYSFS_ROOT_VAR: str(tmp_path)}
    binding = numa.agent_binding("exclusive", 2, environ=environ)
    assert binding == {"mode": "exclusive", "cpus": [[0, 1, 16, 17], [2, 3, 18, 19]]}
    assert numa.agent_binding(None, 2, environ=environ) is None

    broken = {numa.SYSFS_ROOT_VAR: str(tmp_path / "nothing")}
    with pytest.raises(NumaBindingError, match=r"^numa_options node: no NUMA node in"):
        numa.agent_binding(NumaOptions(AffinityMode.NODE), 1, what="numa_options", environ=broken)
    warnings = []
    options = NumaOptions(AffinityMode.NODE, should_fall_back_if_binding_fails=True)
    assert numa.agent_binding(options, 1, warn=warnings.append, environ=broken) is None
    assert len(warnings) == 1 and warnings[0].startswith("--numa-binding node: no NUMA node in")
    assert "workers run unbound" in warnings[0]


class TorchAffinityMode(str, enum.Enum):  # the shape of torch.numa.binding's classes
    NODE = "node"
    CORE_COMPLEX = "core-complex"


class TorchNumaOptions:
    def __init__(self, affinity_mode, should_fall_back_if_binding_fails=False):
        self.affinity_mode = affinity_mode
        self.should_fall_back_if_binding_fails = should_fall_back_if_binding_fails


def test_numa_options_take_torchs_options_ours_or_a_mode_name():
    assert numa.numa_options("socket") == NumaOptions(AffinityMode.SOCKET)
    assert numa.numa_options(TorchNumaOptions(TorchAffinityMode.CORE_COMPLEX, True)) == NumaOptions(
        AffinityMode.CORE_COMPLEX, True
    )
    assert numa.numa_options(None) is None
    with pytest.raises(ValueError, match=r"numa_options: unknown mode 'rack' \(choose from node, socket"):
        numa.numa_options("rack")
    with pytest.raises(ValueError, match="numa_options: expected NumaOptions"):
        numa.numa_options(3)


def test_cpu_lists_round_trip():
    assert numa.parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa.parse_cpu_list("\n") == set()
    assert numa.format_cpu_list({11, 10, 8, 3, 2, 1, 0}) == "0-3,8,10-11"


# --- the flag and LaunchConfig -----------------------------------------------------------------


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


def run_config(argv):
    from elastix.cli.run_config import config_from_args
    from elastix.cli.run_flags import build_parser

    return config_from_args(build_parser().parse_args(argv), warn=lambda message: None)


def test_the_flag_and_torchs_spelling_reach_the_agent(tmp_path, script, monkeypatch):
    two_sockets(tmp_path / "sys")
    monkeypatch.setenv(numa.SYSFS_ROOT_VAR, str(tmp_path / "sys"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: ALL_CPUS)
    for flag in ("--numa-binding", "--numa_binding"):
        config = run_config(["--nproc-per-node", "2", flag, "node", script])
        assert config["numa_binding"] == {"mode": "node", "cpus": [sorted(node_cpus(0))] * 2}
    assert run_config([script])["numa_binding"] is None
    monkeypatch.setenv("PET_NUMA_BINDING", "node")  # no env fallback, as in torch
    assert run_config([script])["numa_binding"] is None


def test_a_machine_that_cannot_say_fails_before_anything_starts(tmp_path, script):
    env = {**os.environ, numa.SYSFS_ROOT_VAR: str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "elastix", "run", "--numa-binding", "socket", script],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    error, pointer = proc.stderr.strip().splitlines()[-2:]
    assert error.startswith("elastix run: error: --numa-binding socket: no NUMA node in"), proc.stderr
    assert pointer == "elastix run: see `elastix run --help` for every flag", proc.stderr


def test_launch_config_takes_numa_options(tmp_path, monkeypatch):
    from elastix.agent.launcher import LaunchConfig, agent_config

    two_sockets(tmp_path)
    monkeypatch.setenv(numa.SYSFS_ROOT_VAR, str(tmp_path))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: ALL_CPUS)
    socket, node = node_cpus(0) | node_cpus(1), node_cpus(0)
    for options, cpus in (
        (NumaOptions(AffinityMode.SOCKET), socket), (TorchNumaOptions(TorchAffinityMode.NODE), node), ("socket", socket),
    ):  # fmt: skip
        config = LaunchConfig(1, 1, 2, numa_options=options)
        assert agent_config(config, "/bin/true", [])["numa_binding"]["cpus"] == [sorted(cpus)] * 2
    binding = agent_config(LaunchConfig(1, 1, 2, numa_options="exclusive"), "/bin/true", [])["numa_binding"]
    assert binding == {"mode": "exclusive", "cpus": [sorted(threads(0, 1)), sorted(threads(2, 3))]}
    with pytest.raises(ValueError, match="numa_options: unknown mode"):
        LaunchConfig(1, 1, 1, numa_options="rack")
    monkeypatch.setenv(numa.SYSFS_ROOT_VAR, str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match=r"^numa_options node: no NUMA node in"):
        agent_config(LaunchConfig(1, 1, 1, numa_options="node"), "/bin/true", [])


# --- end to end on this machine -----------------------------------------------------------------


def two_usable_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs this process may use")
    return cpus[0], cpus[1]


def split_machine(root: Path):
    """A fake tree that puts two of this machine's CPUs on two NUMA nodes, no GPUs."""
    first, second = two_usable_cpus()
    sysfs = FakeSysfs(root)
    for node, cpu in enumerate((first, second)):
        sysfs.node(node, [cpu])
        sysfs.cpu(cpu, package=node, siblings=[cpu], l3=[cpu])
    return first, second


PROBE = r"""
import json, os, sys
rank, restart = os.environ["RANK"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with open("/proc/self/environ", "rb") as f:
    from_standby = b"ELASTIX_STANDBY_FD=" in f.read()
record = {"cpus": sorted(os.sched_getaffinity(0)), "from_standby": from_standby}
path = os.path.join(os.environ["OUT_DIR"], f"probe_{restart}_{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
if restart == 0 and rank == "1" and len(sys.argv) > 1 and sys.argv[1] == "fail-once":
    import time
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(os.environ["OUT_DIR"], "probe_0_0.json")) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(1)
"""


def elastix_run(tmp_path, marker, *argv):
    env = {
        **os.environ,
        "OUT_DIR": str(tmp_path),
        "ELASTIX_TEST_MARKER": marker,
        numa.SYSFS_ROOT_VAR: str(tmp_path / "sys"),
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(
        [sys.executable, "-m", "elastix", "run", *map(str, argv)], env=env, capture_output=True, text=True, timeout=120
    )
    probes = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("probe_*.json")}
    return proc, probes


def test_each_worker_runs_on_its_nodes_cpus(tmp_path, marker):
    first, second = split_machine(tmp_path / "sys")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc, probes = elastix_run(
        tmp_path, marker, "--standalone", "--nproc-per-node", 2, "--numa-binding", "node", script
    )
    assert proc.returncode == 0, proc.stderr
    assert probes == {
        "probe_0_0.json": {"cpus": [first], "from_standby": False},
        "probe_0_1.json": {"cpus": [second], "from_standby": False},
    }
    assert f"--numa-binding node: CPUs {second} for local rank 1" in proc.stderr
    assert_nothing_left(marker)


def test_a_worker_restarted_from_its_standby_keeps_its_binding(tmp_path, marker):
    first, second = split_machine(tmp_path / "sys")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    proc, probes = elastix_run(
        tmp_path, marker,
        "--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "--numa-binding", "node", script, "fail-once",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert probes == {
        "probe_0_0.json": {"cpus": [first], "from_standby": False},
        "probe_0_1.json": {"cpus": [second], "from_standby": False},
        "probe_1_0.json": {"cpus": [first], "from_standby": True},
        "probe_1_1.json": {"cpus": [second], "from_standby": True},
    }
    assert_nothing_left(marker)


LAUNCH = r"""
import os, sys
import elastix
from elastix.agent.numa import AffinityMode, NumaOptions

def where():
    return sorted(os.sched_getaffinity(0))

if __name__ == "__main__":
    config = elastix.LaunchConfig(1, 1, 2, max_restarts=0, numa_options=NumaOptions(AffinityMode.NODE))
    print(sorted(elastix.elastic_launch(config, where)().items()))
"""


def test_a_function_entrypoint_is_bound_too(tmp_path, marker):
    first, second = split_machine(tmp_path / "sys")
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(LAUNCH))
    env = {**os.environ, "ELASTIX_TEST_MARKER": marker, numa.SYSFS_ROOT_VAR: str(tmp_path / "sys")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str([(0, [first]), (1, [second])])
    assert_nothing_left(marker)
