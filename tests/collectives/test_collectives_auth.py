"""Only members of a group may connect to a rank's collective TCP listener.

The job secret (``elastix._auth.load_secret``, the core's loader): from a private file, or (with
a warning) from the environment; a file others can read, a link, a weak secret are refused. Over
TCP every connection proves, both ways and the connector first, that it holds the group's key
(derived from the secret and a per-group nonce from the store): a stranger's connection, with a
wrong key, a truncated, garbled, oversized or replayed handshake, or a claim no member would
make, is closed and never used, while the genuine connections carry on. The design keeps the acceptor waiting for the genuine rank: the sum is right when that rank
comes, and when it does not, the timeout names the refused connections.

In-process tests make ``TcpComm``s directly on one store; end-to-end tests spawn ranks on fake
hosts (collectives_harness). Every wait is bounded; nothing asserts on timings.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import warnings
from datetime import timedelta
from typing import List, Optional, Tuple

import numpy as np
import pytest

import collectives_harness as harness
import elastix
from elastix import _auth, _core
from elastix._auth import FILE_ENV, TOKEN_ENV, load_secret
from elastix.collectives import tcp_comm
from elastix.collectives.errors import AuthenticationError, CollectiveError, CollectiveTimeoutError
from elastix.collectives.tcp_accept import CHALLENGE_BYTES, HELLO_BYTES, PAIR, PROOF_BYTES
from elastix.collectives.tcp_comm import TcpComm

SECRET = "correct horse battery staple"
WAIT = 30.0  # bound on any single wait for an answer
ADDR_KEY = "elastix/collectives/pg0/tcp/addr/{}"  # the world group's listener addresses in the job's store


def write_secret(tmp_path, text: str = SECRET, mode: int = 0o600, name: str = "token") -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return str(path)


@pytest.fixture
def env(monkeypatch):
    """No secret unless a test sets one."""
    monkeypatch.delenv(FILE_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    return monkeypatch


# -- the secret ----------------------------------------------------------------------------------


def test_secret_from_a_private_file_loads_without_a_warning(tmp_path, env):
    path = write_secret(tmp_path, SECRET + " \n\n")
    env.setenv(FILE_ENV, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a file is the recommended way: no warning
        secret = load_secret()
    assert secret is not None and path in repr(secret) and SECRET not in repr(secret)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o620, 0o602, 0o744], ids=lambda m: f"{m:04o}")
def test_secret_file_others_may_read_or_write_is_refused(tmp_path, env, mode):
    path = write_secret(tmp_path, mode=mode)
    env.setenv(FILE_ENV, path)
    with pytest.raises(PermissionError) as info:
        load_secret()
    message = str(info.value)
    assert "chmod 600" in message and path in message and f"mode {mode & 0o777:03o}" in message
    assert SECRET not in message and "horse" not in message
    assert SECRET not in repr(info.value)


def test_no_secret_is_none(env):
    assert load_secret() is None


def test_empty_missing_and_weak_secrets_are_errors(tmp_path, env):
    cases = [
        (write_secret(tmp_path, " \n\n", name="blank"), "empty"),
        ("", "set but empty"),
        (str(tmp_path / "absent"), "cannot read it"),
        (write_secret(tmp_path, "summer2024", name="short"), "at least 16"),
        (write_secret(tmp_path, "summer2024summer2024", name="repeated"), "easy to guess"),
    ]
    for path, why in cases:
        env.setenv(FILE_ENV, path)
        with pytest.raises(PermissionError, match=why) as info:
            load_secret()
        assert "summer" not in str(info.value)
    env.delenv(FILE_ENV)
    env.setenv(TOKEN_ENV, "")
    with pytest.raises(PermissionError, match="set but empty"):
        load_secret()


def test_links_and_files_in_shared_directories_are_refused(tmp_path, env):
    link = tmp_path / "link"
    link.symlink_to(write_secret(tmp_path))
    env.setenv(FILE_ENV, str(link))
    with pytest.raises(PermissionError, match="symbolic link"):
        load_secret()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    env.setenv(FILE_ENV, write_secret(shared))
    with pytest.raises(PermissionError, match="everyone may write to"):
        load_secret()


def test_a_process_that_loaded_the_secret_cannot_be_dumped(tmp_path, env):
    env.setenv(FILE_ENV, write_secret(tmp_path))
    probe = (
        "import ctypes; from elastix import _auth\n"
        "dumpable = lambda: ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE\n"
        "before = dumpable(); _auth.load_secret(); print(before, dumpable())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", "0"], out.stdout + out.stderr


def test_elastix_secret_writes_a_strong_private_secret_once(tmp_path, env):
    path = tmp_path / "job.secret"
    _auth.write_secret(str(path))
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_text().strip()) == 64
    env.setenv(FILE_ENV, str(path))
    assert load_secret() is not None
    with pytest.raises(ValueError, match="exists already"):
        _auth.write_secret(str(path))


def test_secret_file_wins_over_the_environment(tmp_path, env):
    env.setenv(FILE_ENV, write_secret(tmp_path, "the one in the file, long enough"))
    env.setenv(TOKEN_ENV, SECRET)
    secret = load_secret()
    assert secret is not None and FILE_ENV not in repr(secret) and "token" in repr(secret)


def test_secret_module_names_no_secret_in_its_repr():
    assert SECRET not in repr(_auth)


# -- in process: TcpComms on one store -------------------------------------------------------------


@pytest.fixture
def comms(master, env):
    """make(n, timeout) -> the n TcpComms of a group on 127.0.0.1 (rank 0 first: it draws the
    nonce); all are closed at the end."""
    env.setenv("ELASTIX_COLLECTIVES_ADDR", "127.0.0.1")
    made: List[TcpComm] = []
    counter = [0]

    def make(n: int = 2, timeout: Optional[float] = WAIT, name: Optional[str] = None) -> List[TcpComm]:
        counter[0] += 1
        store = elastix.PrefixStore(name or f"g{counter[0]}", master)
        group = [TcpComm(store, r, list(range(n)), timeout) for r in range(n)]
        made.extend(group)
        return group

    yield make
    for comm in made:
        comm.close()


def redirect(comm: TcpComm, rank: int, address: str) -> None:
    """Sends ``comm``'s connections to ``rank`` to ``address``. A SET has no reply in torch's
    protocol, so it is read back on the same connection: once that returns, the server holds it,
    and the comm's own lookup (on a connection of its own) cannot overtake it."""
    comm.store.set(f"tcp/addr/{rank}", address)
    assert comm.store.get(f"tcp/addr/{rank}").decode() == address


