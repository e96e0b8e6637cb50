//! What the agent tells `elastix status` on the way: who this member is and its workers'
//! progress, and the root cause of its last failure. Best effort and bounded: a slow store
//! must not hold the agent while its workers run unwatched.

use std::time::Duration;

use super::agent::Agent;
use crate::agent::failure::{self, Failure};
use crate::agent::progress::ProgressPublisher;
use crate::agent::workers::group::WorkerGroup;
use crate::metrics::MetricsServer;
use crate::rendezvous::records::{AgentFacts, FailureRecord, FORMAT_VERSION};

/// Bound on publishing what `elastix status` shows (a node's facts, a failure).
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(2);

impl Agent {
    /// Tells `elastix status` who this member is (best effort, bounded: a slow store must not
    /// hold the agent while its workers run unwatched), then starts republishing it with the
    /// workers' progress, which `group` notes, until the publisher returned is dropped.
    pub(super) async fn publish_node_status(&mut self, group: &mut WorkerGroup) -> Option<ProgressPublisher> {
        let global_ranks = group.global_ranks();
        let facts = AgentFacts {
            host: self.host.clone(),
            role: self.config.role.clone(),
            local_world_size: self.config.local_world_size,
            first_rank: global_ranks.iter().copied().min().unwrap_or(0),
            max_restarts: self.config.max_restarts,
            metrics_port: self.metrics_server.as_ref().map(MetricsServer::port),
            workers_started_ms: crate::rendezvous::records::now_ms(),
            workers: Vec::new(),
        };
        match tokio::time::timeout(PUBLISH_TIMEOUT, self.rdzv.publish_node_status(facts.clone())).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::debug!("could not publish this node's status: {err}"),
            Err(_) => tracing::debug!("publishing this node's status took over {PUBLISH_TIMEOUT:?}; skipped"),
        }
        self.rdzv.status_writer().map(|writer| {
            let held = self.checkpoints.as_ref().map(|checkpoints| checkpoints.view());
            let (publisher, notes) = ProgressPublisher::start(writer, facts, held, self.standings.clone());
            group.note_progress_in(notes);
            publisher
        })
    }

    /// Tells `elastix status` the root cause of this node's failure (best effort, bounded).
    pub(super) async fn publish_failure(&mut self, failures: &[Failure], restarts_used: i64) {
        let Some(first) = failure::root_cause(failures).map(|root| &failures[root]) else { return };
        let record = FailureRecord {
            v: FORMAT_VERSION,
            round: self.round,
            host: first.host.clone(),
            at_ms: (first.timestamp * 1000.0) as u64,
            rank: first.global_rank,
            local_rank: first.local_rank,
            exitcode: first.exitcode,
            signal: first.signal.clone(),
            hung: first.hung.clone(),
            message: failure::excerpt(&first.message, FailureRecord::MAX_MESSAGE),
            restarts_used,
            max_restarts: self.config.max_restarts,
        };
        match tokio::time::timeout(PUBLISH_TIMEOUT, self.rdzv.publish_failure(&record)).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::debug!("could not publish the failure for elastix status: {err}"),
            Err(_) => tracing::debug!("publishing the failure took over {PUBLISH_TIMEOUT:?}; skipped"),
        }
    }
}
