# Types of the native module `elastix._core` (rust/python). Keep in step with the #[pymethods]
# there: mypy checks the Python package against this file, not against the extension.
# Timeouts are seconds (float) or None for no limit; keys and values are bytes.

from typing import Any, Dict, List, Optional, Sequence, Tuple, TypedDict, Union, final

from typing_extensions import Self

__version__: str
RENDEZVOUS_BACKENDS: tuple[str, ...]
COLLECTIVE_KINDS: tuple[str, ...]

@final
class StoreCore:
    """One handle on a store: a TCPStore connection (the constructor), the in-process store
    (torch's HashStore) or a file store (torch's FileStore). The TCP-only members raise
    TypeError on the others."""

    def __new__(
        cls,
        host: str,
        port: int,
        world_size: Optional[int] = None,
        is_master: bool = False,
        timeout: Optional[float] = ...,  # 300 s
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        listen_fd: Optional[int] = None,
        client_if_port_taken: bool = False,
    ) -> Self: ...
    @staticmethod
    def local(timeout: Optional[float]) -> StoreCore: ...
    @staticmethod
    def file(path: str, world_size: Optional[int], timeout: Optional[float]) -> StoreCore: ...
    def duplicate(self) -> StoreCore: ...
    @property
    def timeout(self) -> Optional[float]: ...
    def set_timeout(self, timeout: Optional[float]) -> None: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def is_server(self) -> bool: ...
    @property
    def local_addr(self) -> str: ...
    @property
    def remote_addr(self) -> str: ...
    def set(self, key: bytes, value: bytes) -> None: ...
    def get(self, key: bytes) -> bytes: ...
    def add(self, key: bytes, amount: int) -> int: ...
    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes: ...
    def check(self, keys: list[bytes]) -> bool: ...
    def wait(self, keys: list[bytes], timeout: Optional[float]) -> None: ...
    def delete_key(self, key: bytes) -> bool: ...
    def num_keys(self) -> int: ...
    def append(self, key: bytes, value: bytes) -> None: ...
    def multi_get(self, keys: list[bytes]) -> list[bytes]: ...
    def multi_set(self, keys: list[bytes], values: list[bytes]) -> None: ...
    def queue_push(self, key: bytes, value: bytes) -> None: ...
    def queue_pop(self, key: bytes, block: bool) -> bytes: ...
    def queue_len(self, key: bytes) -> int: ...
    def list_keys(self) -> list[bytes]: ...
    def barrier(self, key: bytes, world_size: int, timeout: Optional[float]) -> None: ...
    def ping(self) -> None: ...

class _RoundInfo(TypedDict):
    run_id: str
    round: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    store_host: str
    store_port: int
    store_prefix: str

