//! One interface over the rendezvous backends: c10d, etcd, static ([`super::create`] makes
//! the one the launcher names).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::sync::watch;

use super::change::{MembershipChange, RendezvousInfo};
use super::error::Result;
use super::node::NodeDesc;
use super::presence::Census;
use super::records::{AgentFacts, FailureRecord};
use crate::auth::Secret;

/// A backend's answer, later.
pub type Fut<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// Writes this member's [`AgentFacts`] again, from a task of the agent's own (its workers'
/// progress), with a connection of its own: the backend itself is not held.
pub type StatusWriter = std::sync::Arc<dyn Fn(AgentFacts) -> Fut<'static, ()> + Send + Sync>;

fn ready<'a, T: Send + 'a>(value: T) -> Fut<'a, T> {
    Box::pin(std::future::ready(Ok(value)))
}

/// What a rendezvous backend does for an agent. The futures are boxed so that the agent (and
/// the Python binding) can hold whichever backend the configuration names; the defaults are
/// what a backend without shared state (static) does.
pub trait Backend: Send {
    /// Its name, as `--rdzv-backend` takes it.
    fn name(&self) -> &'static str;

    fn run_id(&self) -> &str;

    /// Joins the next round and returns this node's place in it.
    fn next_rendezvous(&mut self) -> Fut<'_, RendezvousInfo>;

    /// Reports that this node's round ended in a failure; returns the restarts so far
    /// (job-wide on the elastic backends, this node's on static).
    fn report_failure(&mut self) -> Fut<'_, i64>;

    /// Counts one restart after a failure; returns the new total.
    fn record_restart(&mut self) -> Fut<'_, i64>;

    fn restart_count(&mut self) -> Fut<'_, i64>;

    /// Where the job's state lives, for messages.
    fn describe_store(&self) -> String;

    /// The job secret the agent's store connections prove (the workers' store's included).
    fn secret(&self) -> Option<&Secret>;

    /// The port of the rendezvous store this agent serves, if it serves one.
    fn hosted_port(&self) -> Option<u16> {
        None
    }

    /// What a store that stopped answering means for this job, and what avoids it (`None`:
    /// nothing to add to the error). Once said, the rendezvous does not say it again for the
    /// same outage.
    fn store_lost_advice(&mut self) -> Option<String> {
        None
    }

    /// How long a member may be silent (heartbeats, lease) before the others count it lost.
    fn loss_window(&self) -> Duration {
        Duration::ZERO
    }

    /// Tells the round's members this node leaves now (`why`: a stop signal), so that they
    /// re-form without it at once rather than a loss window later. Best effort; the default
    /// (no shared state, or a backend whose lease says it) does nothing.
    fn leave<'a>(&'a mut self, _why: &'a str) -> Fut<'a, ()> {
        ready(())
    }

    /// Late nodes waiting for the current round to re-form with them (torch's wait list).
    fn num_nodes_waiting(&mut self) -> Fut<'_, u32> {
        ready(0)
    }

    fn is_closed(&mut self) -> Fut<'_, bool> {
        ready(false)
    }

    /// Ends the job's rendezvous with a reason every node can read back; the first stays.
    fn set_closed_with<'a>(&'a mut self, _reason: &'a str) -> Fut<'a, ()> {
        ready(())
    }

    fn set_closed(&mut self) -> Fut<'_, ()> {
        self.set_closed_with("closed")
    }

    /// Why the job's rendezvous was closed, if it was.
    fn closed_reason(&mut self) -> Fut<'_, Option<String>> {
        ready(None)
    }

    /// Changes that should end the current round.
    fn changes(&self) -> Option<watch::Receiver<Option<MembershipChange>>> {
        None
    }

    /// Publishes what `elastix status` shows about this member.
    fn publish_node_status(&mut self, _facts: AgentFacts) -> Fut<'_, ()> {
        ready(())
    }

    /// Publishes the root cause of this node's last failure, for `elastix status`.
    fn publish_failure<'a>(&'a mut self, _failure: &'a FailureRecord) -> Fut<'a, ()> {
        ready(())
    }

    /// What republishes this member's status in the current round (`None`: no shared state).
    fn status_writer(&self) -> Option<StatusWriter> {
        None
    }

    /// Asks the other members of the current round (`only` these group ranks, if given)
    /// whether their agents are still there, and reports the gone ones lost
    /// ([`super::presence`]).
    fn census<'a>(&'a mut self, _only: Option<&'a [u32]>) -> Fut<'a, Census> {
        ready(Census::default())
    }

    /// The member of the current round with group rank `rank`, as it described itself (its
    /// address and presence port), if the backend keeps members' descriptions.
    fn member_node(&mut self, _rank: u32) -> Fut<'_, Option<NodeDesc>> {
        ready(None)
    }

    /// What ended this node's round without its watcher having said so yet: a newer round
    /// (the others re-formed without it), or a store that lost the round's state.
    fn round_ended(&mut self) -> Fut<'_, Option<MembershipChange>> {
        ready(None)
    }

    /// Where the round's store is now, if it can move (a site list): `None` where the store a
    /// round was given is the only one.
    fn locate_store(&mut self) -> Option<Fut<'_, (String, u16)>> {
        None
    }

    /// Stops this node's part (heartbeats, the workers' store); the rendezvous stays open.
    fn shutdown(&mut self) {}

    /// Before an agent exits: stops its part, and keeps a store it serves up a little (at most
    /// `within`) for the nodes still reading how the job ended.
    fn linger(&mut self, _within: Duration) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        self.shutdown();
        Box::pin(std::future::ready(()))
    }
}