def listener(comm: TcpComm) -> Tuple[str, int]:
    host, port = comm.store.get(f"tcp/addr/{comm.me}").decode().rsplit("|", 1)
    return host, int(port)


def dial(comm: TcpComm) -> socket.socket:
    return socket.create_connection(listener(comm), timeout=WAIT)


def read_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, f"closed after {len(buf)} of {n} bytes"
        buf += chunk
    return buf


def closed_by_peer(sock: socket.socket) -> bool:
    """Reads until the other end closes (True) or WAIT passes (False)."""
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def send_quietly(sock: socket.socket, data: bytes) -> None:
    """Sends what the peer lets through: it may close and reset the connection meanwhile."""
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass


def stranger_key() -> _core.PeerKey:
    """A key a stranger without the secret could hold: any key but the group's."""
    return _core.group_key(None, b"", secrets.token_bytes(32))


def hello(claim: int, to: int) -> bytes:
    """A hello claiming rank ``claim``, meant for rank ``to``."""
    return _core.PairConnector(stranger_key(), tcp_comm.PURPOSE, PAIR.pack(claim, to)).hello


def prove_wrongly(sock: socket.socket, claim: int, to: int, then: bytes = b"") -> None:
    """A stranger's handshake as far as it goes: hello, then a proof under a wrong key."""
    connector = _core.PairConnector(stranger_key(), tcp_comm.PURPOSE, PAIR.pack(claim, to))
    sock.sendall(connector.hello)
    send_quietly(sock, connector.on_challenge(read_exact(sock, CHALLENGE_BYTES)) + then)


