"""Each invariant of the fault matrix (tests/faults/invariants.py) fed event logs it must accept
and doctored ones it must reject: a checker that cannot fire proves nothing."""

from __future__ import annotations

from datetime import datetime, timezone

from invariants import charged_beyond, judge, rounds_at_once, training_spans, unnamed_faults

T0 = 1_800_000_000.0  # the fault, in seconds since the epoch


def e(name, t, **fields):
    """An event `t` seconds after the fault."""
    time = datetime.fromtimestamp(T0 + t, timezone.utc).isoformat().replace("+00:00", "Z")
    return {"event": name, "time": time, "run_id": "matrix", "host": "h", "pid": 1, **fields}


def member(round_, master, size, start, stop=None, restart_count=0):
    """A node's events for one round: formed, workers started, and stopped (if it did)."""
    events = [
        e("round_formed", start - 0.1, round=round_, group_rank=0, group_world_size=size, master=master,
          restart_count=restart_count),
        e("workers_started", start, round=round_, global_ranks=[0], pids=[7]),
    ]  # fmt: skip
    if stop is not None:
        events.append(e("workers_stopped", stop, round=round_, why="changed"))
    return events


def healthy_node_loss():
    """Three nodes train in round 4 (h0 serves its workers' store); h2 dies at t=0; h0 and h1 stop
    at t=0.3 and train again in round 5, served by h0 again (on a new port)."""
    return {
        "h0": member(4, "10.0.0.1:4000", 3, -30, 0.3) + member(5, "10.0.0.1:4001", 2, 1.2),
        "h1": member(4, "10.0.0.1:4000", 3, -30, 0.3) + member(5, "10.0.0.1:4001", 2, 1.3),
        "h2": member(4, "10.0.0.1:4000", 3, -30),
    }


def test_a_healthy_node_loss_trains_one_round_at_a_time():
    logs = healthy_node_loss()
    spans = {span.round[0]: (round(span.start - T0, 2), span.end - T0) for span in training_spans(logs, {"h2": T0})}
    assert spans == {4: (-30, 0), 5: (1.3, float("inf"))}
    assert rounds_at_once(logs, T0, {"h2": T0}) == []


def test_two_sides_each_training_a_round_5_are_caught():
    # a partition: h0 alone forms "round 5" with a workers' store of its own, while h1 and h2
    # form theirs; the round numbers agree, the rounds do not
    logs = {
        "h0": member(4, "10.0.0.1:4000", 3, -30, 0.2) + member(5, "10.0.0.1:4001", 1, 1.0),
        "h1": member(4, "10.0.0.1:4000", 3, -30, 0.2) + member(5, "10.0.0.2:4000", 2, 1.1),
        "h2": member(4, "10.0.0.1:4000", 3, -30, 0.2) + member(5, "10.0.0.2:4000", 2, 1.2),
    }
    problems = rounds_at_once(logs, T0)
    assert (
        len(problems) == 1
        and "rounds 5 (workers' store 10.0.0.1:4001) and 5 (workers' store 10.0.0.2:4000)" in problems[0]
    )
    # keyed by number alone, the same logs would pass: the key is what catches it
    same_store = {host: [dict(ev, master="10.0.0.1:4001") if ev.get("round") == 5 else ev for ev in events]
                  for host, events in logs.items()}  # fmt: skip
    assert rounds_at_once(same_store, T0) == []


def test_a_minority_that_trains_on_with_an_old_round_is_caught_only_if_all_its_members_do():
    # h0 cut off keeps round 4's workers until t=6 while h1 and h2 train round 5 from t=1: round 4
    # lost its other members at t=0.2, so it did not train meanwhile (its steps are all_reduces)
    logs = {
        "h0": member(4, "10.0.0.1:4000", 3, -30, 6.0),
        "h1": member(4, "10.0.0.1:4000", 3, -30, 0.2) + member(5, "10.0.0.2:4000", 2, 1.0),
        "h2": member(4, "10.0.0.1:4000", 3, -30, 0.2) + member(5, "10.0.0.2:4000", 2, 1.0),
    }
    assert rounds_at_once(logs, T0) == []
    # doctored: round 4's members all trained on until t=6 while round 5 trained from t=1
    doctored = {
        "h0": member(4, "10.0.0.1:4000", 2, -30, 6.0),
        "h1": member(4, "10.0.0.1:4000", 2, -30, 6.0),
        "h2": member(5, "10.0.0.3:4000", 1, 1.0),
    }
    assert rounds_at_once(doctored, T0), doctored


def test_only_what_happens_after_the_settling_time_counts():
    logs = {
        "h0": member(4, "10.0.0.1:4000", 1, -30, 1.5),
        "h1": member(5, "10.0.0.2:4000", 1, 1.0),
    }
    assert rounds_at_once(logs, T0) != []
    assert rounds_at_once(logs, T0 + 2.0) == [], "round 4 ended before the settling time"


def test_a_restart_charged_for_a_node_loss_is_caught_even_when_the_job_then_fails():
    logs = healthy_node_loss()
    assert charged_beyond(logs, "host-kill", 0) == []
    # the survivors counted the loss as their workers' own failure: the job failed at once,
    # with no restart event, but the charge is its own event
    logs["h0"] = [*logs["h0"][:3], e("failure_reported", 0.4, restart_count=1, max_restarts=0)]
    assert charged_beyond(logs, "host-kill", 0) == ["1 restart(s) charged for host-kill (allowed: 0)"]
    assert charged_beyond(logs, "worker-kill", 1) == [], "a killed worker is the workers' own failure"


def test_an_error_that_does_not_name_the_fault_is_caught():
    exits = {"h0": 1, "h1": 0}
    assert unnamed_faults(exits, {"h0": "round 5: node h2 lost: no heartbeat for 2s"}, "host-kill") == []
    vague = unnamed_faults(exits, {"h0": "agent failed: error: something went wrong"}, "host-kill")
    assert len(vague) == 1 and "h0 exited 1 without naming the fault (host-kill)" in vague[0]
    # the job's own root cause comes first, the last line only without one
    logs = {"h0": [e("job_finished", 3, state="FAILED", exit_code=1, root_cause="node h2 lost")], "h1": []}
    assert judge(logs, "host-kill", T0, 0, exits, {"h0": "error", "h1": ""}) == []
    logs["h0"][0]["root_cause"] = "rank 1 exited with 1"
    assert judge(logs, "host-kill", T0, 0, exits, {"h0": "node h2 lost", "h1": ""}) != []
