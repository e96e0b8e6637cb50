"""Memory safety at the Python/Rust boundary of the collectives: no Python call, in any order,
can make the process die of a signal. Shared memory is reached by checked offsets, never
addresses; a closed segment refuses every call; views keep the memory mapped; closing ends the
waits in progress; destroying a group with a collective still waiting for a peer fails that
collective and returns. Each risky case runs in its own process, whose exit status is checked
not to be a signal."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest

import collectives_harness as harness
import elastix

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(code: str, timeout: float = 60.0) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "python"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}:\n{proc.stderr}"
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_no_function_takes_an_address_and_bad_offsets_raise():
    out = run_python(
        """
        import numpy as np
        from elastix._core import collectives as c
        assert not hasattr(c, "load") and not hasattr(c, "publish"), "address-taking functions are gone"
        seg = c.Segment.create(4096)
        for call in (lambda: seg.load(8 << 40), lambda: seg.load(4096), lambda: seg.load(3),
                     lambda: seg.publish(4090, None, 1), lambda: seg.publish(0, 4094, 1),
                     lambda: c.Waiter(seg, [1 << 50], [None], [None], [0]),
                     lambda: c.Waiter(seg, [0], [None], [None], [0], own_flag=4, desc_offsets=(64, 192)),
                     lambda: c.Waiter(seg, [0], [None], [None], [0], slots=(1024, 1024, 3, 0)),  # past the end
                     lambda: c.Waiter(seg, [0], [None], [None], [0], slots=(1024, 512, 2, 2)),  # no rank 2
                     lambda: c.Waiter(seg, [0], [None], [None], [0], slots=(1000, 8, 2, 0)),  # unaligned
                     lambda: c.Waiter(seg, [0], [None], [None], [0], slots=(0, 1 << 62, 4, 0))):  # overflows
            try:
                call()
            except ValueError as err:
                print("refused:", err)
            else:
                raise SystemExit("accepted a bad offset")
        w = c.Waiter(seg, [0], [None], [None], [0], own_flag=4096 - 64, desc_offsets=(64, 192))
        try:
            w.step(1, [1] * 16, 0.1)  # the descriptor would run past the end
        except ValueError as err:
            print("refused:", err)
        x = np.ones(64, np.float32)
        for call in (lambda: w.all_reduce_small(1, None, 0.1, x, 11, 0),  # made without slots
                     lambda: c.Waiter(seg, [0], [None], [None], [0], own_flag=4096 - 64,
                                      slots=(1024, 128, 2, 0)).all_reduce_small(1, None, 0.1, x, 11, 0),  # too big
                     lambda: c.Waiter(seg, [0], [None], [None], [0], own_flag=4096 - 64,
                                      slots=(1024, 256, 2, 0)).all_reduce_small(1, None, 0.1, x, 99, 0)):  # dtype
            try:
                call()
            except ValueError as err:
                print("refused:", err)
        seg.publish(8, None, 5)
        assert seg.load(8) == 5 and np.frombuffer(seg, np.uint64)[1] == 5
        print("ok")
        """
    )
    assert out.count("refused:") == 15 and out.strip().endswith("ok")


def test_a_closed_segment_raises_on_every_call():
    out = run_python(
        """
        import numpy as np
        from elastix._core import collectives as c
        seg = c.Segment.create(4096)
        w = c.Waiter(seg, [0], [8], [16], [0], own_flag=64, own_waiters=80, own_abort=72)
        ws = c.Waiter(seg, [0], [8], [16], [0], own_flag=64, own_waiters=80, own_abort=72, slots=(1024, 512, 2, 0))
        assert seg.close() and seg.closed and not seg.close()
        calls = {
            "load": lambda: seg.load(0),
            "publish": lambda: seg.publish(0, None, 1),
            "release_name": seg.release_name,
            "wait": lambda: w.wait(1, 0.1),
            "step": lambda: w.step(1, [1, 2], 0.1),
            "abort": lambda: w.abort(1),
            "all_reduce_small": lambda: ws.all_reduce_small(1, None, 0.1, np.ones(4, np.float32), 11, 0),
            "new waiter": lambda: c.Waiter(seg, [0], [None], [None], [0]),
        }
        for name, call in calls.items():
            try:
                call()
            except ValueError as err:
                assert "closed" in str(err), err
            else:
                raise SystemExit(f"{name} worked on a closed segment")
        for view in (memoryview, lambda s: np.frombuffer(s, np.uint8)):
            try:
                view(seg)
            except BufferError:
                pass
            else:
                raise SystemExit("a closed segment exported a buffer")
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_views_keep_the_memory_mapped_after_close():
    out = run_python(
        """
        import gc
        import numpy as np
        from elastix._core import collectives as c
        seg = c.Segment.create(1 << 20)
        a = np.frombuffer(seg, np.float64)
        m = memoryview(seg)
        a[:] = 2.0
        seg.close()
        a += 1.0  # still mapped: the view holds it
        assert a.sum() == 3.0 * a.size and m[8:16].tobytes() == np.float64(3.0).tobytes()
        del a
        gc.collect()
        m[0] = 7  # the last view still holds it
        m.release()
        del seg
        gc.collect()
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_close_ends_a_wait_in_progress_on_another_thread():
    out = run_python(
        """
        import threading, time
        from elastix._core import collectives as c
        seg = c.Segment.create(4096)
        # a peer (offset 0) that never publishes; no timeout, spin briefly then sleep
        w = c.Waiter(seg, [0], [8], [16], [0], own_flag=64, own_waiters=80, own_abort=72,
                     spin_iters=10, yield_us=10, check_ms=2)
        outcome = []
        t = threading.Thread(target=lambda: outcome.append(w.wait(1)))
        t.start()
        deadline = time.monotonic() + 30
        while seg.load(16) == 0:  # it registered as a sleeper on the peer's counter
            assert time.monotonic() < deadline, "the wait never slept"
            time.sleep(0.001)
        assert seg.close()
        t.join(30)
        assert not t.is_alive(), "close did not end the wait"
        assert outcome == [("closed", [0])], outcome
        print("ok")
        """
    )
    assert out.strip() == "ok"


def pending_all_reduce_then_destroy():
    """Rank 0 starts an async all_reduce that rank 1 never joins, then destroys the group."""
    import numpy as np

    ec = harness.init(timeout=timedelta(seconds=120))
    side = elastix.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timedelta(seconds=60))
    if ec.get_rank() == 1:
        side.wait(["safety/rank0-done"])  # alive all along, never in the collective
        return "waited"
    work = ec.all_reduce(np.ones(1024, np.float32), async_op=True)
    # until the worker thread sleeps on rank 1's counter (registered in rank 1's waiters word)
    from elastix.collectives.shm_comm import CTRL_BYTES, PAGE, W_WAITERS_BYTE

    segment = ec._world().default.backend.segment
    deadline = time.monotonic() + 60
    while segment.load(PAGE + CTRL_BYTES + W_WAITERS_BYTE) == 0:
        assert time.monotonic() < deadline, "the all_reduce never started waiting"
        time.sleep(0.001)
    ec.destroy_process_group()
    err = work.exception()
    side.set("safety/rank0-done", "1")
    return [work.is_completed(), type(err).__name__, str(err), isinstance(err, ec.CollectiveError)]


@pytest.mark.parametrize("method", ["memfd", "file"])
def test_destroy_with_a_pending_all_reduce_fails_it_and_exits_cleanly(method):
    results = harness.start(pending_all_reduce_then_destroy, 2, timeout=90, env={"ELASTIX_SHM": method}).wait()
    for r in results:
        assert r.returncode == 0, r.describe()
    completed, _kind, message, is_collective_error = results[0].value
    assert completed and is_collective_error, results[0].value
    assert "destroyed" in message and "rank(s) 1" in message, message
    assert results[1].value == "waited"


def pending_irecv_then_destroy():
    """Rank 0 waits in an irecv for a second message rank 1 never sends, then destroys."""
    import numpy as np

    ec = harness.init(timeout=timedelta(seconds=120))
    side = elastix.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timedelta(seconds=60))
    x = np.zeros(256)
    if ec.get_rank() == 1:
        ec.send(np.ones(256), 0)  # the channel exists from here on
        side.wait(["safety/rank0-done"])
        return "waited"
    ec.recv(x, 1)
    work = ec.irecv(x, 1)
    channel = ec._world().default.backend.p2p.inc[1]
    deadline = time.monotonic() + 60
    while channel.segment.load(128) == 0:  # W_WAITERS: rank 0 sleeps on rank 1's write position
        assert time.monotonic() < deadline, "the irecv never started waiting"
        time.sleep(0.001)
    ec.destroy_process_group()
    err = work.exception()
    side.set("safety/rank0-done", "1")
    return [work.is_completed(), str(err), isinstance(err, ec.CollectiveError)]


def test_destroy_with_a_pending_irecv_fails_it_and_exits_cleanly():
    results = harness.start(pending_irecv_then_destroy, 2, timeout=90).wait()
    for r in results:
        assert r.returncode == 0, r.describe()
    completed, message, is_collective_error = results[0].value
    assert completed and is_collective_error and "destroyed" in message, results[0].value