def exchange(lo: TcpComm, hi: TcpComm, payload: bytes) -> None:
    """Both directions of the pair's connection carry data (it is made if need be)."""
    lo.send(hi.me, [payload])
    got = bytearray(len(payload))
    hi.recv_into(lo.me, got)
    assert bytes(got) == payload
    hi.send(lo.me, [payload[::-1]])
    back = bytearray(len(payload))
    lo.recv_into(hi.me, back)
    assert bytes(back) == payload[::-1]


def test_members_connect_with_a_secret(comms, env, tmp_path):
    env.setenv(FILE_ENV, write_secret(tmp_path))
    c0, c1, c2 = comms(3)
    exchange(c0, c1, b"zero to one")
    exchange(c0, c2, b"zero to two")
    exchange(c1, c2, b"one to two")
    assert c0.refused == c1.refused == c2.refused == []


def test_stranger_with_a_wrong_key_is_refused_and_its_data_never_used(comms, env, tmp_path, caplog):
    env.setenv(FILE_ENV, write_secret(tmp_path))
    c0, c1 = comms(2)
    stranger = dial(c1)
    prove_wrongly(stranger, 0, 1, then=b"forged contribution")  # "I am rank 0"
    assert closed_by_peer(stranger)
    where = "%s:%d" % stranger.getsockname()
    [refusal] = c1.refused
    assert isinstance(refusal, AuthenticationError)
    assert refusal.address == where and refusal.rank == 0
    assert "claiming to be rank 0" in str(refusal) and "proof is wrong" in str(refusal)
    assert any(where in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    stranger.close()
    # the genuine rank 0 connects afterwards; what rank 1 gets from "rank 0" is its data
    exchange(c0, c1, b"genuine contribution")


def test_a_stranger_gets_nothing_to_test_guesses_against(comms, env, tmp_path):
    """The listener answers a hello with a random nonce only, and a wrong proof with a refusal
    that carries nothing: no sample of the key to test guesses against offline."""
    env.setenv(FILE_ENV, write_secret(tmp_path))
    _c0, c1 = comms(2)
    stranger = dial(c1)
    connector = _core.PairConnector(stranger_key(), tcp_comm.PURPOSE, PAIR.pack(0, 1))
    stranger.sendall(connector.hello)
    challenge = read_exact(stranger, CHALLENGE_BYTES)
    stranger.settimeout(0.5)
    with pytest.raises(socket.timeout):
        stranger.recv(1)  # nothing more before this side proves the key
    stranger.settimeout(WAIT)
    stranger.sendall(connector.on_challenge(challenge))
    verdict = read_exact(stranger, tcp_comm.VERDICT_BYTES)
    assert challenge[0] == 1 and verdict == bytes(tcp_comm.VERDICT_BYTES), (challenge, verdict)
    assert closed_by_peer(stranger)
    stranger.close()


def test_acceptor_keeps_waiting_and_its_timeout_names_the_strangers(comms, caplog):
    caplog.set_level(logging.WARNING, logger="elastix")
    _c0, c1 = comms(2, timeout=3.0)  # rank 0 never connects
    wheres = []
    for claim in (0, 0):  # two strangers from one host: both refused, logged once
        stranger = dial(c1)
        prove_wrongly(stranger, claim, 1)
        assert closed_by_peer(stranger)
        wheres.append("%s:%d" % stranger.getsockname())
        stranger.close()
    with pytest.raises(CollectiveTimeoutError) as info:
        c1.conn(0)
    message = str(info.value)
    assert "rank 0 did not connect" in message and info.value.ranks == [0]
    for where in wheres:
        assert f"{where} (claiming to be rank 0)" in message
    assert isinstance(info.value.__cause__, AuthenticationError)
    assert info.value.__cause__.address == wheres[-1]
    logged = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(logged) == 1 and wheres[0] in logged[0]


# each case: (the rank attacked, what the stranger sends, what the refusal says); rank 1 is
# connected to rank 2 already, ranks 0-1 and 0-2 are not. A stranger's claims are never judged
# (it would learn which rank listens where): all it can do ends with a wrong or missing proof.
ATTACKS = {
    "truncated hello": (2, hello(0, 2)[:20], f"after 20 of {HELLO_BYTES} handshake bytes"),
    "truncated proof": (2, hello(0, 2) + b"x" * 10, "after 10 of 32 handshake bytes"),
    "garbage": (2, secrets.token_bytes(4096), "sent no elastix collectives handshake"),
    "oversized": (2, hello(0, 2) + secrets.token_bytes(1 << 20), "proof is wrong"),
    "rank out of range": (2, hello(7, 2) + bytes(32), "proof is wrong"),
    "meant for another rank": (2, hello(0, 1) + bytes(32), "proof is wrong"),
    "silent": (2, b"", "did not complete the handshake"),
}
# claims no member would make, made with the group's key (a member with a bug, or a peer that
# holds the key): (the rank attacked, (claim, to), what the refusal says)
MEMBER_CLAIMS = {
    "rank out of range": (2, (7, 2), "no rank 7 in this group of 3"),
    "huge rank": (2, (2**64 - 1, 2), "no rank 18446744073709551615 in this group"),
    "higher rank connecting": (1, (2, 1), "rank 2 does not connect to rank 1"),
    "rank connecting to itself": (2, (2, 2), "rank 2 does not connect to rank 2"),
    "rank claimed twice": (2, (1, 2), "rank 1 is connected already"),
    "meant for another rank": (2, (0, 1), "it means to reach group rank 1"),
}


def attacked(victim, stranger, case, why):
    """The victim closed the stranger's connection, refused it for `why`, and nothing else."""
    assert closed_by_peer(stranger), case
    where = "%s:%d" % stranger.getsockname()
    stranger.close()
    [refusal] = victim.refused
    assert refusal.address == where and why in str(refusal), str(refusal)


@pytest.mark.parametrize("case", list(MEMBER_CLAIMS))
def test_claims_no_member_makes_are_refused_once_the_key_is_proven(comms, case):
    target, (claim, to), why = MEMBER_CLAIMS[case]
    c0, c1, c2 = comms(3)
    exchange(c1, c2, b"before")
    victim = [c0, c1, c2][target]
    peer = dial(victim)
    connector = _core.PairConnector(victim._key, tcp_comm.PURPOSE, PAIR.pack(claim, to))
    peer.sendall(connector.hello)
    send_quietly(peer, connector.on_challenge(read_exact(peer, CHALLENGE_BYTES)))
    attacked(victim, peer, case, why)
    exchange(c1, c2, b"after")
    exchange(c0, c1, b"zero to one")


def test_a_stranger_learns_no_rank_from_the_listener(comms):
    """Whatever rank a stranger claims or means to reach, the listener answers alike: a
    challenge, then a refusal of its proof."""
    _c0, c1 = comms(2)
    answers = set()
    for claim, to in [(0, 1), (0, 5), (9, 1), (1, 0)]:
        stranger = dial(c1)
        connector = _core.PairConnector(stranger_key(), tcp_comm.PURPOSE, PAIR.pack(claim, to))
        stranger.sendall(connector.hello)
        challenge = read_exact(stranger, CHALLENGE_BYTES)
        stranger.sendall(connector.on_challenge(challenge))
        verdict = read_exact(stranger, tcp_comm.VERDICT_BYTES)
        answers.add((challenge[0], verdict))
        assert closed_by_peer(stranger)
        stranger.close()
    assert answers == {(1, bytes(tcp_comm.VERDICT_BYTES))}, answers


@pytest.mark.parametrize("case", list(ATTACKS))
def test_bad_handshakes_close_only_the_offending_connection(comms, monkeypatch, case):
    monkeypatch.setattr(tcp_comm, "HANDSHAKE_LIMIT", 1.0)  # how long the silent one is given
    target, data, why = ATTACKS[case]
    c0, c1, c2 = comms(3)
    exchange(c1, c2, b"before")  # a genuine connection, open during the attack
    victim = [c0, c1, c2][target]
    stranger = dial(victim)
    send_quietly(stranger, data)
    if case.startswith("truncated"):
        stranger.shutdown(socket.SHUT_WR)
    assert closed_by_peer(stranger)
    where = "%s:%d" % stranger.getsockname()
    stranger.close()
    [refusal] = victim.refused
    assert refusal.address == where and why in str(refusal), str(refusal)
    # the connection that was open carries on, and the pairs not made yet are made as usual
    exchange(c1, c2, b"after")
    exchange(c0, c1, b"zero to one")
    exchange(c0, c2, b"zero to two")


class Relay:
    """A TCP relay from a port of its own to ``target``, recording what its client sends."""

    def __init__(self, target: Tuple[str, int]) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(WAIT)
        self.target = target
        self.sent = bytearray()
        self.socks: List[socket.socket] = [self.server]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return "%s|%d" % self.server.getsockname()

    def _run(self) -> None:
        client, _ = self.server.accept()
        upstream = socket.create_connection(self.target, timeout=WAIT)
        client.settimeout(None)
        upstream.settimeout(None)
        self.socks += [client, upstream]
        back = threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True)
        back.start()
        self._pump(client, upstream, self.sent)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: Optional[bytearray]) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if record is not None:
                    record += data
                dst.sendall(data)
        except OSError:
            return

    def close(self) -> None:
        for sock in self.socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.thread.join(timeout=WAIT)


