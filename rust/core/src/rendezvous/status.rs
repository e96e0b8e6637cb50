//! `elastix status`: a job's state as the rendezvous store holds it, read from any machine
//! that can reach the store, and a verdict on its health.
//!
//! * here: the query, the report and the verdict (pure);
//! * each backend's reading of its store (`c10d::status`, `etcd::status`): read-only, no key
//!   is created or changed, whatever the job's state; [`super::job_status`] asks the right one.
//!
//! The report is JSON with a format version `v`; fields are only ever added. Ages are
//! computed against this machine's clock: a skewed clock shifts them (never below zero).

use std::time::Duration;

use serde::Serialize;

use super::node::NodeDesc;
use super::records::{now_ms, seconds_between, Doing, FailureRecord, NodeStatus, RankPace, Restored, WorkerProgress};
use crate::rendezvous::config::conf::ConfInput;

/// What `elastix status` asks for.
#[derive(Clone, Debug)]
pub struct StatusQuery {
    pub backend: String,
    pub endpoint: String,
    pub run_id: String,
    /// `--rdzv-conf`: only `auth_token_file` matters here, but every key `elastix run`
    /// takes is accepted, so the same flags work for both.
    pub conf: ConfInput,
    /// Bound on reaching the store and on each request.
    pub timeout: Duration,
}

/// Format version of the JSON report.
pub const STATUS_VERSION: u32 = 1;
/// Events read back from the end of the run's event log, to find lost nodes.
pub const EVENTS_SCANNED: i64 = 64;

/// How the job is doing, for humans and for the exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Running as formed (every member beating), or finished successfully.
    Healthy,
    /// Running below what it had, a member silent or lost, or a round still forming.
    Degraded,
    /// Closed after a failure.
    Failed,
}

