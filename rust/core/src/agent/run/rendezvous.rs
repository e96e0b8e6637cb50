//! [`State::Rendezvous`]: joining the next round, until one forms with this node in it.

use super::agent::Agent;
use super::report::{print_summary, End, Report};
use super::{State, FAILED, MAX_LOST_STARTS, SUCCEEDED};
use crate::agent::error::Result;
use crate::agent::result::AgentErrorInfo;
use crate::metrics;
use crate::rendezvous::RendezvousError;

impl Agent {
    /// Joins the next round (-> [`State::Start`]); a closed rendezvous, a spare's graceful
    /// exit or a signal ends the run; a store lost as the round formed is joined again.
    pub(super) async fn rendezvous(&mut self, report: &mut Report) -> Result<State> {
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
        Ok(State::Start(info))
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