def test_replayed_handshake_is_refused(comms, env, tmp_path):
    env.setenv(FILE_ENV, write_secret(tmp_path))
    c0, c1 = comms(2, name="replay")
    real = listener(c1)
    # record rank 0's side of a genuine handshake: the store sends rank 0 through a relay
    relay = Relay(real)
    try:
        redirect(c0, 1, relay.address)
        exchange(c0, c1, b"through the relay")
        captured = bytes(relay.sent[: HELLO_BYTES + PROOF_BYTES])
        assert captured.startswith(b"ELXCOL02")
        # a new listener of the same group and round: same key, but a fresh nonce per connection
        again = TcpComm(c1.store, 1, [0, 1], WAIT)
        try:
            replayer = dial(again)
            send_quietly(replayer, captured)
            assert closed_by_peer(replayer)
            where = "%s:%d" % replayer.getsockname()
            replayer.close()
            [refusal] = again.refused
            assert refusal.address == where and refusal.rank == 0 and "proof is wrong" in str(refusal)
        finally:
            again.close()
        # replayed to the original listener: its proof does not cover the fresh nonce either
        replayer = socket.create_connection(real, timeout=WAIT)
        send_quietly(replayer, captured)
        assert closed_by_peer(replayer)
        replayer.close()
        assert "proof is wrong" in str(c1.refused[-1])
        exchange(c0, c1, b"the genuine connection is unharmed")
    finally:
        relay.close()


