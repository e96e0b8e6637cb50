//! After an attempt ends without success: a membership change re-forms the job (no restart
//! charged); the workers' own failure spends one job-wide restart, and past the budget
//! closes the job as failed.

use nix::sys::signal::Signal;

use super::agent::Agent;
use super::report::{entrypoint_name, print_summary, End, Report};
use super::{describe, FAILED, LOST_NAMED};
use crate::agent::error::Result;
use crate::agent::failure::{summary, Failure};
use crate::agent::workers::env::worker_name;
use crate::agent::workers::group::WorkerGroup;
use crate::metrics;
use crate::rendezvous::MembershipChange;

impl Agent {
    /// Stops the workers for a membership change, or keeps them to re-form in process (they
    /// run `elastix.elastic`); `Some` ends the agent (the job closed).
    pub(super) async fn on_change(
        &mut self,
        change: MembershipChange,
        group: WorkerGroup,
        report: &mut Report,
    ) -> Result<Option<End>> {
        let closed = change == MembershipChange::Closed;
        let description = describe(&change);
        tracing::info!("{description}; {}", if closed { "stopping the workers" } else { "re-forming" });
        if let MembershipChange::StoreUnreachable { store, .. } = &change {
            if let Some(advice) = self.rdzv.store_lost_advice() {
                tracing::warn!("lost the rendezvous store at {store}: {advice}");
            }
        }
        if matches!(change, MembershipChange::NodeLost { .. }) {
            report.lost.push(format!("{description} in round {}", self.round));
            let excess = report.lost.len().saturating_sub(LOST_NAMED);
            report.lost.drain(..excess);
        }
        self.events.membership_changed(&change, &description).await;
        let stopped = if closed { Some(group) } else { self.keep(group, &description).await };
        if let Some(mut group) = stopped {
            group.stop(Signal::SIGTERM, self.config.shutdown_timeout()).await;
            self.events.workers_stopped(self.round, "changed").await;
        }
        if closed {
            return self.closed(report).await.map(Some);
        }
        self.events.restart(report.restart_count, self.config.max_restarts, &description, false).await;
        metrics::agent::get().reformed(change.kind());
        Ok(None)
    }

    /// Spends a restart if this is the round's first failure report; past the budget, closes
    /// the job as failed. `Some` ends the agent.
    pub(super) async fn after_failure(&mut self, failures: Vec<Failure>, report: &mut Report) -> Result<Option<End>> {
        report.workers_failed = true;
        let restarts = match self.rdzv.report_failure().await {
            Ok(restarts) => restarts,
            // the store went away as well: a lost store is a lost node (its host); re-joining
            // finds it or its next site, and the failure is not charged
            Err(err) if err.is_store_unreachable() => {
                tracing::warn!(
                    "could not report the workers' failure: {err}; re-joining without charging a restart (the store's \
                     host is lost, or this node is cut off)"
                );
                self.events
                    .restart(report.restart_count, self.config.max_restarts, "rendezvous store lost", false)
                    .await;
                return Ok(None);
            }
            Err(err) => return Err(err.into()),
        };
        report.restart_count = restarts;
        self.events.failure_reported(restarts, self.config.max_restarts).await;
        metrics::agent::get().job_restarts(restarts, self.config.max_restarts);
        self.publish_failure(&failures, report.restart_count).await;
        let name = entrypoint_name(&self.config);
        let text = summary(&name, &failures);
        report.failures = failures;
        if restarts > i64::from(self.config.max_restarts) {
            print_summary(&text);
            let _ = self.rdzv.set_closed_with(&format!("{FAILED}{text}")).await;
            report.summary = Some(text);
            return Ok(Some(End::Failed));
        }
        let failed: Vec<String> = report
            .failures
            .iter()
            .map(|failure| {
                format!(
                    "{} failed with exit code {}{}",
                    worker_name(failure.global_rank, failure.local_rank, Some(failure.pid)),
                    failure.exitcode,
                    failure.signal.as_deref().map(|s| format!(" ({s})")).unwrap_or_default(),
                )
            })
            .collect();
        tracing::warn!("{}; restart {restarts} of {}", failed.join("; "), self.config.max_restarts);
        self.events.restart(restarts, self.config.max_restarts, "worker failure", true).await;
        let counts = metrics::agent::get();
        counts.reformed("worker_failure");
        counts.restarted();
        Ok(None)
    }
}
