"""`elastix timeline`: hand-written event logs read into the model (lanes, marks, root cause) and
bad input refused with its exit code; then a real 2-node job that fails once and recovers, its
logs drawn as a page, and that page opened in a real headless browser (Debian's chromium,
driven by playwright), hovered and clicked."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from importlib import resources

import pytest

import elastix
from agents import FAST_RDZV, assert_nothing_left, elastix_run, finish_each, node_args
from conftest import marked_processes
from elastix.ops import timeline

T0 = datetime(2026, 11, 26, 18, 0, 0, tzinfo=timezone.utc)
HUNG = (
    "no progress for 2.00s in a window of 2.00s; ranks 0 wait in all_reduce #5 (group 0) for rank 1; "
    "rank 1 is in f (x.py:3); last heartbeat: 2026-11-26T18:00:03.000Z"
)


def event(name, seconds, host, pid, run_id="job7", **fields):
    when = (T0 + timedelta(seconds=seconds)).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return json.dumps({"event": name, "time": when, "run_id": run_id, "host": host, "pid": pid, **fields})


def node0(run_id="job7", at=0.0):
    def e(name, seconds, **fields):
        return event(name, at + seconds, "node0", 100, run_id, **fields)

    return [
        e("round_formed", 0.0, round=0, group_rank=0, group_world_size=2, restart_count=0),
        e("workers_started", 0.1, round=0, global_ranks=[0, 1], pids=[1000, 1001]),
        e("worker_hung", 5.0, global_rank=1, local_rank=1, worker_pid=1001, exitcode=-9, signal="SIGKILL",
          hung=HUNG, root_cause=True, headline=f"rank 1 (host node0) was hung ({HUNG})",
          message="stacks when it was found hung:\n  File \"x.py\", line 3 in f"),
        e("worker_failed", 5.0, global_rank=0, local_rank=0, worker_pid=1000, exitcode=-9, signal="SIGKILL",
          hung=None, root_cause=False, headline="rank 0 (host node0) was killed by SIGKILL", message=None),
        e("workers_stopped", 5.01, round=0, why="failed"),
        e("restart", 5.02, restart_count=1, max_restarts=3, reason="worker failure"),
        e("member_lost", 5.5, group_rank=1, node="node1_200_0", reason="node1 stopped heartbeating"),
        e("round_formed", 6.0, round=1, group_rank=0, group_world_size=1, restart_count=1),
        e("workers_started", 6.1, round=1, global_ranks=[0, 1], pids=[1002, 1003]),
        e("gpu_temperature", 7.0, celsius=91, sensor={"id": 3}),
        e("workers_stopped", 9.0, round=1, why="succeeded"),
        e("job_finished", 9.1, state="SUCCEEDED", exit_code=0, root_cause=None),
    ]  # fmt: skip


def node1():
    return [
        event("round_formed", 0.0, "node1", 200, round=0, group_rank=1, group_world_size=2, restart_count=0),
        event("workers_started", 0.1, "node1", 200, round=0, global_ranks=[2, 3], pids=[2000, 2001]),
        event("membership_changed", 5.03, "node1", 200, reason="another node restarted (round 1)"),
        event("workers_stopped", 5.04, "node1", 200, round=0, why="changed"),
    ]


@pytest.fixture
def logs(tmp_path):
    """Two nodes' logs; node1's agent was killed while writing its last line."""
    a, b = tmp_path / "node0.jsonl", tmp_path / "node1.jsonl"
    a.write_text("\n".join(node0()) + "\n")
    b.write_text("\n".join(node1()) + '\n{"event":"restart","time":"2026-11-26T18:0')
    return str(a), str(b)


def model(*paths):
    events, warnings = timeline.read_events(paths)
    return timeline.build(events), warnings


def test_two_nodes_with_a_hang_a_restart_and_a_lost_member(logs):
    runs, warnings = model(*logs)
    assert warnings == [f"{logs[1]}:5: skipped an unfinished last line (its agent stopped while writing it?)"]
    [run] = runs
    assert (run["run_id"], run["nodes"], run["restarts"], run["failures"], run["hangs"]) == ("job7", 2, 1, 1, 1)
    assert run["outcome"] == "SUCCEEDED; 1 node(s) logged no job_finished"
    first, second = run["lanes"]
    assert first["label"] == ["node0", "group rank 0 · ranks 0-1", "agent pid 100 · run job7"]
    # node0 reported node1 lost: its lane says so
    assert second["label"] == ["node1", "group rank 1 · ranks 2-3", "agent pid 200 · run job7 · lost"]
    kinds = [mark["kind"] for mark in first["marks"]]
    assert kinds == ["round", "hang", "failure", "restart", "lost", "round", "other", "end"]
    assert [mark["kind"] for mark in second["marks"]] == ["round", "membership"]
    rounds = [mark for lane in run["lanes"] for mark in lane["marks"] if mark["kind"] == "round"]
    assert [(m["label"], m["why"], m["end"] - m["at"]) for m in rounds] == [
        ("round 0", "failed", pytest.approx(4910)), ("round 1", "succeeded", pytest.approx(2900)),
        ("round 0", "changed", pytest.approx(4940)),
    ]  # fmt: skip
    # the root cause: the hang its agent marked, not the rank killed with it; the page rings it
    hang, killed = first["marks"][1], first["marks"][2]
    assert run["root_cause"]["headline"] == f"rank 1 (host node0) was hung ({HUNG})"
    assert run["root_cause"]["text"].startswith("stacks when it was found hung:")
    assert hang.get("run_root") and not killed.get("run_root")
    assert killed["title"] == "rank 0 failed: exit code -9 (SIGKILL)"
    assert ["hung", HUNG] in hang["details"] and ["source", f"{logs[0]}:3"] in hang["details"]
    lost, other = first["marks"][4], first["marks"][6]
    assert lost["title"] == "group rank 1 lost: node1 stopped heartbeating"
    # an unknown event is shown with its fields as they are
    assert other["title"] == "gpu temperature"
    assert ["celsius", "91"] in other["details"] and ["sensor", '{"id": 3}'] in other["details"]


def test_a_failed_job_names_the_root_cause_of_its_last_round(tmp_path):
    def failed(seconds, rank, root):
        return event("worker_failed", seconds, "n", 1, global_rank=rank, local_rank=rank, exitcode=1,
                     signal=None, hung=None, root_cause=root, message=f"Traceback\nValueError: rank {rank} broke",
                     headline=f"rank {rank} (host n) exited with 1: ValueError: rank {rank} broke")  # fmt: skip

    lines = [
        event("workers_started", 0, "n", 1, round=0, global_ranks=[0, 1], pids=[5, 6]), failed(1, 0, True),
        event("workers_stopped", 1.1, "n", 1, round=0, why="failed"),
        event("workers_started", 2, "n", 1, round=1, global_ranks=[0, 1], pids=[7, 8]),
        failed(3, 0, False), failed(3.5, 1, True),  # rank 1 is the root cause, though rank 0 failed first
        event("job_finished", 4, "n", 1, state="FAILED", exit_code=1, root_cause="rank 1 (host n) failed"),
    ]  # fmt: skip
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    [run], _ = model(str(path))
    assert run["outcome"] == "FAILED"
    assert run["root_cause"]["headline"] == "rank 1 (host n) exited with 1: ValueError: rank 1 broke"
    # without failure events (the failing node's log missing), the agents' own line
    path.write_text(lines[-1] + "\n")
    [run], _ = model(str(path))
    assert run["root_cause"] == {"headline": "rank 1 (host n) failed", "text": None, "at": None, "consequences": 0}


LOST = "node node2_300_0 (group rank 2) stopped responding"


@pytest.fixture
def node_loss(tmp_path):
    """Three nodes train; node2's host dies. Its log ends with its round running; the two
    survivors' workers fail in all_reduce (PeerError), which their agents judge the loss's
    consequence, and they re-form without charging a restart."""
    lost = LOST

    def survivor(host, pid, rank):
        def e(name, seconds, **fields):
            return event(name, seconds, host, pid, **fields)

        broken = f"rank {rank} (host {host}) exited with 1: PeerError: rank 2 closed its connection"
        return [
            e("round_formed", 0.0, round=0, group_rank=rank, group_world_size=3, restart_count=0),
            e("workers_started", 0.1, round=0, global_ranks=[rank], pids=[pid * 10]),
            e("worker_failed", 5.0, global_rank=rank, local_rank=0, worker_pid=pid * 10, exitcode=1, signal=None,
              hung=None, root_cause=False, headline=broken, message="PeerError: rank 2 closed its connection",
              consequence_of=lost),
            e("member_lost", 5.0, group_rank=2, node="node2_300_0", reason=lost),
            e("workers_stopped", 5.0, round=0, why="changed"),
            e("restart", 5.0, restart_count=0, max_restarts=3, reason=lost, charged=False),
            e("round_formed", 5.1, round=1, group_rank=rank, group_world_size=2, restart_count=0),
            e("workers_started", 5.2, round=1, global_ranks=[rank], pids=[pid * 10 + 1]),
            e("workers_stopped", 9.0, round=1, why="succeeded"),
            e("job_finished", 9.1, state="SUCCEEDED", exit_code=0, root_cause=None),
        ]  # fmt: skip

    gone = [
        event("round_formed", 0.0, "node2", 300, round=0, group_rank=2, group_world_size=3, restart_count=0),
        event("workers_started", 0.1, "node2", 300, round=0, global_ranks=[2], pids=[3000]),
    ]
    paths = []
    for name, lines in [("a", survivor("node0", 100, 0)), ("b", survivor("node1", 200, 1)), ("c", gone)]:
        paths.append(tmp_path / f"{name}.jsonl")
        paths[-1].write_text("\n".join(lines) + "\n")
    return [str(path) for path in paths]


def test_a_lost_node_is_the_root_cause_of_the_collectives_it_broke(node_loss):
    lost = LOST
    [run], _ = model(*node_loss)
    # one root cause: the lost node; the survivors' broken collectives follow from it, folded
    assert run["root_cause"]["headline"] == f"group rank 2 lost: {lost}"
    assert run["root_cause"]["consequences"] == 2
    assert "rank 0 (host node0) exited with 1: PeerError" in run["root_cause"]["text"]
    assert "rank 1 (host node1) exited with 1: PeerError" in run["root_cause"]["text"]
    marks = [mark for lane in run["lanes"] for mark in lane["marks"]]
    assert [m.get("run_root", False) for m in marks if m["kind"] == "failure"] == [False, False]
    assert all(m["consequence_of"] == lost for m in marks if m["kind"] == "failure")
    # the lost node's round ends where its loss was reported, not at the end of the chart
    victim = run["lanes"][2]
    assert victim["label"][-1].endswith("· lost")
    [bar] = [m for m in victim["marks"] if m["kind"] == "round"]
    assert (bar["why"], bar["end"] - bar["at"]) == ("lost", pytest.approx(4900))
    # no restart charged: the count stays 0 and the re-form is named as one, counted once
    assert (run["restarts"], run["reforms"]) == (0, 1)
    restarts = [m for m in marks if m["kind"] == "restart"]
    assert [m["title"] for m in restarts] == [f"re-formed, no restart charged: {lost}"] * 2


def test_several_runs_in_one_log_and_the_same_log_twice(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(node0("later", at=3600) + node0("job7")) + "\n")
    runs, warnings = model(str(path), str(path))
    assert warnings == []
    assert [(run["run_id"], run["nodes"], len(run["lanes"][0]["marks"])) for run in runs] == [
        ("job7", 1, 8), ("later", 1, 8),
    ]  # fmt: skip


def test_the_preflight_check_and_a_node_left_out_are_marked(tmp_path):
    path = tmp_path / "events.jsonl"
    named = [{"member": 1, "node": "10.0.0.2", "why": "slow on every link"}]
    path.write_text("\n".join([
        event("round_formed", 0.0, "n", 1, round=0, group_rank=1, group_world_size=3, restart_count=0),
        event("preflight", 1.0, "n", 1, round=0, nodes=named, links=[], decision="leave out"),
        event("left_out", 1.1, "n", 1, round=0, why="the pre-flight check named it: slow on every link"),
        event("preflight", 2.0, "m", 2, round=0, nodes=[], links=[], decision="go on"),
    ]) + "\n")  # fmt: skip
    [run], _ = model(str(path))
    titles = [mark["title"] for lane in run["lanes"] for mark in lane["marks"] if mark["kind"] == "straggler"]
    assert titles == [
        "pre-flight check: named 10.0.0.2 (slow on every link): leave out",
        "this node left the job: the pre-flight check named it: slow on every link",
        "pre-flight check: every node fine",
    ], titles


def test_odd_lines_are_skipped_with_a_warning_and_odd_fields_shown_as_they_are(tmp_path):
    path = tmp_path / "events.jsonl"
    lines = [
        "[1, 2]", '{"event": "earlier"}', '{"event": "x", "time": "yesterday"}',
        event("workers_started", 0, "n", 1, round="r", global_ranks="0,1", pids=None),
        event("worker_failed", 1, "n", 1, global_rank=[0], exitcode="one", message=7),
        event("job_finished", 2, "n", 1, state=None),
    ]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    [run], warnings = model(str(path))
    assert warnings == [f"{path}:{n}: skipped: not an event with a name and a time" for n in (1, 2, 3)]
    [bar, failure, end] = run["lanes"][0]["marks"]
    assert (bar["label"], bar["why"], failure["round"]) == ("round r", "not logged", None)
    assert failure["headline"] == "rank [0] failed: exit code one"  # no headline logged: the mark's title
    assert (end["state"], run["outcome"]) == ("?", "?")


def test_the_page_holds_the_model_and_no_text_can_end_its_script(tmp_path):
    hostile = "</script><script>alert(1)</script><!--"
    path = tmp_path / "events.jsonl"
    path.write_text(event("worker_failed", 1, "n", 1, global_rank=0, message=hostile) + "\n")
    out = tmp_path / "page.html"
    assert timeline.write_page([str(path)], str(out)) == []
    page = out.read_text()
    template = (resources.files("elastix.ops") / "timeline.html").read_text()
    assert page.count("</script>") == template.count("</script>")
    data = re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1)
    assert "<" not in data and "http" not in page.replace("http://www.w3.org/2000/svg", "")  # nothing fetched
    [run] = json.loads(data)["runs"]
    assert ["message", hostile] in run["lanes"][0]["marks"][0]["details"]


def timeline_cli(*args, cwd=None):
    command = [sys.executable, "-m", "elastix", "timeline", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=cwd)


def test_the_command_writes_the_page_next_to_the_first_log_and_warns_about_skipped_lines(logs):
    done = timeline_cli(*logs)
    expected = os.path.splitext(logs[0])[0] + ".html"
    assert (done.returncode, done.stdout) == (0, expected + "\n"), done.stderr
    assert "node1.jsonl:5: skipped an unfinished last line" in done.stderr and "warning" in done.stderr
    assert os.path.getsize(expected) > 0


@pytest.mark.parametrize(
    "content, error",
    [
        (None, "{path}: no such file"),
        ("", "no events in {path} (written by `elastix run --event-log FILE`)"),
        ('{"event":"x","time":"2026-11-26T18:00:00.000Z"}\nnot json\n{}\n', "{path}:2: not a JSON event: 'not json'"),
    ],
    ids=["missing", "empty", "garbage"],
)
def test_bad_input_is_a_clear_error_with_exit_status_2(tmp_path, content, error):
    path = tmp_path / "events.jsonl"
    if content is not None:
        path.write_text(content)
    done = timeline_cli(path, "-o", tmp_path / "out.html")
    assert done.returncode == 2, done
    assert done.stderr == f"elastix timeline: error: {error.format(path=path)}\n"
    assert not (tmp_path / "out.html").exists()


# -- a real job, and its page in a real browser ----------------------------------------------------

FAIL_ONCE = """\
import os
if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    raise RuntimeError("loss exploded at step 3")
"""


@pytest.fixture(scope="module")
def real_job(tmp_path_factory):
    """Two agents (127.0.0.1, 127.0.0.2) of one c10d job, each with its own event log; rank 1
    raises on the first attempt, the job restarts once and succeeds. Its logs and the page."""
    tmp = tmp_path_factory.mktemp("job")
    marker = uuid.uuid4().hex
    store = elastix.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    script = tmp / "fail_once.py"
    script.write_text(FAIL_ONCE)
    logs = [tmp / "a.jsonl", tmp / "b.jsonl"]
    try:
        endpoint = f"127.0.0.1:{store.port}"
        procs = []
        for log, addr in zip(logs, ("127.0.0.1", "127.0.0.2")):
            node = node_args(2, endpoint, addr, FAST_RDZV, script, run_id="tl-job", max_restarts=1)
            procs.append(elastix_run("--event-log", log, *node, out_dir=tmp, marker=marker))
        for code, _out, err in finish_each(procs, timeout=60):
            assert code == 0, err
        assert_nothing_left(marker)
    finally:
        for pid in marked_processes(marker):
            os.kill(pid, 9)
    done = timeline_cli(*logs, "-o", tmp / "run.html")
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, str(tmp / "run.html"), ""), done
    return logs, tmp / "run.html"


@pytest.mark.timeout(120)
def test_a_real_job_that_failed_once_is_drawn_with_its_root_cause(real_job):
    _logs, page = real_job
    data = re.search(r'<script id="data" type="application/json">(.*?)</script>', page.read_text(), re.S).group(1)
    [run] = json.loads(data)["runs"]
    assert (run["run_id"], run["outcome"], run["restarts"], run["failures"]) == ("tl-job", "SUCCEEDED", 1, 1)
    assert sorted(lane["host"] for lane in run["lanes"]) == ["127.0.0.1", "127.0.0.2"]
    for lane in run["lanes"]:
        assert [m["round"] for m in lane["marks"] if m["kind"] == "round"] == [0, 1], lane
    cause = run["root_cause"]
    assert cause["headline"].startswith("rank 1 (host 127.0.0.") and "exited with 1" in cause["headline"]
    assert cause["headline"].endswith(": RuntimeError: loss exploded at step 3") and "Traceback" in cause["text"]


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser():
    from requirements import need

    if not os.access(CHROMIUM, os.X_OK):
        need("chromium", "needs Debian's chromium: apt-get install chromium (.ci/run installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        need(
            "chromium",
            "needs playwright: pip install -e '.[test]' (the system chromium is used; nothing is downloaded)",
        )
    need("chromium", None)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


def open_page(browser, path):
    """The page, and the errors its console and scripts report as they come."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(10_000)
    errors = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"file://{path}")
    return page, errors