def test_listener_without_the_key_is_named_by_the_connector(comms, env, tmp_path):
    env.setenv(FILE_ENV, write_secret(tmp_path, "the first secret of this test", name="one"))
    c0, c1 = comms(2, name="two-secrets")
    # a listener of the same group and round whose process has another secret
    env.setenv(FILE_ENV, write_secret(tmp_path, "the second secret of this test", name="two"))
    other = TcpComm(c1.store, 1, [0, 1], WAIT)
    try:
        host, port = listener(other)
        with pytest.raises(AuthenticationError) as info:
            c0.conn(1)
        assert info.value.address == f"{host}:{port}" and info.value.rank == 1
        assert f"the listener at {host}:{port} is not rank 1 of this group" in str(info.value)
        assert "secret" not in info.value.address
        assert c0.broken is not None  # the group is unusable: the store points at an impostor
    finally:
        other.close()


# -- end to end: ranks on fake hosts ---------------------------------------------------------------


def sums(sizes=(5, 300_000)):
    ec = harness.init()
    r, p = ec.get_rank(), ec.get_world_size()
    ok = []
    for n in sizes:
        x = np.full(n, r + 1, np.float64)
        ec.all_reduce(x)
        ok.append(bool(np.all(x == p * (p + 1) / 2)))
    sub = ec.new_group([0, 1])  # a second group: its own nonce, and no second warning
    if r in (0, 1):
        y = np.full(7, r + 1, np.int64)
        ec.all_reduce(y, group=sub)
        ok.append(bool(np.all(y == 3)))
    ec.destroy_process_group()
    return ok