@final
class RendezvousCore:
    def __new__(
        cls,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: Optional[str] = None,
        conf_json: str = ...,  # '""': no settings
        node_rank: Optional[int] = None,
    ) -> Self: ...
    @property
    def run_id(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def hosted_port(self) -> Optional[int]: ...
    def next_rendezvous(self) -> _RoundInfo: ...
    def num_nodes_waiting(self) -> int: ...
    def is_closed(self) -> bool: ...
    def set_closed(self) -> None: ...
    def record_restart(self) -> int: ...
    def restart_count(self) -> int: ...
    def shutdown(self) -> None: ...
    def wait_for_change(self, timeout: Optional[float] = None) -> Optional[str]: ...

# A wait's outcome: None when every peer arrived, else (kind, [peer index or code, ...]) with
# kind one of "timeout", "dead", "aborted", "closed", "mismatch".
_Outcome = Optional[tuple[str, list[int]]]

class Segment:
    """Shared memory mapped in this process; a writable buffer (np.frombuffer, memoryview).
    Offsets are bytes from its start, checked for bounds and alignment. The submodule
    `elastix._core.collectives` (rust/python/src/shm.rs) holds this class."""

    @staticmethod
    def create(size: int, directory: Optional[str] = None) -> Segment: ...
    @staticmethod
    def attach(handle: str) -> Segment: ...
    @property
    def size(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def encode(self) -> str: ...
    def release_name(self) -> None: ...
    def close(self) -> bool: ...
    def load(self, offset: int) -> int: ...
    def publish(self, offset: int, waiters: Optional[int], value: int) -> None: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

class Waiter:
    """Waits on peers' counters in a Segment (`elastix._core.collectives.Waiter`)."""

    def __init__(
        self,
        segment: Segment,
        flags: list[int],
        aborts: list[Optional[int]],
        waiters: list[Optional[int]],
        pids: list[int],
        own_flag: Optional[int] = None,
        own_waiters: Optional[int] = None,
        own_abort: Optional[int] = None,
        spin_iters: int = 20000,
        yield_us: int = 200,
        check_ms: int = 2,
        desc_offsets: tuple[int, int] = (8, 8),
        slots: Optional[tuple[int, int, int, int]] = None,
    ) -> None: ...
    def wait(self, target: int, timeout: Optional[float] = None) -> _Outcome: ...
    def step(self, seq: int, desc: Optional[Sequence[int]] = None, timeout: Optional[float] = None) -> _Outcome: ...
    def all_reduce_small(
        self,
        seq: int,
        desc: Optional[Sequence[int]],
        timeout: Optional[float],
        x: object,
        dtype: int,
        op: int,
        divisor: int = 1,
        reduce_here: bool = True,
    ) -> _Outcome: ...
    def copy_small(
        self,
        seq: int,
        desc: Optional[Sequence[int]],
        timeout: Optional[float],
        send: Optional[object],
        recv: Sequence[Optional[object]],
    ) -> _Outcome: ...
    def reduce_scatter_small(
        self,
        seq: int,
        desc: Optional[Sequence[int]],
        timeout: Optional[float],
        ins: Sequence[object],
        out: object,
        region: int,
        dtype: int,
        op: int,
        divisor: int = 1,
    ) -> _Outcome: ...
    def abort(self, code: int) -> None: ...

class _Collectives:
    """The submodule `elastix._core.collectives` (rust/python/src/collectives.rs, shm.rs)."""

    Segment: type[Segment]
    Waiter: type[Waiter]
    def reduce(
        self,
        dtype: int,
        op: int,
        srcs: Sequence[object],
        dsts: Sequence[object],
        divisor: int = 1,
        streaming: bool = False,
    ) -> None: ...
    def copy_streaming(self, dst: object, src: object) -> None: ...
    def memfd_attachable(self) -> bool: ...

collectives: _Collectives

def run_store_cli(argv: list[str]) -> int: ...
def init_cli_logging(level: str, node: Optional[str] = None) -> bool:
    """Sends the core's events to stderr at `level` (RUST_LOG wins), each line naming `node`
    when given; False if already set up."""

def log_line(levelno: int, message: str) -> None:
    """Logs a CLI line through the core's stderr subscriber, in the one form of every line."""

def reset_log_cache() -> None:
    """Makes the bridge to Python's logging re-read loggers and levels."""

def parse_duration(text: str) -> float:
    """Seconds in a duration as --rdzv-conf writes it (30, 30s, 500ms, 2m); ValueError otherwise."""

def failure_summary(name: str, failures_json: str) -> Tuple[str, int]:
    """The agent's root-cause summary of failures (a JSON list of its failure objects) and the
    root cause's index; ValueError for none or a malformed one."""

def close_python_gate() -> bool:
    """The atexit hook of the exit gate (rust/python/src/exit_gate.rs); registered at import."""

def check_agent_config(config_json: str) -> None:
    """Raises ValueError, naming the flag, when the agent would refuse the configuration."""

def run_agent(config_json: str) -> str:
    """Runs an agent to the end (the GIL released); returns the outcome as JSON."""

def job_runs(backend: str, endpoint: str, conf_json: str, timeout: float) -> List[str]: ...
def job_status(backend: str, endpoint: str, run_id: str, conf_json: str, timeout: float) -> Optional[str]:
    """`elastix status`'s report as JSON, or None when the store holds no such run; raises
    ValueError for bad settings or an unreachable store, the store's errors otherwise."""

def job_dump(
    backend: str, endpoint: str, run_id: str, conf_json: str, rank: Optional[int], timeout: float
) -> Optional[str]:
    """`elastix dump`'s stacks of a running job's workers as JSON, or None when the store holds
    no such run; raises ValueError for bad settings, a job with no running round, a rank not
    in it, or an unreachable store."""

# -- elastix.rpc (rust/python/src/rpc) -------------------------------------------------------

_GidTuple = Tuple[int, int]
_Answer = Tuple[int, bytes, Sequence["RecvBuffer"]]

@final
class RecvBuffer:
    """Received bytes, owned by Python, as a writable buffer."""

    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...

@final
class Responder:
    def respond(self, status: int, payload: object, buffers: Sequence[object]) -> None: ...

@final
class Request:
    sender: int
    op: int
    rref: _GidTuple
    fork: _GidTuple
    payload: bytes
    buffers: Tuple[RecvBuffer, ...]
    responder: Responder

# -- peer authentication (rust/python/src/auth.rs) -----------------------------------------------

class AuthRefused(Exception):
    """The peer and this process verifiably hold different keys: no retry can help."""

HANDSHAKE_DEADLINE: float

@final
class JobSecret:
    """The job secret, held by the core; its repr names only where it came from."""

@final
class PeerKey:
    """A key peers prove they hold (derived from the job secret); never shown."""

def load_job_secret() -> Optional[JobSecret]: ...
def write_job_secret(path: str) -> None: ...
def group_key(secret: Optional[JobSecret], label: bytes, nonce: bytes) -> PeerKey: ...
def pair_sizes(name: str) -> Tuple[int, int, int, int]: ...

@final
class PairConnector:
    def __new__(cls, key: PeerKey, purpose_name: str, binding: bytes) -> Self: ...
    @property
    def hello(self) -> bytes: ...
    def on_challenge(self, challenge: bytes) -> bytes: ...
    def on_verdict(self, verdict: bytes) -> None: ...
    def session(self) -> SessionChannel: ...

@final
class PairAcceptor:
    def __new__(cls, key: PeerKey, purpose_name: str) -> Self: ...
    def on_hello(self, hello: bytes) -> Tuple[bytes, bytes]: ...
    def on_proof(self, proof: bytes) -> Tuple[bytes, Optional[str]]: ...
    def session(self) -> SessionChannel: ...

@final
class SessionChannel:
    """A connection's session after its handshake (rust/core/src/auth/session.rs)."""

    @property
    def encrypted(self) -> bool: ...
    def seal(self, data: Union[bytes, memoryview]) -> bytes: ...
    def open(self, records: Union[bytes, bytearray, memoryview]) -> bytes: ...

SESSION_OVERHEAD: int
SESSION_MAX_RECORD: int

@final
class ConnectionLobby:
    def __new__(cls, per_source: Optional[int] = None, total: Optional[int] = None) -> Self: ...
    def arrive(self, ip: str, token: int) -> Tuple[int, List[int]]: ...
    def leave(self, ticket: int) -> Optional[int]: ...
    def shed_oldest(self) -> Optional[int]: ...
    @property
    def waiting(self) -> int: ...

@final
class RRefHandle:
    def is_owner(self) -> bool: ...
    def owner(self) -> int: ...
    def rref_id(self) -> _GidTuple: ...
    def fork_id(self) -> _GidTuple: ...
    def confirmed(self) -> bool: ...
    def fork_out(self) -> Tuple[int, _GidTuple, _GidTuple]: ...

@final
class RpcEndpoint:
    """One worker's RPC transport and RRef table."""

    def __new__(
        cls, rank: int, world: int, host: str, key: PeerKey, control_delay: Optional[Tuple[float, float]] = None
    ) -> Self: ...
    def address(self) -> Tuple[str, int]: ...
    def set_peers(self, peers: Sequence[Tuple[str, str]]) -> None: ...
    def describe(self, rank: int) -> str: ...
    def call(
        self,
        to: int,
        op: int,
        payload: object,
        buffers: Sequence[object],
        rref: Optional[_GidTuple] = None,
        fork: Optional[_GidTuple] = None,
        timeout: Optional[float] = None,
    ) -> _Answer: ...
    def call_async(
        self,
        to: int,
        op: int,
        payload: object,
        buffers: Sequence[object],
        token: int,
        rref: Optional[_GidTuple] = None,
        fork: Optional[_GidTuple] = None,
        timeout: Optional[float] = None,
    ) -> None: ...
    def next_completion(self, wait: float) -> Optional[Tuple[int, Any]]: ...
    def next_request(self, wait: float) -> Optional[Request]: ...
    def is_closed(self) -> bool: ...
    def new_owner(self, value: object) -> RRefHandle: ...
    def start_remote(self, owner: int) -> Tuple[_GidTuple, _GidTuple, RRefHandle]: ...
    def fork_in(self, owner: int, rref: _GidTuple, fork: _GidTuple, parent: int) -> RRefHandle: ...
    def fork_not_delivered(self, owner: int, rref: _GidTuple, fork: _GidTuple) -> None: ...
    def set_value(self, rref: _GidTuple, value: object) -> List[Responder]: ...
    def owner_value(self, rref: _GidTuple, timeout: Optional[float] = None) -> Any: ...
    def stats(self) -> Dict[str, int]: ...
    def describe_refs(self) -> List[str]: ...
    def outstanding(self) -> Tuple[int, int]: ...
    def release_all_users(self) -> None: ...
    def clear_owners(self) -> int: ...
    def close(self) -> None: ...
