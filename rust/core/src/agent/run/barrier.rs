//! [`State::Barrier`]: this node's workers succeeded; the job is done once every node's are.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::agent::Agent;
use super::changes::{new_change, Changes};
use super::report::{End, Report};
use super::round_store::connect_store;
use super::watch::{Event, Watched};
use super::{State, SUCCEEDED};
use crate::agent::error::{AgentError, Result};
use crate::auth::Secret;
use crate::metrics;
use crate::rendezvous::{MembershipChange, NodeDesc, Rendezvous, RendezvousInfo};
use crate::store::TcpStore;

/// How long the exit barrier waits for the store on each reconnect.
const BARRIER_RECONNECT: Duration = Duration::from_secs(5);
/// How often the exit barrier looks at who has not arrived (and whether they are still there).
const BARRIER_LOOK_EVERY: Duration = Duration::from_secs(2);

impl Agent {
    /// Waits for every node's workers (-> [`State::End`], the job closed as succeeded); a
    /// change that makes the job run again (another node restarted) -> [`State::Rendezvous`].
    pub(super) async fn barrier(&mut self, watched: Watched, report: &mut Report) -> Result<State> {
        // the publisher and dump requests stay up until the barrier is through
        let Watched { info, mut changes, _progress, _dumps } = watched;
        Ok(match self.exit_barrier(&info, &mut changes).await? {
            None => {
                // every node is through: the job is done
                let _ = self.rdzv.set_closed_with(SUCCEEDED).await;
                self.after_success(report);
                State::End(End::Succeeded)
            }
            Some(Event::Signal(signal, _)) => {
                tracing::info!("received {signal} in the exit barrier (this node's workers are done); stopping");
                State::End(End::Interrupted(signal))
            }
            // closed while this node's workers had finished: the usual cause is the job's
            // success, and the store may already be gone with its host
            Some(Event::Change(MembershipChange::Closed)) => {
                State::End(self.closed(report).await.unwrap_or(End::Succeeded))
            }
            Some(Event::Change(change)) => {
                metrics::agent::get().reformed(change.kind()); // another node restarted: run again with it
                State::Rendezvous
            }
            Some(Event::Workers(_)) => State::Rendezvous,
        })
    }

    /// A temporary log directory goes after a clean success; after failed attempts it stays,
    /// with the stacks of workers found hung, and the agent says where.
    fn after_success(&self, report: &mut Report) {
        match (&report.log_dir, self.logs.is_temporary()) {
            (Some(dir), true) if report.workers_failed => tracing::info!(
                "the job succeeded after {} restart(s); the logs of every attempt (with the stacks of workers \
                 found hung) are kept in {dir}",
                report.restart_count
            ),
            _ => {
                self.logs.remove_if_temporary();
                report.log_dir = None;
            }
        }
    }

    /// Waits until every node's workers are done (`None`), a membership change or a signal
    /// comes first (`Some`), or the timeout passes (`None`, with a warning: this node's
    /// workers did succeed). A member that does not arrive is asked whether it is still
    /// there: a gone one is not waited for. Changes that are only about the store do not end it.
    async fn exit_barrier(&mut self, info: &RendezvousInfo, changes: &mut Changes) -> Result<Option<Event>> {
        let timeout = self.config.exit_barrier_timeout();
        // members reported lost meanwhile (a cut link, a silent machine): not waited for either
        let lost = Mutex::new(Vec::<(u32, Option<NodeDesc>)>::new());
        let arrivals = Arrivals {
            secret: self.rdzv.secret().cloned(),
            rdzv: &mut self.rdzv,
            slot: &mut self.store,
            info,
            at: (info.store_host.clone(), info.store_port),
            awaited: (0..info.world_size).filter(|rank| *rank != info.rank).collect(),
            lost: &lost,
            deadline: Instant::now() + timeout,
        };
        let done = arrivals.wait();
        tokio::pin!(done);
        loop {
            tokio::select! {
                biased;
                done = &mut done => {
                    if !done? {
                        tracing::warn!("exit barrier: not every node was seen to finish within {timeout:?}; exiting anyway");
                    }
                    return Ok(None);
                }
                change = new_change(changes) => match change {
                    // a lost member's work is not waited for; this node's workers are done
                    MembershipChange::NodeLost { rank: Some(rank), node } => {
                        let who = node.as_ref().map_or_else(|| format!("group rank {rank}"), |node| format!("node {node} (group rank {rank})"));
                        tracing::warn!("exit barrier: {who} was reported lost; not waiting for it");
                        lost.lock().unwrap_or_else(PoisonError::into_inner).push((rank, node));
                    }
                    // finished workers are not concerned by the store's blips; another node's
                    // restart, or a store that lost the job's state, makes the job re-form and
                    // run again, with them
                    change if !change.is_about_the_store() || change == MembershipChange::StoreReset => {
                        return Ok(Some(Event::Change(change)))
                    }
                    _ => {}
                },
                (signal, forward) = self.signals.recv() => return Ok(Some(Event::Signal(signal, forward))),
            }
        }
    }
}

/// This node's mark and the wait for the others'. Each node marks its own key, so the
/// barrier survives the store going away and coming back (empty, even): it reconnects and
/// marks again, at the site the state moved to if it moved.
struct Arrivals<'a> {
    rdzv: &'a mut Rendezvous,
    /// The round's store connection, kept while usable.
    slot: &'a mut Option<TcpStore>,
    secret: Option<Secret>,
    info: &'a RendezvousInfo,
    /// Where the round's store is now.
    at: (String, u16),
    /// The group ranks not seen through yet.
    awaited: Vec<u32>,
    lost: &'a Mutex<Vec<(u32, Option<NodeDesc>)>>,
    deadline: Instant,
}

