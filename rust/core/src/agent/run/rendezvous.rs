//! [`State::Rendezvous`]: joining the next round, until one forms with this node in it.

use std::collections::BTreeSet;
use std::time::Duration;

use super::agent::Agent;
use super::report::{print_summary, End, Report};
use super::{State, FAILED, MAX_LOST_STARTS, SUCCEEDED};
use crate::agent::error::Result;
use crate::agent::preflight::may_leave;
use crate::agent::result::AgentErrorInfo;
use crate::agent::stragglers::lock;
use crate::metrics;
use crate::rendezvous::RendezvousError;

impl Agent {
    /// Joins the next round (-> [`State::Start`]); a closed rendezvous, a spare's graceful
    /// exit or a signal ends the run; a store lost as the round formed is joined again.
    pub(super) async fn rendezvous(&mut self, report: &mut Report) -> Result<State> {
        if let Some(why) = self.straggler_leaving(report) {
            return self.leave_job(&why, report).await;
        }
        let asked = tokio::time::Instant::now();
        let info = tokio::select! {
            info = self.rdzv.next_rendezvous() => match info {
                Ok(info) => info,
                Err(RendezvousError::Closed { .. }) => return self.closed(report).await.map(State::End),
                Err(RendezvousError::GracefulExit { .. }) => {
                    tracing::info!("the job finished while this node waited as a spare");
                    return Ok(State::End(End::Succeeded));
                }
                Err(err) => return Err(err.into()),
            },
            (signal, _) = self.signals.recv() => {
                tracing::info!("received {signal} while waiting for the rendezvous (no worker running); stopping");
                return Ok(State::End(End::Interrupted(signal)));
            }
        };
        if self.round_seen.is_none() {
            // the first round: how to look at the job (a --standalone job's run ID is made up)
            tracing::info!("{}", self.how_to_watch());
        }
        self.round_seen = Some(info.round);
        // each round has a store of its own, even where it reuses the last one's address
        // (a restarted job keeps its MASTER_PORT): a connection to the old one is stale
        self.store = None;
        report.failures.clear(); // the result describes the last attempt
        report.group_rank = Some(info.rank);
        report.group_world_size = Some(info.world_size);
        report.restart_count = match self.rdzv.restart_count().await {
            Ok(count) => count,
            Err(err) if err.is_store_unreachable() && self.lost_starts < MAX_LOST_STARTS => {
                self.lost_starts += 1;
                tracing::warn!("the rendezvous store went away as the round formed ({err}); re-joining");
                return Ok(State::Rendezvous);
            }
            Err(err) => return Err(err.into()),
        };
        self.events.round_formed(&info, report.restart_count).await;
        let counts = metrics::agent::get();
        counts.joined_round(info.round, info.world_size, asked.elapsed());
        self.round = info.round;
        counts.job_restarts(report.restart_count, self.config.max_restarts);
        if info.round == 0 && self.config.preflight.is_some() {
            return Ok(State::Preflight(info));
        }
        Ok(State::Start(info))
    }

    /// Under `--exclude-stragglers`, why this node leaves at this re-form: the last round named
    /// it a straggler, and the job can go on without its straggling nodes.
    fn straggler_leaving(&self, report: &Report) -> Option<String> {
        let members = report.group_world_size.filter(|_| self.config.exclude_stragglers)?;
        let standings = lock(&self.standings);
        let mine = standings.values().find(|s| s.straggler && s.node == self.host)?;
        let nodes: BTreeSet<&str> = standings.values().filter(|s| s.straggler).map(|s| s.node.as_str()).collect();
        let elastic = self.config.rdzv_backend != "static";
        match may_leave(nodes.len(), members, self.config.min_nodes, elastic) {
            Ok(()) => Some(format!(
                "--exclude-stragglers: rank {} is a straggler (it computes {:.1}x as long as the others)",
                mine.rank,
                mine.compute_ms / mine.others_ms.max(f64::MIN_POSITIVE)
            )),
            Err(why) => {
                tracing::warn!("--exclude-stragglers: this node is a straggler but stays: {why}");
                None
            }
        }
    }

    /// This node leaves the job for `why` and ends (exit 1); the others re-form without it.
    pub(super) async fn leave_job(&mut self, why: &str, report: &mut Report) -> Result<State> {
        tracing::error!("this node leaves the job: {why}");
        self.tell_round_leaving(why).await;
        self.events.left_out(self.round, why).await;
        let message = format!("this node left the job: {why}");
        report.summary = Some(message.clone());
        report.error = Some(AgentErrorInfo { kind: "left_out".to_owned(), message });
        Ok(State::End(End::Failed))
    }

    /// Tells the round this node leaves (`why`), so that the others re-form without it now
    /// rather than a loss window later; bounded, and its heartbeats stopping tell them anyway.
    pub(super) async fn tell_round_leaving(&mut self, why: &str) {
        let left = tokio::time::timeout(LEAVE_WAIT, self.rdzv.leave(why)).await;
        if !matches!(left, Ok(Ok(()))) {
            tracing::debug!("could not tell the round this node leaves; its heartbeats will");
        }
    }

    /// The rendezvous was closed: by a successful job, or by one that failed elsewhere.
    pub(super) async fn closed(&mut self, report: &mut Report) -> Result<End> {
        let reason = self.rdzv.closed_reason().await?.unwrap_or_default();
        if reason == SUCCEEDED {
            return Ok(End::Succeeded);
        }
        let why = reason.strip_prefix(FAILED).unwrap_or(&reason);
        print_summary(&format!("[elastix] the job was closed after a failure on another node:\n{why}"));
        report.summary = Some(why.to_owned());
        report.error = Some(AgentErrorInfo { kind: "remote_failure".to_owned(), message: why.to_owned() });
        Ok(End::Failed)
    }
}

/// How long a leaving node tries to tell its round.
const LEAVE_WAIT: Duration = Duration::from_secs(1);
