"""elastix.checkpoint on its own files (a memory directory of the test's own, no agent): what
a state may hold, what comes back, and the refusals."""

import json
import os
import subprocess
import threading

import numpy as np
import pytest

import elastix
from elastix.checkpoint import Checkpoint, CheckpointError
from elastix.checkpoint.storage import Slots


def state(step):
    return {
        "model": {"w": np.full((3, 4), step, dtype=np.float32), "b": np.arange(4, dtype=np.int64)},
        "optimizer": [np.zeros(2, dtype=np.float64), (np.float32(0.5), "adam")],
        "step": step,
        "note": None,
        "raw": b"\x00\x01",
    }


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (np.ndarray, np.generic)):
        return np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b)
    return a == b


def test_a_first_start_loads_nothing_and_a_save_comes_back(tmp_path):
    ckpt = elastix.checkpoint.open(memory=str(tmp_path / "memory"))
    assert ckpt.load() is None and ckpt.step is None
    for step in range(3):
        ckpt.save(step, state(step))
    again = elastix.checkpoint.open(memory=str(tmp_path / "memory"))
    loaded = again.load()
    assert again.step == 2 and again.source == "memory"
    assert same(loaded, state(2))


def test_a_save_that_does_not_block_copies_beside_the_caller_and_wait_returns_once_it_is_whole(tmp_path):
    memory = str(tmp_path / "memory")
    ckpt = elastix.checkpoint.open(memory=memory)
    ckpt.save(1, state(1))
    # the copy is held at a gate: save(block=False) returns while it has not run
    gate, copy = threading.Event(), ckpt._memory.save
    ckpt._memory.save = lambda *args: (gate.wait(30), copy(*args))
    ckpt.save(2, state(2), block=False)
    assert same(elastix.checkpoint.open(memory=memory).load(), state(1)), "step 2 is not whole yet"
    gate.set()
    ckpt.wait()
    assert same(elastix.checkpoint.open(memory=memory).load(), state(2))
    ckpt.wait()  # nothing in flight: returns at once
    # the next save, load and close each wait for a copy in flight first
    ckpt._memory.save = copy
    ckpt.save(3, state(3), block=False)
    ckpt.save(4, state(4), block=False)
    assert same(ckpt.load(), state(4)) and ckpt.step == 4
    ckpt.save(5, state(5), block=False)
    ckpt.close()
    assert same(elastix.checkpoint.open(memory=memory).load(), state(5))


def test_pipelined_saves_fault_in_the_slot_the_next_save_takes_and_touch_no_step(tmp_path):
    memory = tmp_path / "memory"
    slots = memory / "rank-0"
    big = {"w": np.arange(1 << 20, dtype=np.float32)}  # 4 MiB
    size = big["w"].nbytes

    memory.mkdir()

    def saved(step, pinned=()):
        (memory / "pinned.json").write_text(json.dumps({"v": 1, "steps": list(pinned)}))
        ckpt = elastix.checkpoint.open(memory=str(memory))
        ckpt.save(step, {"w": big["w"] + step}, block=False)
        ckpt._copier.shutdown()  # the copy, then the head start on the next save's slot, done
        ckpt.close()
        return sorted(p.name for p in slots.glob("slot-*.data"))

    assert saved(0) == ["slot-0.data", "slot-1.data"], "slot 1, which the next save takes, is prepared"
    assert os.stat(slots / "slot-1.data").st_blocks * 512 >= size, "its pages are in"
    assert not (slots / "slot-1.json").exists(), "a prepared slot holds no step"
    assert slot_steps(memory) == [0] and same(elastix.checkpoint.open(memory=str(memory)).load(), {"w": big["w"]})
    # the next saves alternate between the two: nothing more is prepared
    assert saved(1) == saved(2) == ["slot-0.data", "slot-1.data"]
    # a pinned step keeps its slot: the save after the next one takes a fresh slot, prepared now
    assert saved(3, pinned=[2]) == ["slot-0.data", "slot-1.data", "slot-2.data"]
    assert slot_steps(memory) == [2, 3]
    assert same(elastix.checkpoint.open(memory=str(memory)).load(), {"w": big["w"] + 3})


def test_closing_gives_up_the_head_start_on_a_slot_no_save_here_will_use(tmp_path):
    """A worker leaving its group for a re-form closes its checkpoint: the next save may be
    another rank's (other slots), so faulting in this rank's next slot would only make the
    re-form wait."""
    slots = Slots(str(tmp_path / "rank-0"), 0)
    os.makedirs(slots.dir)
    size = 8 << 20
    slots.stop_preparing()  # as Checkpoint.close does first
    slots.prepare(size)
    data = tmp_path / "rank-0" / "slot-0.data"
    assert os.stat(data).st_blocks * 512 < size, "no page faulted in once told to stop"
    slots.close()  # the slots can be used again: a later head start runs, over the one given up
    slots.prepare(size)
    assert os.stat(data).st_blocks * 512 >= size