impl Arrivals<'_> {
    /// `true`: every node is through (or no one is left to wait for); `false`: the deadline
    /// passed first.
    async fn wait(mut self) -> Result<bool> {
        let (mut warned, mut said_waiting) = (false, false);
        loop {
            let remaining = self.deadline.saturating_duration_since(Instant::now());
            match self.look(remaining).await {
                Ok(None) => return Ok(true),
                Ok(Some(missing)) => self.still_missing(missing, &mut said_waiting).await,
                Err(err) if err.is_store_unreachable() && !remaining.is_zero() => {
                    if !warned {
                        warned = true;
                        tracing::warn!(
                            "exit barrier: the rendezvous store is unreachable ({err}); retrying for up to {remaining:.0?}"
                        );
                    }
                    if self.store_gone(remaining).await {
                        return Ok(true);
                    }
                }
                Err(AgentError::Store(err)) if err.is_timeout() => return Ok(false),
                Err(err) => return Err(err),
            }
        }
    }

    fn key(&self, rank: u32) -> Vec<u8> {
        format!("{}/terminal/{rank}", self.info.store_prefix).into_bytes()
    }

    /// Marks this node through and waits a while for the others: `None` when all are
    /// through, else who has not arrived yet.
    async fn look(&mut self, remaining: Duration) -> Result<Option<Vec<u32>>> {
        let slice = remaining.min(BARRIER_LOOK_EVERY);
        let keys: Vec<Vec<u8>> = self.awaited.iter().map(|rank| self.key(*rank)).collect();
        let mine = self.key(self.info.rank);
        let store = connect_store(self.slot, &self.at, self.secret.as_ref(), remaining.min(BARRIER_RECONNECT)).await?;
        store.set(&mine, b"1").await?;
        let waited: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        match store.wait(&waited, Some(slice)).await {
            Ok(()) => return Ok(None),
            Err(err) if err.is_timeout() && slice < remaining => {}
            Err(err) => return Err(err.into()),
        }
        let mut missing = Vec::new();
        for (rank, key) in self.awaited.iter().zip(&keys) {
            if !store.check(&[key.as_slice()]).await? {
                missing.push(*rank);
            }
        }
        Ok(Some(missing))
    }

    /// Waits no longer for members that are gone (asked) or were reported lost, and says once
    /// whom it waits for.
    async fn still_missing(&mut self, mut missing: Vec<u32>, said_waiting: &mut bool) {
        if let Ok(census) = self.rdzv.census(Some(&missing)).await {
            for (rank, node) in &census.gone {
                tracing::warn!("exit barrier: node {node} (group rank {rank}) is gone; not waiting for it");
            }
            missing.retain(|rank| census.gone.iter().all(|(gone, _)| gone != rank));
        }
        let lost = self.lost.lock().unwrap_or_else(PoisonError::into_inner);
        missing.retain(|rank| lost.iter().all(|(gone, _)| gone != rank));
        if !*said_waiting && !missing.is_empty() {
            *said_waiting = true;
            let ranks: Vec<String> = missing.iter().map(u32::to_string).collect();
            tracing::info!(
                "exit barrier: this node's workers are done; waiting up to {}s more for those of group rank(s) {}",
                self.deadline.saturating_duration_since(Instant::now()).as_secs(),
                ranks.join(", ")
            );
        }
        self.awaited = missing;
    }

    /// The store is unreachable: with several sites the state moves as it does for a re-join;
    /// a store served by a member's agent (etcd's rank 0) that went with it leaves no one to
    /// keep it for, and no one can tell who finished (`true`: stop waiting).
    async fn store_gone(&mut self, remaining: Duration) -> bool {
        *self.slot = None;
        let located = match self.rdzv.locate_store() {
            Some(locating) => locating.await.ok(),
            None => None,
        };
        match located {
            Some(now) if now != self.at => {
                tracing::info!("exit barrier: the rendezvous store is now at {}:{}", now.0, now.1);
                self.at = now;
            }
            _ if located.is_none() && store_host_was_reported_lost(self.lost, &self.at.0) => return true,
            _ if located.is_none() && store_host_is_gone(self.rdzv, &self.at.0).await => return true,
            _ => tokio::time::sleep(Duration::from_millis(200).min(remaining)).await,
        }
        false
    }
}

/// Whether a member at `host` (the store's host) was reported lost during the barrier.
fn store_host_was_reported_lost(lost: &Mutex<Vec<(u32, Option<NodeDesc>)>>, host: &str) -> bool {
    let lost = lost.lock().unwrap_or_else(PoisonError::into_inner);
    let gone = lost.iter().find(|(_, node)| node.as_ref().is_some_and(|node| node.addr == host));
    if let Some((rank, Some(node))) = gone {
        tracing::warn!(
            "exit barrier: the store's host, node {node} (group rank {rank}), was reported lost and the store is \
             gone with it; this node's workers finished, so it does not wait any longer"
        );
    }
    gone.is_some()
}

/// Whether the agent of a member at `host` (the store's host) is gone, as a census says.
async fn store_host_is_gone(rdzv: &mut Rendezvous, host: &str) -> bool {
    let Ok(census) = rdzv.census(None).await else { return false };
    let gone = census.gone.iter().find(|(_, node)| node.addr == host);
    if let Some((rank, node)) = gone {
        tracing::warn!(
            "exit barrier: the store's host, node {node} (group rank {rank}), is gone and the store with it; \
             this node's workers finished, so it does not wait any longer"
        );
    }
    gone.is_some()
}
