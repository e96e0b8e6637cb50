//! The JSON records the rendezvous writes. Every record carries a format version `v`; a reader
//! refuses versions it does not know instead of misreading them.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::error::{RendezvousError, Result};
use super::node::NodeDesc;

pub const FORMAT_VERSION: u32 = 1;

/// Where a run keeps its [`FailureRecord`] (under the run's prefix), on every backend.
pub const LAST_FAILURE_KEY: &str = "last_failure";

/// The namespace of round `round`'s workers' store (under the run's prefix), handed to the
/// agent and its workers: the same on every backend.
pub fn round_store(round: u64) -> String {
    format!("r{round}/store")
}

/// Written once per store holding the run: lets agents started with different settings or
/// versions fail fast, and tells one holding of the state from another.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    pub v: u32,
    pub min_nodes: u32,
    pub max_nodes: u32,
    /// Random, chosen by whoever created this holding: a store that restarted empty and was
    /// set up again has another one, which tells its clients that the state they knew is gone.
    #[serde(default)]
    pub incarnation: u64,
    /// How many times the state moved to a new holding (a lost store site, a store that lost
    /// its state): the live job is at the highest generation.
    #[serde(default)]
    pub generation: u64,
}

/// What an arrival slot holds: the node, or nothing if it gave up before the round sealed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arrival {
    pub v: u32,
    pub node: Option<NodeDesc>,
}

/// The outcome of a round, fixed by one compare-and-set.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seal {
    pub v: u32,
    /// Members in the round; 0 for an aborted round.
    pub world_size: u32,
    /// The round could not form (too few live arrivals); everyone moves to the next one.
    pub aborted: bool,
}

/// Where the workers of a round find their store (rank 0's agent serves it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Master {
    pub v: u32,
    pub addr: String,
    pub port: u16,
}

/// Something every agent of a round may need to react to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    /// A new round opened; members of earlier rounds should re-join.
    Opened { v: u32, round: u64 },
    /// A late node wants round `round` to re-form with it.
    Waiting { v: u32, round: u64, node: NodeDesc },
    /// A member of round `round` stopped sending heartbeats.
    Lost { v: u32, round: u64, rank: u32, node: Option<NodeDesc> },
    /// The job is over; `reason` says how ("succeeded", or the failure's root cause), so that
    /// every node can report it even if the store is gone a moment later.
    Closed {
        v: u32,
        #[serde(default)]
        reason: Option<String>,
    },
}

/// What an agent knows about itself and the rendezvous does not, published once its workers
/// run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AgentFacts {
    /// The host name the failure summary and the line prefixes use.
    pub host: String,
    pub role: String,
    pub local_world_size: u32,
    /// Global rank of local rank 0; the node's workers hold the next `local_world_size`.
    pub first_rank: u32,
    pub max_restarts: u32,
    /// The agent's metrics endpoint port, if it serves one.
    pub metrics_port: Option<u16>,
    /// When this attempt's workers started (ms since the epoch, the agent's clock; 0: unknown,
    /// as from an older agent).
    #[serde(default)]
    pub workers_started_ms: u64,
    /// Each worker's progress when this was published (republished as it changes).
    #[serde(default)]
    pub workers: Vec<WorkerProgress>,
}

/// One worker's progress as its agent last saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerProgress {
    pub rank: u32,
    /// Heartbeats sent (`elastix.heartbeat()`).
    pub beats: u64,
    /// The training step its last heartbeat named, if any did.
    pub step: Option<u64>,
    /// When it was last seen making progress: its last heartbeat or the last time its main
    /// thread ran, ms since the epoch on the agent's clock (`None`: never).
    pub seen_ms: Option<u64>,
    /// What its main thread and processes were doing (`None`: not watched: not a Python
    /// worker, or an older agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub doing: Option<Doing>,
    /// Its newest checkpoint in its agent's memory (`elastix.checkpoint`), if it saved one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<HeldCheckpoint>,
    /// Its pace against the other ranks', once judged (workers that use elastix collectives).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pace: Option<RankPace>,
}

/// A rank's pace as the round's first member last judged it: its score (the others' median
/// compute between collectives over its own: 1 keeps pace, under 0.75 is behind), both
/// computes in ms, and whether it is named a straggler.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankPace {
    pub score: f64,
    pub compute_ms: f64,
    pub others_ms: f64,
    pub straggler: bool,
}

