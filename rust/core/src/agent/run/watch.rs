//! [`State::Watch`]: the workers run; the first event of the attempt (a worker failed, all
//! succeeded, the membership changed, a signal) decides what comes next.

use std::time::Duration;

use nix::sys::signal::Signal;

use super::agent::Agent;
use super::changes::{next_change, Changes};
use super::loss::Patience;
use super::neighbor::NeighborWatch;
use super::report::{End, Report};
use super::{describe, State};
use crate::agent::error::{AgentError, Result};
use crate::agent::failure::Failure;
use crate::agent::hangs::dumps::DumpRequests;
use crate::agent::progress::ProgressPublisher;
use crate::agent::round_store::RoundStore;
use crate::agent::stragglers::{lock, Exchange, StragglerWatch};
use crate::agent::workers::control::Control;
use crate::agent::workers::env::worker_name;
use crate::agent::workers::group::{GroupOutcome, Waited, WorkerGroup, FAILED_TOGETHER};
use crate::metrics;
use crate::rendezvous::{MembershipChange, RendezvousInfo};

/// An attempt whose workers succeeded: its round and changes, and what it keeps up until
/// the barrier is through (the status publisher, the stack dump requests).
pub(super) struct Watched {
    pub(super) info: RendezvousInfo,
    pub(super) changes: Changes,
    pub(super) _progress: Option<ProgressPublisher>,
    pub(super) _dumps: DumpRequests,
}

/// One attempt: its round, its workers, the changes that may end it.
pub(super) struct Attempt {
    pub(super) info: RendezvousInfo,
    pub(super) group: WorkerGroup,
    pub(super) changes: Changes,
}

/// What makes the agent ask whether a member is lost while its workers run.
enum Suspicion {
    /// Elastic workers whose collective failed (pid, why).
    Broken(Vec<(u32, String)>),
    /// The member this node watches closed the connection.
    NeighborClosed,
}

/// What ended one attempt.
pub(super) enum Event {
    Workers(GroupOutcome),
    Change(MembershipChange),
    /// A handled signal, and whether to forward it to the workers.
    Signal(Signal, bool),
}

impl Agent {
    /// Waits for the attempt's first event and acts on it: the barrier after a success, the
    /// rendezvous again after a failure within the budget or a change, the end otherwise.
    pub(super) async fn watch(&mut self, attempt: Attempt, report: &mut Report) -> Result<State> {
        let Attempt { info, mut group, mut changes } = attempt;
        // this attempt's, through the barrier: they go with it (the publisher's connection
        // too, which the store hosted here would otherwise wait for at the end)
        let progress = self.publish_node_status(&mut group).await;
        let _stragglers = self.watch_stragglers(&info, &group);
        if let Some(control) = self.control.as_mut() {
            control.forget_broken(); // reports of the round before this one
        }
        let mut dumps = DumpRequests::watch(&info, &self.host, self.rdzv.secret());
        // the summary of a failure that ends the job lists all that fail with it
        let last_chance = report.restart_count >= i64::from(self.config.max_restarts);
        let together = if last_chance { FAILED_TOGETHER } else { Duration::ZERO };
        let mut neighbor = NeighborWatch::start(&mut self.rdzv, &info).await;
        let event = loop {
            let suspicion = tokio::select! {
                waited = group.wait(&mut dumps, &mut self.standbys, together) => break match waited {
                    Waited::Done(outcome) => Event::Workers(outcome),
                    // describing and stopping hung workers (their stacks, who holds them up,
                    // across nodes too) is not cut short by a change another node's failure
                    // brings meanwhile
                    Waited::Hung(hung) => {
                        Event::Workers(GroupOutcome::Failed(group.stop_hung(hung, dumps.exchange()).await))
                    }
                },
                change = next_change(&mut changes) => break Event::Change(change),
                (signal, forward) = self.signals.recv() => break Event::Signal(signal, forward),
                broken = next_broken(&mut self.control) => Suspicion::Broken(broken),
                () = neighbor.closed() => Suspicion::NeighborClosed,
            };
            if let Some(event) = self.ask_after(suspicion, &mut changes, &mut neighbor).await? {
                break event;
            }
        };
        drop(neighbor);
        let event = match event {
            // nothing was lost: the workers finish the step they compute first
            Event::Change(MembershipChange::NodesWaiting) => {
                self.drain(&info, &group, &mut changes).await.unwrap_or(Event::Change(MembershipChange::NodesWaiting))
            }
            event => event,
        };
        count_exits(&event, self.config.local_world_size);
        match event {
            Event::Workers(GroupOutcome::Succeeded) => {
                // the last lines belong in the log files the run's outcome vouches for
                group.drain_output().await;
                drop(group);
                self.events.workers_stopped(info.round, "succeeded").await;
                Ok(State::Barrier(Watched { info, changes, _progress: progress, _dumps: dumps }))
            }
            Event::Workers(GroupOutcome::Failed(failures)) => {
                self.failed(failures, &info, group, &mut changes, report).await
            }
            Event::Change(change) => {
                Ok(self.on_change(change, group, report).await?.map_or(State::Rendezvous, State::End))
            }
            Event::Signal(signal, forward) => {
                tracing::info!("received {signal}; stopping the workers");
                // a node stopped (not a job-wide preemption notice, which its workers act on
                // together) tells the others, who re-form without it now, not a loss window later
                if !matches!(signal, Signal::SIGUSR1 | Signal::SIGUSR2) {
                    self.tell_round_leaving(&format!("it was stopped ({signal})")).await;
                }
                // workers get the signal itself when it is one to forward, else SIGTERM
                group.stop(if forward { signal } else { Signal::SIGTERM }, self.config.shutdown_timeout()).await;
                self.events.workers_stopped(info.round, "signal").await;
                Ok(State::End(End::Interrupted(signal)))
            }
        }
    }

