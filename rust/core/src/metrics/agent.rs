//! What an agent counts. Everything here changes at round or failure time, never per output
//! line or per request, so it is counted whether or not a metrics endpoint runs.
//!
//! The agent pushes what it knows (nothing here reads the agent's state): worker heartbeats
//! (`elastix.heartbeat()`) reach [`AgentMetrics::worker_heartbeat_at`] as the group's watchdog
//! reads them, as moments on this process's clock, and the scrape turns them into
//! `elastix_agent_worker_heartbeat_age_seconds{local_rank}`; workers it kills as hung are
//! counted by [`AgentMetrics::hung_worker`].

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// Bounds of the rendezvous duration histogram, in seconds: a re-form on a live store takes
/// milliseconds, a first round waits for the last call, a lost node for join_timeout.
const RENDEZVOUS_BUCKETS: [f64; 13] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0, 120.0, 600.0];

/// Why workers were stopped for the job to re-form: a worker failed, or a
/// `MembershipChange::kind`.
pub const REFORM_REASONS: [&str; 7] = [
    "worker_failure",
    "nodes_waiting",
    "node_lost",
    "round_superseded",
    "store_reset",
    "store_unreachable",
    "store_moved",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    pub reason: &'static str,
}

/// `exit="0"`, `exit="1"`, ... or `exit="SIGKILL"`: at most 256 codes and 64 signals.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Exit {
    pub exit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LocalRank {
    pub local_rank: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GlobalRank {
    pub rank: u32,
}

type FloatGauge = Gauge<f64, AtomicU64>;

pub struct AgentMetrics {
    rounds: Counter,
    round: Gauge,
    group_world_size: Gauge,
    reforms: Family<Reason, Counter>,
    restarts: Counter,
    job_restarts: Gauge,
    job_max_restarts: Gauge,
    worker_exits: Family<Exit, Counter>,
    workers: Gauge,
    hung_workers: Counter,
    rendezvous_duration: Histogram,
    heartbeat_age: FloatGauge,
    last_heartbeat: Mutex<Option<Instant>>,
    worker_heartbeat_age: Family<LocalRank, FloatGauge>,
    /// Last beat of each local rank.
    worker_beats: Mutex<BTreeMap<u32, Instant>>,
    dropped_log_lines: Counter,
    /// This node's ranks' pace scores, and whether each is named a straggler.
    pace_score: Family<GlobalRank, FloatGauge>,
    straggler: Family<GlobalRank, Gauge>,
}

/// This process's agent metrics.
pub fn get() -> &'static AgentMetrics {
    static METRICS: OnceLock<AgentMetrics> = OnceLock::new();
    METRICS.get_or_init(AgentMetrics::new)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl AgentMetrics {
    fn new() -> AgentMetrics {
        let reforms = Family::default();
        for reason in REFORM_REASONS {
            let _ = reforms.get_or_create_owned(&Reason { reason }); // every reason shows, from 0
        }
        AgentMetrics {
            rounds: Counter::default(),
            round: Gauge::default(),
            group_world_size: Gauge::default(),
            reforms,
            restarts: Counter::default(),
            job_restarts: Gauge::default(),
            job_max_restarts: Gauge::default(),
            worker_exits: Family::default(),
            workers: Gauge::default(),
            hung_workers: Counter::default(),
            rendezvous_duration: Histogram::new(RENDEZVOUS_BUCKETS),
            heartbeat_age: FloatGauge::default(),
            last_heartbeat: Mutex::new(None),
            worker_heartbeat_age: Family::default(),
            worker_beats: Mutex::new(BTreeMap::new()),
            dropped_log_lines: Counter::default(),
            pace_score: Family::default(),
            straggler: Family::default(),
        }
    }

    pub(super) fn register(&self, registry: &mut Registry) {
        let agent = registry.sub_registry_with_prefix("agent");
        agent.register("rounds", "Rendezvous rounds this agent joined", self.rounds.clone());
        agent.register("round", "The rendezvous round this agent is in", self.round.clone());
        agent.register("group_world_size", "Nodes in the current round", self.group_world_size.clone());
        agent.register(
            "reforms",
            "Times this agent's workers were stopped for the job to re-form, by reason",
            self.reforms.clone(),
        );
        agent.register(
            "restarts",
            "Times this agent restarted its workers after a worker failure (within the budget)",
            self.restarts.clone(),
        );
        agent.register("workers", "Local worker processes running", self.workers.clone());
        agent.register(
            "worker_exits",
            "Worker processes that ended by themselves, by exit code or signal",
            self.worker_exits.clone(),
        );
        agent.register("hung_workers", "Workers killed by the watchdog as hung", self.hung_workers.clone());
        agent.register_with_unit(
            "rendezvous_duration",
            "Time from asking for a round to being a member of one",
            Unit::Seconds,
            self.rendezvous_duration.clone(),
        );
        agent.register_with_unit(
            "heartbeat_age",
            "Time since this node's last heartbeat reached the rendezvous store (NaN before the first)",
            Unit::Seconds,
            self.heartbeat_age.clone(),
        );
        agent.register_with_unit(
            "worker_heartbeat_age",
            "Time since each local worker's last heartbeat (workers that beat)",
            Unit::Seconds,
            self.worker_heartbeat_age.clone(),
        );
        agent.register(
            "dropped_log_lines",
            "Worker output lines dropped because the console did not keep up",
            self.dropped_log_lines.clone(),
        );
        agent.register(
            "pace_score",
            "Each local rank's pace: the others' median compute between collectives over its own (1 keeps pace, \
             under 0.75 is behind)",
            self.pace_score.clone(),
        );
        agent.register("straggler", "1 for a local rank named a straggler, else 0", self.straggler.clone());
        let job = registry.sub_registry_with_prefix("job");
        job.register("restarts_used", "Job-wide restarts after failures so far", self.job_restarts.clone());
        job.register("restarts_allowed", "The job's restart budget (--max-restarts)", self.job_max_restarts.clone());
    }

    /// Brings the values computed at scrape time up to date.
    pub(super) fn refresh(&self) {
        let age = |at: Option<Instant>| at.map_or(f64::NAN, |at| at.elapsed().as_secs_f64());
        self.heartbeat_age.set(age(*lock(&self.last_heartbeat)));
        for (local_rank, beat) in lock(&self.worker_beats).iter() {
            let since = beat.elapsed().as_secs_f64();
            self.worker_heartbeat_age.get_or_create(&LocalRank { local_rank: *local_rank }).set(since);
        }
        let console = [crate::console::stdout(), crate::console::stderr()];
        let dropped: u64 = console.iter().map(|stream| stream.mark().dropped).sum();
        // only the scrape moves this counter: it follows the consoles' own (monotonic) counts
        self.dropped_log_lines.inc_by(dropped.saturating_sub(self.dropped_log_lines.get()));
    }

    /// A round this agent is a member of, `waited` after it asked for it.
    pub fn joined_round(&self, round: u64, world_size: u32, waited: std::time::Duration) {
        self.rounds.inc();
        self.round.set(i64::try_from(round).unwrap_or(i64::MAX));
        self.group_world_size.set(i64::from(world_size));
        self.rendezvous_duration.observe(waited.as_secs_f64());
    }

    /// The workers were stopped for the job to re-form (`reason`: a `MembershipChange` kind,
    /// or "worker_failure").
    pub fn reformed(&self, reason: &'static str) {
        self.reforms.get_or_create(&Reason { reason }).inc();
    }

    /// A restart after a failure, within the budget.
    pub fn restarted(&self) {
        self.restarts.inc();
    }

    /// The job-wide restart count and budget, as last seen.
    pub fn job_restarts(&self, used: i64, allowed: u32) {
        self.job_restarts.set(used);
        self.job_max_restarts.set(i64::from(allowed));
    }

    pub fn workers_running(&self, count: u32) {
        self.workers.set(i64::from(count));
    }

    /// A worker that ended by itself: `exit` is its exit code, or the signal's name.
    pub fn worker_exited(&self, exit: String) {
        self.worker_exits.get_or_create(&Exit { exit }).inc();
    }

    /// The watchdog killed a worker as hung.
    pub fn hung_worker(&self) {
        self.hung_workers.inc();
    }

    /// Local rank `local_rank`'s last heartbeat (`None`: none yet, which is not recorded).
    pub fn worker_heartbeat_at(&self, local_rank: u32, beat: Option<Instant>) {
        if let Some(beat) = beat {
            lock(&self.worker_beats).insert(local_rank, beat);
        }
    }

    /// A new set of workers starts: the old ones' beats no longer say anything.
    pub fn forget_worker_heartbeats(&self) {
        lock(&self.worker_beats).clear();
        self.worker_heartbeat_age.clear();
    }

    /// This node's ranks' standing in the last window: (rank, score, named a straggler).
    pub fn paces(&self, standings: &[(u32, f64, bool)]) {
        self.pace_score.clear();
        self.straggler.clear();
        for (rank, score, straggler) in standings {
            self.pace_score.get_or_create(&GlobalRank { rank: *rank }).set(*score);
            self.straggler.get_or_create(&GlobalRank { rank: *rank }).set(i64::from(*straggler));
        }
    }

    /// This node's heartbeat reached the rendezvous store now.
    pub fn heartbeat_sent(&self) {
        *lock(&self.last_heartbeat) = Some(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exits_are_labelled_by_code_or_signal_and_ages_computed_at_scrape() {
        let metrics = AgentMetrics::new();
        metrics.worker_exited("1".into());
        metrics.worker_exited("SIGKILL".into());
        metrics.worker_exited("SIGKILL".into());
        assert_eq!(metrics.worker_exits.get_or_create(&Exit { exit: "SIGKILL".into() }).get(), 2);
        assert_eq!(metrics.worker_exits.get_or_create(&Exit { exit: "1".into() }).get(), 1);
        metrics.refresh();
        assert!(metrics.heartbeat_age.get().is_nan());
        metrics.heartbeat_sent();
        metrics.worker_heartbeat_at(3, Some(Instant::now()));
        metrics.worker_heartbeat_at(4, None);
        metrics.refresh();
        assert!(metrics.heartbeat_age.get() >= 0.0);
        assert!(metrics.worker_heartbeat_age.get(&LocalRank { local_rank: 3 }).is_some());
        assert!(metrics.worker_heartbeat_age.get(&LocalRank { local_rank: 4 }).is_none(), "no beat yet");
        metrics.forget_worker_heartbeats();
        assert!(metrics.worker_heartbeat_age.get(&LocalRank { local_rank: 3 }).is_none());
    }
}
