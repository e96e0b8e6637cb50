//! [`State::Start`]: the ranks exchanged with the other nodes, the local workers started.

use std::time::Duration;

use super::agent::Agent;
use super::changes::{next_change, Changes};
use super::reform::place_kept;
use super::report::{End, Report};
use super::round_store::connect_store;
use super::watch::Attempt;
use super::{describe, State, MAX_LOST_STARTS};
use crate::agent::checkpoints::copies::plan::SOURCES_VAR;
use crate::agent::checkpoints::copies::{Restore, Round};
use crate::agent::checkpoints::{HELD_STEP_VAR, SAVED_WORLD_VAR};
use crate::agent::error::{AgentError, Result};
use crate::agent::workers::group::{Launch, WorkerGroup};
use crate::agent::workers::ranks::{self, RoleInfo};
use crate::metrics;
use crate::rendezvous::{MembershipChange, RendezvousInfo};

/// Bound on the rank exchange and other agent-side store waits.
const STORE_TIMEOUT: Duration = Duration::from_secs(300);

/// What starting an attempt's workers came to.
enum Start {
    Running(WorkerGroup),
    /// The round ended before the workers started (a member lost during the rank exchange).
    Changed(MembershipChange),
}

impl Agent {
    /// Starts the round's workers (-> [`State::Watch`]); a member lost before the rank
    /// exchange ended the round before it began (no restart is charged), and a store lost
    /// meanwhile is joined again, a few times in a row at most.
    pub(super) async fn start(&mut self, info: RendezvousInfo, report: &mut Report) -> Result<State> {
        let mut changes = self.rdzv.changes();
        let group = match self.start_workers(&info, report.restart_count, &mut changes).await {
            Ok(Start::Running(group)) => {
                self.lost_starts = 0;
                self.events.workers_started(info.round, &group.global_ranks(), &group.pids()).await;
                group
            }
            Ok(Start::Changed(change)) => {
                let description = describe(&change);
                tracing::info!("{description} while the workers were starting; re-joining");
                self.events.membership_changed(&change, &description).await;
                if change == MembershipChange::Closed {
                    return self.closed(report).await.map(State::End);
                }
                metrics::agent::get().reformed(change.kind());
                return Ok(State::Rendezvous);
            }
            Err(AgentError::Interrupted(signal)) => {
                tracing::info!("received {signal} while starting the workers; stopping");
                return Ok(State::End(End::Interrupted(signal)));
            }
            Err(err) if err.is_store_unreachable() && self.lost_starts < MAX_LOST_STARTS => {
                self.lost_starts += 1;
                tracing::warn!("the rendezvous store went away while the workers were starting ({err}); re-joining");
                return Ok(State::Rendezvous);
            }
            Err(err) => return Err(err),
        };
        report.global_ranks = group.global_ranks();
        let counts = metrics::agent::get();
        counts.forget_worker_heartbeats();
        counts.workers_running(self.config.local_world_size);
        Ok(State::Watch(Attempt { info, group, changes }))
    }

    /// Exchanges ranks with the other nodes and starts the local workers. A stop signal ends
    /// the exchange ([`AgentError::Interrupted`]): it can take as long as the slowest node.
    async fn start_workers(
        &mut self,
        info: &RendezvousInfo,
        restart_count: i64,
        changes: &mut Changes,
    ) -> Result<Start> {
        let me = RoleInfo { role: self.config.role.clone(), local_world_size: self.config.local_world_size };
        let secret = self.rdzv.secret().cloned();
        let checkpoints = self.checkpoints.as_ref();
        if let Some(checkpoints) = checkpoints {
            checkpoints.hush(); // the round's restore comes first
        }
        let exchange = async {
            let at = (info.store_host.clone(), info.store_port);
            let store = connect_store(&mut self.store, &at, secret.as_ref(), STORE_TIMEOUT).await?;
            let assignment =
                ranks::assign(store, &info.store_prefix, info.rank, info.world_size, &me, STORE_TIMEOUT).await?;
            let Some(checkpoints) = checkpoints else { return Ok((assignment, Restore::default())) };
            let base = assignment.global_base;
            let round = Round {
                store,
                prefix: &info.store_prefix,
                me: info.rank,
                members: info.world_size,
                secret: secret.as_ref(),
                ranks: (base..base + me.local_world_size).collect(),
                world: assignment.world_size,
                timeout: STORE_TIMEOUT,
            };
            Ok::<_, AgentError>((assignment, checkpoints.enter_round(round).await?))
        };
        // every member takes part in the exchange: one lost meanwhile never will
        let (assignment, restore) = tokio::select! {
            exchanged = exchange => exchanged?,
            change = next_change(changes) => return Ok(Start::Changed(change)),
            (signal, _) = self.signals.recv() => return Err(AgentError::Interrupted(signal)),
        };
        self.config.env.remove(SAVED_WORLD_VAR);
        self.config.env.remove(HELD_STEP_VAR);
        self.config.env.remove(SOURCES_VAR);
        self.config.env.extend(restore.worker_env());
        if let Some(step) = restore.step {
            self.events.checkpoint_restore(info.round, step, &restore.taken).await;
        }
        let attempt_dir = self.logs.attempt(self.attempt, self.config.local_world_size)?;
        self.attempt += 1;
        let launch = Launch {
            config: &self.config,
            info,
            assignment: &assignment,
            restart_count,
            attempt_dir: attempt_dir.as_deref(),
            log_writer: &self.log_writer,
            host: &self.host,
            outputs: &self.outputs,
        };
        let group = match (self.kept.take(), self.control.as_ref()) {
            (Some(kept), Some(control)) => place_kept(kept, &launch, control, &mut self.standbys)?,
            _ => WorkerGroup::start(&launch, &mut self.standbys)?,
        };
        // the next attempt's interpreters start while this one runs
        self.standbys.refill();
        Ok(Start::Running(group))
    }
}
