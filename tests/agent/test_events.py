"""The agent's event log: every state change of a run as one JSON line, in order, in
`--event-log FILE` and (with `--event-log-handler jsonl`) on stderr."""

import json

from agents import assert_nothing_left, elastix_run, finish

FAIL_ONCE = "import os, sys\nsys.exit(1 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 0)\n"


def test_a_run_with_one_failure_and_one_restart_logs_its_events_in_order(tmp_path, marker):
    script = tmp_path / "fail_once.py"
    script.write_text(FAIL_ONCE)
    log = tmp_path / "events.jsonl"
    proc = elastix_run(
        "--standalone", "--max-restarts", 1, "--event-log", log, "--event-log-handler", "jsonl", script,
        out_dir=tmp_path, marker=marker,
    )  # fmt: skip
    code, _out, err = finish(proc)
    assert code == 0, err
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["event"] for e in events] == [
        "round_formed", "workers_started", "worker_failed", "workers_stopped", "failure_reported", "restart",
        "round_formed", "workers_started", "workers_stopped", "job_finished",
    ]  # fmt: skip
    failed, stopped, charged, restart, finished = events[2], events[3], events[4], events[5], events[9]
    assert (stopped["round"], stopped["why"], events[8]["why"]) == (0, "failed", "succeeded")
    assert events[1]["round"] == 0 and events[7]["round"] == 1
    # the charge is an event of its own, written before the restart (or the end) it leads to
    assert (charged["restart_count"], charged["max_restarts"]) == (1, 1)
    # a round is told apart by its workers' store as well as its number
    assert events[0]["master"].startswith("127.0.0.1:") and events[6]["master"].startswith("127.0.0.1:")
    assert (failed["global_rank"], failed["exitcode"], failed["hung"]) == (0, 1, None)
    assert failed["headline"].startswith("rank 0 (host ") and ") exited with 1" in failed["headline"]
    assert (restart["restart_count"], restart["max_restarts"], restart["reason"]) == (1, 1, "worker failure")
    assert (finished["state"], finished["exit_code"]) == ("SUCCEEDED", 0)
    assert events[6]["restart_count"] == 1
    assert all(e["run_id"] == events[0]["run_id"] and e["pid"] == proc.pid for e in events)
    # jsonl: the same events on stderr, as they happen
    on_stderr = [json.loads(line) for line in err.splitlines() if line.startswith('{"event"')]
    assert on_stderr == events
    assert_nothing_left(marker)


def test_events_are_appended_to_an_existing_log(tmp_path, marker):
    script = tmp_path / "ok.py"
    script.write_text("")
    log = tmp_path / "events.jsonl"
    log.write_text('{"event": "earlier"}\n')
    code, _out, err = finish(elastix_run("--standalone", "--event-log", log, script, out_dir=tmp_path, marker=marker))
    assert code == 0, err
    names = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    assert names == ["earlier", "round_formed", "workers_started", "workers_stopped", "job_finished"]
    assert '{"event"' not in err  # no jsonl handler: nothing on stderr


def test_an_unwritable_event_log_is_a_usage_error(tmp_path, marker):
    script = tmp_path / "ok.py"
    script.write_text("")
    missing = tmp_path / "no" / "such" / "dir" / "events.jsonl"
    code, _out, err = finish(
        elastix_run("--standalone", "--event-log", missing, script, out_dir=tmp_path, marker=marker)
    )
    assert code == 2 and f"--event-log {missing}: no directory" in err and "Traceback" not in err, err
