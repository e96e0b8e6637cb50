//! The agent's event log: every state change (a round formed, a member lost or joined, the
//! workers started, a worker failed or hung, a restart, the job finished) as one JSON object,
//! written as a line to `--event-log FILE` (appended, through the log writer thread, so a slow
//! disk never holds the agent), to stderr with `--event-log-handler jsonl`, and to the log
//! at DEBUG (target `elastix::events`; library users get it in Python's logging).
//!
//! Each event has `event` (its name), `time` (RFC 3339, milliseconds), `run_id`, `host` and
//! `pid` (the agent's), then fields of its own.

use std::path::Path;
use std::time::SystemTime;

use serde_json::{json, Map, Value};

use super::failure::{self, Failure};
use super::preflight::Named;
use super::stragglers::judge::Standing;
use crate::agent::output::logfiles::{LogFile, LogWriter};
use crate::console;
use crate::rendezvous::{MembershipChange, RendezvousInfo};

/// Longest failure message an event carries: the event log is read by people and pages.
const MESSAGE_EXCERPT: usize = 2000;

pub struct EventLog {
    file: Option<LogFile>,
    to_stderr: bool,
    run_id: String,
    host: String,
}

impl EventLog {
    /// `file`: the event log to append to, created if missing.
    pub fn open(
        file: Option<&str>,
        to_stderr: bool,
        run_id: &str,
        host: &str,
        writer: &LogWriter,
    ) -> std::io::Result<EventLog> {
        let file = file.map(|path| writer.append(Path::new(path))).transpose()?;
        Ok(EventLog { file, to_stderr, run_id: run_id.to_owned(), host: host.to_owned() })
    }

    /// Writes one event: its name first (a line starts `{"event":`, for grep and for readers
    /// that look no further), then the common fields and `fields` (an object), by name.
    pub async fn emit(&self, name: &str, fields: Value) {
        let mut event = Map::new();
        event.insert("time".into(), humantime::format_rfc3339_millis(SystemTime::now()).to_string().into());
        event.insert("run_id".into(), self.run_id.clone().into());
        event.insert("host".into(), self.host.clone().into());
        event.insert("pid".into(), std::process::id().into());
        if let Value::Object(fields) = fields {
            event.extend(fields);
        }
        let rest = Value::Object(event).to_string();
        let line = format!("{{\"event\":{},{}", Value::from(name), rest.strip_prefix('{').unwrap_or(&rest));
        tracing::debug!(target: "elastix::events", "{line}");
        if self.to_stderr {
            console::stderr().line(format!("{line}\n").into_bytes());
        }
        if let Some(file) = &self.file {
            file.line(line.as_bytes()).await;
        }
    }

    /// `master` (the round's workers' store) tells two rounds of the same number apart: two
    /// sides of a partition that each formed a "round 5" serve two workers' stores.
    pub async fn round_formed(&self, info: &RendezvousInfo, restart_count: i64) {
        let master = format!("{}:{}", info.master_addr, info.master_port);
        let fields = json!({"round": info.round, "group_rank": info.rank, "group_world_size": info.world_size,
                            "master": master, "restart_count": restart_count});
        self.emit("round_formed", fields).await;
    }

    /// The step the round's workers restore from the members' memory, and the ranks whose
    /// state this node took from a peer (`taken`: rank, member).
    pub async fn checkpoint_restore(&self, round: u64, step: u64, taken: &[(u32, u32)]) {
        let taken: Vec<_> = taken.iter().map(|(rank, member)| json!({"rank": rank, "from_member": member})).collect();
        self.emit("checkpoint_restore", json!({"round": round, "step": step, "taken": taken})).await;
    }

    pub async fn workers_started(&self, round: u64, global_ranks: &[u32], pids: &[u32]) {
        self.emit("workers_started", json!({"round": round, "global_ranks": global_ranks, "pids": pids})).await;
    }