def test_a_slot_torn_by_a_crash_mid_save_is_not_used(tmp_path):
    memory = tmp_path / "memory"
    ckpt = elastix.checkpoint.open(memory=str(memory))
    ckpt.save(1, state(1))
    ckpt.save(2, state(2))
    # the next save goes into the slot of step 1; a crash in the middle leaves it without manifest
    slots = sorted((memory / "rank-0").glob("slot-*.json"), key=lambda p: json.loads(p.read_text())["step"])
    slots[0].unlink()
    (memory / "rank-0" / slots[0].name.replace(".json", ".data")).write_bytes(b"torn")
    loaded = elastix.checkpoint.open(memory=str(memory)).load()
    assert same(loaded, state(2))


def test_a_changed_structure_is_refused_naming_the_first_difference(tmp_path):
    ckpt = elastix.checkpoint.open(memory=str(tmp_path / "memory"))
    ckpt.save(4, state(4))
    now = state(0)
    now["model"]["w"] = np.zeros((3, 5), dtype=np.float32)
    with pytest.raises(CheckpointError, match=r"state\['model'\]\['w'\]: saved with shape \[3, 4\], now \[3, 5\]"):
        ckpt.load(like=now)
    del now["note"]
    with pytest.raises(CheckpointError, match=r"gone: \['note'\]"):
        ckpt.load(like=now)
    assert same(ckpt.load(like=state(0)), state(4))


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"f": lambda: 0}, r"state\['f'\]: cannot save a builtins.function"),
        ({1: np.zeros(1)}, "keys must be str"),
        ({"o": np.array([object()])}, "array of Python objects"),
    ],
)
def test_what_cannot_be_saved_is_named_and_nothing_is_written(tmp_path, bad, says):
    ckpt = elastix.checkpoint.open(memory=str(tmp_path / "memory"))
    with pytest.raises(CheckpointError, match=says):
        ckpt.save(0, bad)
    assert ckpt.load() is None


def test_without_an_agent_open_says_how_to_run(monkeypatch):
    monkeypatch.delenv("ELASTIX_CHECKPOINT_MEMORY", raising=False)
    with pytest.raises(CheckpointError, match="elastix run"):
        elastix.checkpoint.open()
    with pytest.raises(CheckpointError, match="step must be an int"):
        Checkpoint("/nonexistent", None, 0, 1).save(-1, {})


def test_a_persisted_step_is_read_from_disk_and_a_corrupt_one_is_passed_over(tmp_path):
    """The disk layout as the agent writes it (rust/core/src/agent/checkpoints/persist.rs):
    the newest step's file corrupt, the one before is taken."""
    import zlib

    run_dir = tmp_path / "ckpt" / "run"
    for step in (5, 6):
        source = elastix.checkpoint.open(memory=str(tmp_path / f"m{step}"))
        source.save(step, state(step))
        slot = next((tmp_path / f"m{step}" / "rank-0").glob("slot-*.json"))
        manifest = json.loads(slot.read_text())
        data = (slot.parent / slot.name.replace(".json", ".data")).read_bytes()[: manifest["size"]]
        target = run_dir / f"step-{step:012d}"
        target.mkdir(parents=True)
        (target / "rank-0.data").write_bytes(data)
        (target / "rank-0.json").write_text(json.dumps({**manifest, "crc32": zlib.crc32(data), "persisted": 0.0}))
    fresh = elastix.checkpoint.open(memory=str(tmp_path / "empty"), directory=str(run_dir))
    assert same(fresh.load(), state(6)) and fresh.source == "disk"
    newest = run_dir / f"step-{6:012d}" / "rank-0.data"
    newest.write_bytes(b"\xff" + newest.read_bytes()[1:])
    fresh = elastix.checkpoint.open(memory=str(tmp_path / "empty"), directory=str(run_dir))
    assert same(fresh.load(), state(5)) and fresh.step == 5


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_shared_memory_too_small_says_the_size_needed_and_how_to_raise_it(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)
    try:
        with elastix.checkpoint.open(memory=str(small)) as ckpt:
            with pytest.raises(
                CheckpointError, match=r"shared memory too small for this checkpoint: 1048576 bytes needed.*--shm-size"
            ):
                ckpt.save(0, {"w": np.zeros(1 << 20, dtype=np.uint8)})
            # a save that does not block says it when the loop waits for its copy
            ckpt.save(0, {"w": np.zeros(1 << 20, dtype=np.uint8)}, block=False)
            with pytest.raises(CheckpointError, match=r"shared memory too small"):
                ckpt.wait()
            ckpt.save(0, {"w": np.zeros(8, dtype=np.uint8)})  # a state that fits still saves
            assert ckpt.load()["w"].shape == (8,)
    finally:
        subprocess.run(["umount", str(small)], check=True)


