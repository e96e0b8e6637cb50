"""A worker that dies of a broken collective says so in two lines (elastix/collectives/folding.py);
everything else keeps Python's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent(
    """\
    import sys
    from elastix.collectives import folding
    from elastix.collectives.errors import AuthenticationError, PeerError

    def step():
        raise {error}

    folding.install()
    folding.install()  # twice: still folded once
    step()
    """
)
BROKEN = "PeerError('rank 2 closed its connection (it exited or failed)', 2)"


def run(tmp_path, error, **env):
    script = tmp_path / "train.py"
    script.write_text(PROGRAM.format(error=error))
    environ = {k: v for k, v in os.environ.items() if k not in ("ELASTIX_ROUND", "ELASTIX_FULL_TRACEBACK")}
    proc = subprocess.run(
        [sys.executable, str(script)], env={**environ, "RANK": "1", **env}, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1, proc.stderr
    return str(script), proc.stderr.strip().splitlines()


def test_a_worker_of_a_job_folds_a_broken_collective_into_two_lines(tmp_path):
    script, lines = run(tmp_path, BROKEN, ELASTIX_ROUND="0")
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"rank 1: a collective broke at {script}:6 (step), its traceback folded"), lines
    assert "ELASTIX_FULL_TRACEBACK=1 prints it" in lines[0]
    # Python's own last line, which the agent's summary reads
    assert lines[1] == "elastix.collectives.errors.PeerError: rank 2 closed its connection (it exited or failed)"


@pytest.mark.parametrize(
    "error, env",
    [
        (BROKEN, {}),  # not started by elastix run
        (BROKEN, {"ELASTIX_ROUND": "0", "ELASTIX_FULL_TRACEBACK": "1"}),
        ("AuthenticationError('a stranger', '10.0.0.9:4000')", {"ELASTIX_ROUND": "0"}),
        ("ValueError('the program own error')", {"ELASTIX_ROUND": "0"}),
    ],
)
def test_everything_else_keeps_its_traceback(tmp_path, error, env):
    _script, lines = run(tmp_path, error, **env)
    assert lines[0] == "Traceback (most recent call last):", lines
    assert not any("its traceback folded" in line for line in lines), lines