    /// `worker_hung` or `worker_failed`, one per failure; `root_cause` marks the one the others
    /// follow from ([`failure::root_cause`]), `headline` is its one line as logs and `elastix
    /// timeline` show it, `message` an excerpt of what it left. `consequence_of`: what broke
    /// them all (a member's loss), said in each as `consequence_of`; none is a root cause then.
    pub async fn workers_failed(&self, failures: &[Failure], consequence_of: Option<&str>) {
        let root = if consequence_of.is_some() { None } else { failure::root_cause(failures) };
        for (index, failure) in failures.iter().enumerate() {
            let name = if failure.hung.is_some() { "worker_hung" } else { "worker_failed" };
            let fields = json!({"global_rank": failure.global_rank, "local_rank": failure.local_rank,
                                "worker_pid": failure.pid, "exitcode": failure.exitcode, "signal": failure.signal,
                                "hung": failure.hung, "root_cause": root == Some(index), "headline": failure.headline(),
                                "message": failure::excerpt(&failure.message, MESSAGE_EXCERPT),
                                "consequence_of": consequence_of});
            self.emit(name, fields).await;
        }
    }

    /// The workers of `round` (`pids`) run `elastix.elastic`: they are not stopped for the
    /// re-form `why` but told to stop their collectives, and re-form in the next round.
    pub async fn workers_kept(&self, round: u64, pids: &[u32], why: &str) {
        self.emit("workers_kept", json!({"round": round, "pids": pids, "why": why})).await;
    }

    /// What the pre-flight check found: the nodes and links it named (`nodes`, `links`: what
    /// each is and why), and what came of it (`decision`).
    pub async fn preflight(&self, round: u64, nodes: &[Named], links: &[Named], decision: &str) {
        let named = |all: &[Named]| -> Vec<Value> {
            all.iter().map(|n| json!({"member": n.member, "node": n.node, "why": n.why})).collect()
        };
        self.emit(
            "preflight",
            json!({"round": round, "nodes": named(nodes), "links": named(links), "decision": decision}),
        )
        .await;
    }

    /// This node leaves the job (`why`): the others go on without it.
    pub async fn left_out(&self, round: u64, why: &str) {
        self.emit("left_out", json!({"round": round, "why": why})).await;
    }

    /// A rank named a straggler (`named`), or keeping pace again: its standing then.
    pub async fn straggler(&self, standing: &Standing, named: bool) {
        let fields = json!({"rank": standing.rank, "node": standing.node, "score": standing.score,
                            "compute_ms": standing.compute_ms, "others_ms": standing.others_ms,
                            "waited_in": standing.waited_in});
        self.emit(if named { "straggler" } else { "straggler_cleared" }, fields).await;
    }

    /// `member_lost`, `member_joined` (late nodes wait to join) or `membership_changed`.
    pub async fn membership_changed(&self, change: &MembershipChange, description: &str) {
        let (name, mut fields) = match change {
            MembershipChange::NodeLost { rank, node } => {
                ("member_lost", json!({"group_rank": rank, "node": node.as_ref().map(ToString::to_string)}))
            }
            MembershipChange::NodesWaiting => ("member_joined", json!({})),
            _ => ("membership_changed", json!({})),
        };
        fields["reason"] = description.into();
        self.emit(name, fields).await;
    }

    /// The workers of `round` are no longer running (`why`: "succeeded", "failed", "changed",
    /// "signal"): with `workers_started`, when each round trained on this node.
    pub async fn workers_stopped(&self, round: u64, why: &str) {
        self.emit("workers_stopped", json!({"round": round, "why": why})).await;
    }

    /// This node reported its workers' failure as their own: `restart_count` is the job-wide
    /// count after the report (one failure of a round, on however many nodes, spends one),
    /// written whether the job then restarts or fails.
    pub async fn failure_reported(&self, restart_count: i64, max_restarts: u32) {
        self.emit("failure_reported", json!({"restart_count": restart_count, "max_restarts": max_restarts})).await;
    }

    /// The workers start again; `charged`: this restart counts against `max_restarts` (a
    /// re-form for another node's loss or arrival does not).
    pub async fn restart(&self, restart_count: i64, max_restarts: u32, reason: &str, charged: bool) {
        let fields = json!({"restart_count": restart_count, "max_restarts": max_restarts, "reason": reason,
                            "charged": charged});
        self.emit("restart", fields).await;
    }

    /// `root_cause`: for a failed job, its cause in one line.
    pub async fn job_finished(&self, state: &str, exit_code: i32, root_cause: Option<&str>) {
        self.emit("job_finished", json!({"state": state, "exit_code": exit_code, "root_cause": root_cause})).await;
    }
}