def test_all_reduce_over_tcp_with_a_secret_file(tmp_path, env):
    # the job's store holds the secret too (made after the variable is set), as an agent's does
    env.setenv(FILE_ENV, write_secret(tmp_path))
    extra = {"ELASTIX_ROUND": ""}
    results = harness.run(sums, 3, hosts=["a", "b", "c"], timeout=90, env=extra, check=False)
    assert all(r.returncode == 0 for r in results), "\n".join(r.describe() for r in results)
    assert [r.value for r in results] == [[True, True, True], [True, True, True], [True, True]]
    assert not any("refused" in r.stderr or "leak" in r.stderr for r in results)


def test_all_reduce_with_the_secret_in_the_environment_warns_once(env):
    env.setenv(TOKEN_ENV, SECRET)  # the env fixture unset any secret file; the store holds it too
    extra = {"ELASTIX_ROUND": ""}
    results = harness.run(sums, 2, hosts=["a", "b"], timeout=90, env=extra, check=False)
    assert all(r.returncode == 0 for r in results), "\n".join(r.describe() for r in results)
    assert [r.value for r in results] == [[True, True, True]] * 2
    for r in results:
        # once per process, from the one loader every layer uses
        assert r.stderr.count("using the job secret in ELASTIX_AUTH_TOKEN") == 1, r.stderr
        assert SECRET not in r.stderr


def wait_then_sum(go: str):
    ec = harness.init()
    from elastix.collectives import group

    group.world().raw_store.wait([go], timedelta(seconds=60))  # the stranger has been refused
    x = np.full(5, ec.get_rank() + 1, np.float64)
    ec.all_reduce(x)
    ec.destroy_process_group()
    return x.tolist()


def test_stranger_never_gets_into_the_sum(tmp_path, env):
    env.setenv(FILE_ENV, write_secret(tmp_path))
    store = harness.make_store()  # holds the secret: the ranks prove it to it
    extra = {"ELASTIX_ROUND": ""}
    workers = harness.start(wait_then_sum, 2, hosts=["a", "b"], env=extra, store=store, timeout=90, kwargs={"go": "go"})
    try:
        host, port = store.get(ADDR_KEY.format(1)).decode().rsplit("|", 1)  # rank 1 accepts rank 0
        stranger = socket.create_connection((host, int(port)), timeout=WAIT)
        # it can read the store (so the nonce), but not the secret file
        poison = tcp_comm.TcpComm.header([0] * 14) + np.full(5, 1e6).tobytes()
        prove_wrongly(stranger, 0, 1, then=poison)
        assert closed_by_peer(stranger)
        where = "%s:%d" % stranger.getsockname()
        stranger.close()
    finally:
        store.set("go", "1")
    results = workers.wait()
    assert all(r.returncode == 0 for r in results), "\n".join(r.describe() for r in results)
    assert [r.value for r in results] == [[3.0] * 5, [3.0] * 5]
    assert f"refused a connection from {where} (claiming to be rank 0)" in results[1].stderr


def other_secrets(files):
    os.environ[FILE_ENV] = files[int(os.environ["RANK"])]
    try:
        ec = harness.init(timeout=timedelta(seconds=5))
        ec.all_reduce(np.ones(5))
        return ["no error"]
    except Exception as err:  # whichever layer refuses first
        return [type(err).__name__, str(err)]


def test_a_rank_with_another_secret_is_refused_by_the_jobs_store_naming_it(tmp_path, env):
    """Rank 1 holds another secret: the job's store (which holds rank 0's, as an agent's
    would) refuses it with the reason, so it never reaches the collectives; rank 0 fails too
    instead of waiting forever. (A listener holding another key is named by the connector:
    test_listener_without_the_key_is_named_by_the_connector.)"""
    files = [write_secret(tmp_path, f"the secret of rank {r}, long", name=f"token{r}") for r in range(2)]
    env.setenv(FILE_ENV, files[0])
    store = harness.make_store()
    workers = harness.start(
        other_secrets, 2, hosts=["a", "b"], store=store, timeout=90, env={"ELASTIX_ROUND": ""}, kwargs={"files": files}
    )
    results = workers.wait()
    assert all(r.returncode == 0 for r in results), "\n".join(r.describe() for r in results)
    first, second = results[0].value, results[1].value
    assert second[0] == "AuthenticationError", second
    assert f"the store at 127.0.0.1:{store.port} refused this client" in second[1], second
    assert "does not hold this job's secret" in second[1], second
    assert first[0] != "no error", first
    for r in results:
        assert "secret of rank" not in r.stderr + str(r.value)