/// A worker's newest checkpoint as its agent holds it: in memory, and what reached the disk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldCheckpoint {
    pub step: u64,
    pub bytes: u64,
    /// When the worker saved it, ms since the epoch (the worker's clock, on the agent's machine).
    pub saved_ms: u64,
    /// The newest step persisted to `--checkpoint-dir`, and when (`None`: none yet, or memory only).
    pub persisted_step: Option<u64>,
    pub persisted_ms: Option<u64>,
    /// How long the worker's save of `step` took (the copy into memory), and the persisting of
    /// `persisted_step`, in ms.
    #[serde(default)]
    pub save_ms: Option<u64>,
    #[serde(default)]
    pub persist_ms: Option<u64>,
    /// The newest step a peer's agent holds a copy of (`None`: none, or no peer).
    #[serde(default)]
    pub copied_step: Option<u64>,
    /// What the worker restored last: the step every rank agreed on, and from where.
    #[serde(default)]
    pub restored: Option<Restored>,
}

/// The step a worker restored, and where it came from: `memory` (its agent's), `peer` (a copy
/// another agent held) or `disk`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Restored {
    pub step: u64,
    pub source: String,
}

/// How a worker's main thread and CPU use looked to its agent (`agent::activity`), for
/// `elastix status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Doing {
    /// Its main thread ran within the last second.
    Running,
    /// Its main thread has not run for a while, and its processes use no CPU.
    Waiting,
    /// Its main thread has not run for a while, but its processes keep the CPU busy (another
    /// thread or a child works): not hung on this evidence, whatever the main thread waits for.
    BlockedBusy,
}

/// A member's [`AgentFacts`], with what the rendezvous adds: for `elastix status`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub v: u32,
    pub node: NodeDesc,
    #[serde(flatten)]
    pub facts: AgentFacts,
    /// How long a member may stay silent before the others count it lost.
    pub lost_after_ms: u64,
}

impl NodeStatus {
    pub fn new(node: NodeDesc, facts: AgentFacts, lost_after: std::time::Duration) -> NodeStatus {
        let lost_after_ms = u64::try_from(lost_after.as_millis()).unwrap_or(u64::MAX);
        NodeStatus { v: FORMAT_VERSION, node, facts, lost_after_ms }
    }
}

/// The root cause of a node's failed attempt, as far as `elastix status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureRecord {
    pub v: u32,
    pub round: u64,
    pub host: String,
    /// Milliseconds since the Unix epoch, on the failing node's clock.
    pub at_ms: u64,
    pub rank: u32,
    pub local_rank: u32,
    pub exitcode: i32,
    pub signal: Option<String>,
    /// Why its agent found it hung (it was then killed); records of earlier versions lack it.
    #[serde(default)]
    pub hung: Option<String>,
    /// The worker's error message or the tail of its stderr, cut to [`FailureRecord::MAX_MESSAGE`].
    pub message: String,
    /// Restarts used after this failure, and the budget.
    pub restarts_used: i64,
    pub max_restarts: u32,
}

impl FailureRecord {
    /// Longest message kept: the store holds a record per job, not a log.
    pub const MAX_MESSAGE: usize = 2000;
}

/// Milliseconds since the Unix epoch on this machine's clock.
pub fn now_ms() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}

/// Seconds from `at_ms` (ms since the epoch, another machine's clock, say) to `now_ms`, 0 if
/// `at_ms` is later: how old a published moment is as this machine reads it.
pub fn seconds_between(at_ms: u64, now_ms: u64) -> f64 {
    now_ms.saturating_sub(at_ms) as f64 / 1000.0
}

pub fn encode<T: Serialize>(record: &T) -> Vec<u8> {
    serde_json::to_vec(record).expect("rendezvous records always serialize")
}

/// Decodes a record, checking its version. `what` names it in the error.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    #[derive(Deserialize)]
    struct Versioned {
        v: u32,
    }
    let bad = |err: serde_json::Error| {
        RendezvousError::State(format!("unreadable rendezvous {what} {:?}: {err}", String::from_utf8_lossy(bytes)))
    };
    let version: Versioned = serde_json::from_slice(bytes).map_err(bad)?;
    if version.v != FORMAT_VERSION {
        return Err(RendezvousError::State(format!(
            "rendezvous {what} has format version {} but this elastix reads version {FORMAT_VERSION}; \
             are all agents running the same elastix version?",
            version.v
        )));
    }
    serde_json::from_slice(bytes).map_err(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_versions_are_checked() {
        let event = Event::Lost { v: 1, round: 3, rank: 2, node: None };
        let bytes = encode(&event);
        assert_eq!(decode::<Event>(&bytes, "event").unwrap(), event);
        let text = String::from_utf8(bytes).unwrap();
        assert!(text.contains(r#""kind":"lost""#), "{text}");
        let err = decode::<Seal>(br#"{"v":2,"world_size":1,"aborted":false}"#, "seal").unwrap_err();
        assert!(err.to_string().contains("format version 2"), "{err}");
        assert!(decode::<Seal>(b"pickle\x80", "seal").is_err());
    }
}