@pytest.mark.timeout(120)
def test_the_page_of_a_real_job_in_a_browser(real_job, browser):
    _logs, path = real_job
    page, errors = open_page(browser, path)
    lanes = page.locator(".lane")
    assert lanes.count() == 2
    labels = sorted(lanes.all_text_contents())
    assert "127.0.0.1" in "".join(labels) and "127.0.0.2" in "".join(labels)
    assert "group rank 0" in labels[0] + labels[1] and "group rank 1" in labels[0] + labels[1]
    rounds = page.locator(".mark-round")
    assert sorted(rounds.nth(i).get_attribute("data-round") for i in range(rounds.count())) == ["0", "0", "1", "1"]
    failure = page.locator('.mark-failure[data-rank="1"]')
    assert failure.count() == 1 and page.locator(".mark-failure.root").count() == 1
    tooltip = page.locator("#tooltip")
    assert tooltip.is_hidden()
    failure.hover()
    tooltip.wait_for(state="visible")
    shown = tooltip.inner_text()
    assert "rank 1 failed: exit code 1" in shown and "RuntimeError: loss exploded at step 3" in shown, shown
    failure.click()
    detail = page.locator(".detail").inner_text()
    assert "rank 1 failed" in detail and "loss exploded at step 3" in detail, detail
    summary = page.locator(".summary").inner_text()
    assert "SUCCEEDED" in summary and "tl-job" in summary, summary
    assert "rank 1 (host 127.0.0." in summary and "RuntimeError: loss exploded at step 3" in summary, summary
    assert errors == []