def eager_sends():
    ec = harness.init()
    r = ec.get_rank()
    x = np.full(3, float(r))
    got = {}
    # rank 0 sends to 1 while 1 first waits on 2, and 2 first waits on 0: rank 1 reaches no
    # accept before rank 0's send; the handshake must not make rank 0 wait for it
    if r == 0:
        ec.send(x, 1)
        ec.send(x, 2)
    elif r == 1:
        for src in (2, 0):
            y = np.empty(3)
            ec.recv(y, src)
            got[src] = y.tolist()
    else:
        y = np.empty(3)
        ec.recv(y, 0)
        got[0] = y.tolist()
        ec.send(x, 1)
    ec.destroy_process_group()
    return got


def test_connectors_never_wait_for_the_acceptor_to_reach_an_accept(tmp_path, env):
    env.setenv(FILE_ENV, write_secret(tmp_path))
    extra = {"ELASTIX_ROUND": ""}
    results = harness.run(eager_sends, 3, hosts=["a", "b", "c"], timeout=90, env=extra)
    assert results == [{}, {"2": [2.0] * 3, "0": [0.0] * 3}, {"0": [0.0] * 3}]


class Hijacker(Relay):
    """A relay that passes the handshake through both ways, then keeps what the member sends
    and sends ``own`` (a message of its own) to the listener instead."""

    def __init__(self, target: Tuple[str, int], own: bytes) -> None:
        self.own = own
        super().__init__(target)

    def _run(self) -> None:
        client, _ = self.server.accept()
        upstream = socket.create_connection(self.target, timeout=WAIT)
        self.socks += [client, upstream]
        upstream.sendall(read_exact(client, HELLO_BYTES))
        client.sendall(read_exact(upstream, CHALLENGE_BYTES))
        upstream.sendall(read_exact(client, PROOF_BYTES))
        client.sendall(read_exact(upstream, tcp_comm.VERDICT_BYTES))
        self.sent += client.recv(1 << 16)  # the member's first message, kept from the listener
        send_quietly(upstream, self.own)
        client.settimeout(WAIT)
        try:  # and the rest of what the member sends, kept too
            while chunk := client.recv(1 << 16):
                self.sent += chunk
        except OSError:
            pass


@pytest.mark.parametrize("mode", ["authenticated", "encrypted"])
def test_a_relay_that_passed_the_handshake_through_cannot_send_its_own_messages(comms, env, tmp_path, mode):
    env.setenv(FILE_ENV, write_secret(tmp_path))
    env.setenv("ELASTIX_SESSION", mode)
    c0, c1 = comms(2, timeout=5.0, name=f"hijack-{mode}")
    # its own header (a sum over 8 bytes) and data, in the clear, where the member's would be
    desc = [1, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    forged = tcp_comm.HEADER.pack(tcp_comm.MAGIC, 0, *desc) + b"\x01" * 8
    hijacker = Hijacker(listener(c1), forged)
    try:
        redirect(c0, 1, hijacker.address)
        secret_data = b"the member's gradient bytes"
        c0.send(1, [c0.header(desc), secret_data])
        with pytest.raises(CollectiveError, match="altered after its handshake"):
            c1.check_header(0, desc, "all_reduce")
        # what the member sent is sealed: readable on the way only when not encrypted (once
        # the relay has read at least as many bytes as the member's header and data)
        plain = tcp_comm.HEADER.size + len(secret_data)

        def arrived() -> bool:
            return secret_data in hijacker.sent if mode == "authenticated" else len(hijacker.sent) >= plain

        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline and not arrived():
            time.sleep(0.01)
        seen = bytes(hijacker.sent)
        assert (secret_data in seen) == (mode == "authenticated"), seen
        assert tcp_comm.HEADER.pack(tcp_comm.MAGIC, 0, *desc) not in seen or mode == "authenticated"
    finally:
        hijacker.close()