/// What the job is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// The current round is sealed and its workers run.
    Running,
    /// The current round has not formed yet (nodes are arriving, or it was aborted).
    Forming,
    Succeeded,
    Failed,
    /// Closed for another reason (an explicit close).
    Closed,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobStatus {
    pub v: u32,
    pub run_id: String,
    pub backend: &'static str,
    /// The store site holding the state (`host:port`; etcd: the cluster's endpoints).
    pub endpoint: String,
    /// The store the running round's agents share (`host:port`), where requests such as
    /// `elastix dump` go: c10d's store, or on etcd rank 0's workers' store.
    pub round_store: Option<String>,
    pub health: Health,
    pub state: State,
    /// Why the job is not healthy, one line each.
    pub problems: Vec<String>,
    pub min_nodes: u32,
    pub max_nodes: u32,
    pub round: u64,
    /// Members of the current round, by group rank (empty while it forms).
    pub members: Vec<Member>,
    /// Nodes that arrived in the current round so far (while it forms).
    pub arrived: Vec<String>,
    /// Late nodes waiting for the job to re-form with them, and spares of a full round.
    pub waiting: u64,
    pub spares: u64,
    pub restarts: Restarts,
    pub last_failure: Option<LastFailure>,
    /// Nodes reported lost (recent events), newest last.
    pub lost: Vec<Lost>,
    /// How the job ended ("succeeded", "failed: <root cause>", ...), once closed.
    pub closed_reason: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Member {
    pub group_rank: u32,
    /// `addr_pid_localid`, torch's form.
    pub node: String,
    pub addr: String,
    pub pid: u32,
    /// What the member's agent published once its workers ran (absent until then).
    pub host: Option<String>,
    pub role: Option<String>,
    pub local_world_size: Option<u32>,
    /// Global ranks of its workers.
    pub ranks: Vec<u32>,
    pub metrics_port: Option<u16>,
    /// Seconds since its last heartbeat reached the store (`None`: a one-node round sends
    /// none, or none arrived yet).
    pub heartbeat_age_s: Option<f64>,
    /// Silence after which the others count it lost, in seconds.
    pub lost_after_s: Option<f64>,
    /// How long its workers of this attempt have run, in seconds (the agent's clock against
    /// this machine's).
    pub uptime_s: Option<f64>,
    /// Its workers' progress, as its agent last published it.
    pub workers: Vec<WorkerStatus>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerStatus {
    pub rank: u32,
    pub beats: u64,
    pub step: Option<u64>,
    /// Seconds since it was last seen making progress (a heartbeat or a run of its main
    /// thread; the agent's clock against this machine's); `None`: never.
    pub seen_age_s: Option<f64>,
    /// What its main thread and processes were doing (`None`: not watched).
    pub doing: Option<Doing>,
    /// Its newest checkpoint held by its agent (`elastix.checkpoint`), if any.
    pub checkpoint: Option<CheckpointStatus>,
    /// Its pace against the others' (workers that use elastix collectives, once judged).
    pub pace: Option<RankPace>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CheckpointStatus {
    pub step: u64,
    pub bytes: u64,
    /// Seconds since it was saved.
    pub saved_age_s: f64,
    /// The newest step on disk, and how long ago it got there (`None`: none yet).
    pub persisted_step: Option<u64>,
    pub persisted_age_s: Option<f64>,
    /// How long the save and the persisting took, in ms.
    pub save_ms: Option<u64>,
    pub persist_ms: Option<u64>,
    /// The newest step a peer holds a copy of.
    pub copied_step: Option<u64>,
    /// The step the worker restored last, and from where.
    pub restored: Option<Restored>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Restarts {
    pub used: i64,
    /// The budget (`--max-restarts`), as the members published it.
    pub allowed: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LastFailure {
    pub round: u64,
    pub host: String,
    pub rank: u32,
    pub local_rank: u32,
    pub exitcode: i32,
    pub signal: Option<String>,
    /// Why it was found hung, for a hung worker.
    pub hung: Option<String>,
    pub message: String,
    /// Seconds since it happened.
    pub age_s: f64,
}

impl Member {
    /// Group rank `rank`'s member, from its node (if known) and what its agent published.
    pub(crate) fn new(
        group_rank: u32,
        node: Option<&NodeDesc>,
        status: Option<&NodeStatus>,
        heartbeat_age_s: Option<f64>,
    ) -> Member {
        let facts = status.map(|status| &status.facts);
        Member {
            group_rank,
            node: node.map_or_else(|| "unknown".to_owned(), ToString::to_string),
            addr: node.map_or_else(String::new, |node| node.addr.clone()),
            pid: node.map_or(0, |node| node.pid),
            host: facts.map(|facts| facts.host.clone()),
            role: facts.map(|facts| facts.role.clone()),
            local_world_size: facts.map(|facts| facts.local_world_size),
            ranks: facts
                .map_or_else(Vec::new, |facts| (facts.first_rank..facts.first_rank + facts.local_world_size).collect()),
            metrics_port: facts.and_then(|facts| facts.metrics_port),
            heartbeat_age_s,
            lost_after_s: status.map(|status| status.lost_after_ms as f64 / 1000.0),
            uptime_s: facts
                .map(|facts| facts.workers_started_ms)
                .filter(|started| *started != 0)
                .map(|started| seconds_between(started, now_ms())),
            workers: facts.map_or_else(Vec::new, |facts| facts.workers.iter().map(WorkerStatus::from).collect()),
        }
    }
}

impl From<&WorkerProgress> for WorkerStatus {
    fn from(progress: &WorkerProgress) -> WorkerStatus {
        WorkerStatus {
            rank: progress.rank,
            beats: progress.beats,
            step: progress.step,
            seen_age_s: progress.seen_ms.map(|seen| seconds_between(seen, now_ms())),
            doing: progress.doing,
            checkpoint: progress.checkpoint.as_ref().map(|held| CheckpointStatus {
                step: held.step,
                bytes: held.bytes,
                saved_age_s: seconds_between(held.saved_ms, now_ms()),
                persisted_step: held.persisted_step,
                persisted_age_s: held.persisted_ms.map(|at| seconds_between(at, now_ms())),
                save_ms: held.save_ms,
                persist_ms: held.persist_ms,
                copied_step: held.copied_step,
                restored: held.restored.clone(),
            }),
            pace: progress.pace.clone(),
        }
    }
}

impl LastFailure {
    /// The failure an agent published, as read at `now_ms`.
    pub(crate) fn from_record(failure: FailureRecord, now_ms: u64) -> LastFailure {
        LastFailure {
            round: failure.round,
            host: failure.host,
            rank: failure.rank,
            local_rank: failure.local_rank,
            exitcode: failure.exitcode,
            signal: failure.signal,
            hung: failure.hung,
            message: failure.message,
            age_s: seconds_between(failure.at_ms, now_ms),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Lost {
    pub round: u64,
    pub group_rank: u32,
    pub node: Option<String>,
}

/// What the verdict is made from, besides the report's own fields.
pub(crate) struct Evidence {
    /// Whether the current round is sealed (and not aborted).
    pub formed: bool,
    /// The world size of the round in which the last loss happened.
    pub size_before_loss: Option<u32>,
}

/// The verdict: health, state and the problems that explain it.
pub(crate) fn judge(status: &mut JobStatus, evidence: &Evidence) {
    let mut problems = Vec::new();
    let state = match status.closed_reason.as_deref() {
        Some("succeeded") => State::Succeeded,
        Some(reason) if reason.starts_with("failed") => State::Failed,
        Some(_) => State::Closed,
        None if evidence.formed => State::Running,
        None => State::Forming,
    };
    if state == State::Forming {
        problems.push(format!(
            "round {} is forming: {} node(s) arrived, it needs {}..{}",
            status.round,
            status.arrived.len(),
            status.min_nodes,
            status.max_nodes
        ));
    }
    if state == State::Running {
        for member in &status.members {
            if let (Some(age), Some(limit)) = (member.heartbeat_age_s, member.lost_after_s) {
                if age > limit {
                    problems.push(format!(
                        "node {} (group rank {}) has sent no heartbeat for {age:.1}s (lost after {limit:.1}s)",
                        member.node, member.group_rank
                    ));
                }
            }
        }
        for member in &status.members {
            for worker in member.workers.iter().filter(|w| w.pace.as_ref().is_some_and(|pace| pace.straggler)) {
                let pace = worker.pace.as_ref().expect("filtered");
                problems.push(format!(
                    "rank {} on node {} is a straggler: it computes {:.1}x as long as the others between collectives \
                     ({:.0} ms against {:.0} ms)",
                    worker.rank,
                    member.node,
                    pace.compute_ms / pace.others_ms.max(f64::MIN_POSITIVE),
                    pace.compute_ms,
                    pace.others_ms
                ));
            }
        }
        if let Some(lost) = status.lost.last() {
            let who = lost.node.clone().unwrap_or_else(|| format!("group rank {}", lost.group_rank));
            let size = status.members.len() as u32;
            if lost.round == status.round {
                problems.push(format!("node {who} was reported lost in round {}; the job will re-form", lost.round));
            } else if let Some(before) = evidence.size_before_loss.filter(|before| size < *before) {
                problems.push(format!(
                    "running with {size} node(s), fewer than the {before} of round {} before node {who} was lost",
                    lost.round
                ));
            }
        }
    }
    status.health = match state {
        State::Failed => Health::Failed,
        State::Succeeded | State::Closed => Health::Healthy,
        State::Running | State::Forming if problems.is_empty() => Health::Healthy,
        State::Running | State::Forming => Health::Degraded,
    };
    if state == State::Failed {
        problems.push("the job was closed after a failure".to_owned());
    }
    status.state = state;
    status.problems = problems;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(rank: u32, age: Option<f64>) -> Member {
        Member {
            group_rank: rank,
            node: format!("10.0.0.{rank}_1_0"),
            addr: format!("10.0.0.{rank}"),
            pid: 1,
            host: None,
            role: None,
            local_world_size: Some(1),
            ranks: vec![rank],
            metrics_port: None,
            heartbeat_age_s: age,
            lost_after_s: Some(15.0),
            uptime_s: None,
            workers: Vec::new(),
        }
    }

    fn running(members: Vec<Member>) -> JobStatus {
        JobStatus {
            v: STATUS_VERSION,
            run_id: "job".into(),
            backend: "c10d",
            endpoint: "h:1".into(),
            round_store: None,
            health: Health::Healthy,
            state: State::Running,
            problems: vec![],
            min_nodes: 1,
            max_nodes: 2,
            round: 3,
            members,
            arrived: vec![],
            waiting: 0,
            spares: 0,
            restarts: Restarts { used: 0, allowed: Some(3) },
            last_failure: None,
            lost: vec![],
            closed_reason: None,
        }
    }

    const FORMED: Evidence = Evidence { formed: true, size_before_loss: None };

    #[test]
    fn a_formed_round_with_beating_members_is_healthy() {
        let mut status = running(vec![member(0, Some(1.0)), member(1, Some(2.0))]);
        judge(&mut status, &FORMED);
        assert_eq!((status.health, status.state), (Health::Healthy, State::Running));
        assert!(status.problems.is_empty());
    }

    #[test]
    fn a_silent_member_or_a_shrunk_round_is_degraded() {
        let mut status = running(vec![member(0, Some(1.0)), member(1, Some(20.0))]);
        judge(&mut status, &FORMED);
        assert_eq!(status.health, Health::Degraded);
        assert!(status.problems[0].contains("no heartbeat for 20.0s"), "{:?}", status.problems);

        let mut status = running(vec![member(0, None)]);
        status.lost = vec![Lost { round: 2, group_rank: 1, node: Some("b_2_0".into()) }];
        judge(&mut status, &Evidence { formed: true, size_before_loss: Some(2) });
        assert_eq!(status.health, Health::Degraded);
        assert!(status.problems[0].contains("fewer than the 2 of round 2 before node b_2_0 was lost"));
        // a replacement joined: as large as before the loss
        judge(&mut status, &Evidence { formed: true, size_before_loss: Some(1) });
        assert_eq!(status.health, Health::Healthy);
    }

    #[test]
    fn forming_is_degraded_and_the_close_reason_decides_the_end() {
        let mut status = running(vec![]);
        status.arrived = vec!["a_1_0".into()];
        judge(&mut status, &Evidence { formed: false, size_before_loss: None });
        assert_eq!((status.health, status.state), (Health::Degraded, State::Forming));
        status.closed_reason = Some("failed: boom".into());
        judge(&mut status, &FORMED);
        assert_eq!((status.health, status.state), (Health::Failed, State::Failed));
        status.closed_reason = Some("succeeded".into());
        judge(&mut status, &FORMED);
        assert_eq!((status.health, status.state), (Health::Healthy, State::Succeeded));
    }
}