def slot_steps(memory, rank=0):
    return sorted(json.loads(p.read_text())["step"] for p in (memory / f"rank-{rank}").glob("slot-*.json"))


def test_saves_keep_the_steps_the_agent_pinned_and_two_slots_without_pins(tmp_path):
    memory = tmp_path / "memory"
    ckpt = elastix.checkpoint.open(memory=str(memory))
    for step in range(5):
        ckpt.save(step, state(step))
    assert slot_steps(memory) == [3, 4], "without pins: the newest step and the one before"
    # the agent copies step 4 to a peer, and step 2 is the job's safe step: both are kept
    (memory / "pinned.json").write_text(json.dumps({"v": 1, "steps": [4]}))
    for step in range(5, 9):
        ckpt.save(step, state(step))
    assert slot_steps(memory) == [4, 7, 8]
    (memory / "pinned.json").write_text(json.dumps({"v": 1, "steps": [4, 8]}))
    for step in range(9, 12):
        ckpt.save(step, state(step))
    assert slot_steps(memory) == [4, 8, 10, 11]
    assert same(elastix.checkpoint.open(memory=str(memory)).load(), state(11))


def test_a_grown_world_restores_each_new_rank_from_a_replica_and_a_peer_s_copy_is_read(tmp_path):
    memory = tmp_path / "memory"
    Checkpoint(str(memory), None, 1, 1).save(6, state(6))
    # the world grew from 2 to 4 ranks: rank 3 restores rank 1's state
    grown = Checkpoint(str(memory), None, 3, 1, saved_world=2)
    assert grown.source_rank == 1
    assert same(grown.load(), state(6)) and grown.source == "memory"
    # a copy another node's agent sent is under peers/ and says so
    os.makedirs(memory / "peers")
    os.rename(memory / "rank-1", memory / "peers" / "rank-1")
    again = Checkpoint(str(memory), None, 1, 1)
    assert same(again.load(), state(6)) and again.source == "peer"
    # what was restored is told to the agent (elastix status shows it)
    restored = json.loads((memory / "rank-1" / "restored.json").read_text())
    assert (restored["step"], restored["source"]) == (6, "peer")


def test_a_new_rank_restores_the_replica_its_agent_chose(tmp_path, monkeypatch):
    # the node holds rank 0's state, not rank 1's: its agent tells new rank 3 to take rank 0's
    memory = tmp_path / "memory"
    Checkpoint(str(memory), None, 0, 2).save(6, state(6))
    monkeypatch.setenv("ELASTIX_CHECKPOINT_SAVED_WORLD", "2")
    monkeypatch.setenv("ELASTIX_CHECKPOINT_SOURCES", "2:1,3:0")
    monkeypatch.setenv("RANK", "3")
    chosen = elastix.checkpoint.open(memory=str(memory))
    assert chosen.source_rank == 0
    monkeypatch.setenv("RANK", "5")  # not named: rank % saved world size
    assert elastix.checkpoint.open(memory=str(memory)).source_rank == 1


def test_a_round_re_formed_without_a_restart_agrees_on_its_own_keys(tmp_path, monkeypatch):
    """A member lost or joining re-forms the job with the restart count unchanged: the ranks of
    the new round must not read what the round before left in the store."""
    import threading
    import time

    store = elastix.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")

    def round_(number, step, late):
        """Both ranks of round `number` restore what they saved at `step`; rank 1 comes late."""
        monkeypatch.setenv("ELASTIX_ROUND", str(number))
        ranks = [Checkpoint(str(tmp_path / f"round{number}-rank{rank}"), None, rank, 2) for rank in (0, 1)]
        for ckpt in ranks:
            ckpt.save(step, state(step))
        loaded = [None, None]

        def load(rank):
            loaded[rank] = ranks[rank].load()

        threads = [threading.Thread(target=load, args=(rank,)) for rank in (0, 1)]
        threads[0].start()
        time.sleep(late)  # rank 0 asks before rank 1 has answered: it must wait for this round's answer
        threads[1].start()
        for thread in threads:
            thread.join(30)
        return [ckpt.step for ckpt in ranks], loaded

    assert round_(0, 3, 0)[0] == [3, 3]
    steps, loaded = round_(1, 5, 0.3)
    assert steps == [5, 5] and all(same(state(5), got) for got in loaded)


def test_a_rank_that_cannot_read_the_step_its_agents_hold_refuses_to_start_afresh(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIX_CHECKPOINT_HELD_STEP", "7")
    with pytest.raises(CheckpointError, match=r"holds step 7 of every rank.*Refusing to start afresh"):
        elastix.checkpoint.open(memory=str(tmp_path / "memory")).load()
