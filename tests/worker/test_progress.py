"""elastix.heartbeat / expect_progress writing a heartbeat slot in place, read back from the page
as the agent reads it (a real page file, a real interpreter)."""

import os
import struct
import subprocess
import sys
import textwrap

WORDS = 32
WINDOW, OWNER = 1, 5


def run_with_a_page(tmp_path, code, slot_words=None):
    """Runs `code` in a fresh interpreter given slot 0 of a page (optionally pre-filled); returns
    the page's words afterwards and the run."""
    page = tmp_path / "page"
    page.write_bytes(struct.pack(f"{WORDS}Q", *(slot_words or [0] * WORDS)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIX_")}
    env.update(ELASTIX_HEARTBEAT_FILE=str(page), ELASTIX_HEARTBEAT_SLOT="0")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=60
    )
    return struct.unpack(f"{WORDS}Q", page.read_bytes()), done


def test_nested_windows_of_equal_length_restore_the_enclosing_one(tmp_path):
    code = """
        import os, struct
        import elastix
        page = open(os.environ["ELASTIX_HEARTBEAT_FILE"], "rb")

        def window():
            page.seek(0)
            return struct.unpack("32Q", page.read(256))[1]

        seen = []
        with elastix.expect_progress(within=10):
            with elastix.expect_progress(within=5):
                with elastix.expect_progress(within=10):
                    seen.append(window())
                seen.append(window())
            seen.append(window())
        seen.append(window())
        print(seen, os.getpid())
    """
    words, done = run_with_a_page(tmp_path, code)
    second = 1_000_000_000
    seen, pid = done.stdout.rsplit(" ", 1)
    assert seen == str([10 * second, 5 * second, 10 * second, 0]), done.stdout + done.stderr
    assert words[OWNER] == int(pid), "the slot is claimed by the process that wrote it"


def test_a_slot_claimed_by_another_process_is_left_alone(tmp_path):
    # what a child started with spawn or forkserver finds: the worker's pid in the slot
    claimed = [0] * WORDS
    claimed[OWNER] = 1  # init: never this interpreter
    words, done = run_with_a_page(tmp_path, "import elastix\nelastix.heartbeat()\nprint('ok')\n", claimed)
    assert done.stdout == "ok\n", done.stderr
    assert words == tuple(claimed), "nothing written"


def test_checkpoint_saves_and_restores_tell_the_agent_the_step_the_state_is_at(tmp_path):
    # word 29 (after the flight recorder): where the agent stops the workers when a node joins
    code = f"""
        import os, struct
        import numpy as np
        import elastix
        page = open(os.environ["ELASTIX_HEARTBEAT_FILE"], "rb")

        def saved():
            page.seek(0)
            return struct.unpack("32Q", page.read(256))[29]

        seen = [saved()]
        ckpt = elastix.checkpoint.open(memory={str(tmp_path / "a")!r})
        ckpt.load()
        seen.append(saved())  # nothing restored
        for step in range(3):
            ckpt.save(step, {{"w": np.full(4, step)}}, block=step != 1)
            seen.append(saved())
        ckpt.close()
        other = elastix.checkpoint.open(memory={str(tmp_path / "b")!r})
        other.save(7, {{"w": np.full(4, 7)}})
        seen.append(saved())
        # a restore of an older step than the last saved: the state is at that step again
        again = elastix.checkpoint.open(memory={str(tmp_path / "a")!r})
        again.load()
        seen.append(saved())
        print(seen)
    """
    _, done = run_with_a_page(tmp_path, code)
    assert done.stdout.strip() == str([0, 0, 1, 2, 3, 8, 3]), done.stdout + done.stderr