    /// An elastic worker's collective failed and it waits for word, or the member this node
    /// watches closed its connection: a member's loss is asked about now, as a failed plain
    /// worker would have it asked. `Some`: the event that ends the attempt.
    async fn ask_after(
        &mut self,
        suspicion: Suspicion,
        changes: &mut Changes,
        neighbor: &mut NeighborWatch,
    ) -> Result<Option<Event>> {
        let (why, patience) = match &suspicion {
            Suspicion::Broken(broken) => {
                (format!("the collective of worker pid {} failed ({})", broken[0].0, broken[0].1), Patience::Heartbeats)
            }
            // the workers run on meanwhile: a member that does not answer is left to its
            // heartbeats rather than waited for here
            Suspicion::NeighborClosed => {
                (format!("{} closed the connection this node watches it by", neighbor.describe()), Patience::Answers)
            }
        };
        tracing::info!("{why}; asking whether a member is lost");
        match self.member_loss(changes, patience).await {
            Ok(Some(change)) => Ok(Some(Event::Change(change))),
            Ok(None) => {
                match suspicion {
                    Suspicion::Broken(_) => {
                        tracing::info!("every member is there: the workers wait for the job to re-form")
                    }
                    Suspicion::NeighborClosed => {
                        tracing::info!("no member is lost: {} is watched again", neighbor.describe());
                        neighbor.again();
                    }
                }
                Ok(None)
            }
            Err(AgentError::Interrupted(signal)) => Ok(Some(Event::Signal(signal, false))),
            Err(err) => Err(err),
        }
    }

    /// Workers failed: a member's death breaks its peers' collectives first, and that is its
    /// loss (no restart charged); otherwise the failure is theirs and spends a restart (the
    /// workers that failed are started again; those that run `elastix.elastic` and did not
    /// fail are kept and re-form in process).
    async fn failed(
        &mut self,
        failures: Vec<Failure>,
        info: &RendezvousInfo,
        mut group: WorkerGroup,
        changes: &mut Changes,
        report: &mut Report,
    ) -> Result<State> {
        let grace = self.config.shutdown_timeout();
        let loss = match self.member_loss(changes, Patience::Heartbeats).await {
            Ok(loss) => loss,
            Err(AgentError::Interrupted(signal)) => {
                self.events.workers_failed(&failures, None).await;
                tracing::info!("received {signal} while asking whether a member is lost; stopping the workers");
                group.stop(Signal::SIGTERM, grace).await;
                self.events.workers_stopped(info.round, "signal").await;
                return Ok(State::End(End::Interrupted(signal)));
            }
            Err(err) => return Err(err),
        };
        // the failures go in the log as the loss's consequence, never as a root cause
        self.events.workers_failed(&failures, loss.as_ref().map(describe).as_deref()).await;
        if let Some(change) = loss {
            tracing::info!("the workers failed with the loss of a member: no restart is charged");
            return Ok(self.on_change(change, group, report).await?.map_or(State::Rendezvous, State::End));
        }
        let failed = failures.iter().map(|f| worker_name(f.global_rank, f.local_rank, Some(f.pid)));
        let why = format!("{} failed", failed.collect::<Vec<_>>().join(", "));
        if let Some(mut group) = self.keep(group, &why).await {
            group.stop(Signal::SIGTERM, grace).await;
            self.events.workers_stopped(info.round, "failed").await;
        }
        Ok(self.after_failure(failures, report).await?.map_or(State::Rendezvous, State::End))
    }
}

impl Agent {
    /// Measures the workers' pace and exchanges it with the round's other members, for as
    /// long as the attempt is watched.
    fn watch_stragglers(&self, info: &RendezvousInfo, group: &WorkerGroup) -> StragglerWatch {
        let store = RoundStore {
            host: info.store_host.clone(),
            port: info.store_port,
            prefix: info.store_prefix.clone(),
            secret: self.rdzv.secret().cloned(),
        };
        let exchange = Exchange { store, me: info.rank, members: info.world_size, node: self.host.clone() };
        lock(&self.standings).clear(); // the last round's ranks
        crate::metrics::agent::get().paces(&[]);
        StragglerWatch::start(exchange, group.meters(), self.standings.clone(), self.events.clone())
    }
}

/// The next report of elastic workers whose collective failed, with any that came meanwhile:
/// not an end by itself (never, without a control socket).
async fn next_broken(control: &mut Option<Control>) -> Vec<(u32, String)> {
    match control {
        Some(control) => control.broken().await,
        None => std::future::pending().await,
    }
}

/// Counts the workers that ended by themselves (not those the agent then stopped) and those
/// the watchdog killed as hung, and that none runs once an attempt ended.
fn count_exits(event: &Event, local_world_size: u32) {
    let counts = metrics::agent::get();
    match event {
        Event::Workers(GroupOutcome::Succeeded) => (0..local_world_size).for_each(|_| counts.worker_exited("0".into())),
        Event::Workers(GroupOutcome::Failed(failures)) => {
            for failure in failures {
                match failure.hung {
                    Some(_) => counts.hung_worker(), // killed by the watchdog, not ended by itself
                    None => {
                        counts.worker_exited(failure.signal.clone().unwrap_or_else(|| failure.exitcode.to_string()))
                    }
                }
            }
        }
        Event::Change(_) | Event::Signal(..) => {}
    }
    counts.workers_running(0);
}