@pytest.mark.timeout(60)
def test_every_kind_of_mark_is_drawn_and_shows_its_details(logs, browser, tmp_path):
    out = tmp_path / "page.html"
    timeline.write_page(list(logs), str(out))
    page, errors = open_page(browser, out)
    for kind in ("round", "hang", "failure", "restart", "lost", "membership", "end", "other"):
        assert page.locator(f".mark-{kind}").count() >= 1, kind
    page.locator(".mark-hang").hover()
    assert "ranks 0 wait in all_reduce #5 (group 0) for rank 1" in page.locator("#tooltip").inner_text()
    assert "node1.jsonl:5: skipped an unfinished last line" in page.locator(".warnings").inner_text()
    assert "SUCCEEDED; 1 node(s) logged no job_finished" in page.locator(".summary").inner_text()
    # zoom in by dragging across the chart, out by double-clicking it
    box = page.locator(".chart").bounding_box()
    first_tick = page.locator(".axis text").first.text_content()
    page.mouse.move(box["x"] + 300, box["y"] + 60)
    page.mouse.down()
    page.mouse.move(box["x"] + 400, box["y"] + 60)
    page.mouse.up()
    assert page.locator(".axis text").first.text_content() != first_tick
    page.locator(".chart").dblclick(position={"x": 300, "y": 20})
    assert page.locator(".axis text").first.text_content() == first_tick
    assert errors == []


@pytest.mark.timeout(60)
def test_a_node_loss_on_the_page_is_one_root_cause_with_its_consequences_folded(node_loss, browser, tmp_path):
    out = tmp_path / "page.html"
    timeline.write_page(node_loss, str(out))
    page, errors = open_page(browser, out)
    summary = page.locator(".summary")
    assert "restarts\n0 charged, 1 re-form without a charge" in summary.inner_text(), summary.inner_text()
    assert f"group rank 2 lost: {LOST}" in summary.inner_text()
    folded = page.locator(".summary details.consequences")
    assert folded.count() == 1 and folded.get_attribute("open") is None
    assert "2 worker failure(s) followed from it" in folded.inner_text()
    assert page.locator(".mark-lost.root").count() >= 1
    assert page.locator(".mark-failure.consequence").count() == 2 and page.locator(".mark-failure.root").count() == 0
    assert errors == []
