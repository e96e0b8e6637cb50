//! Whether a member's loss explains the workers' failure: a node's death breaks its peers'
//! collectives at once, a loss window before its heartbeats lapse.

use std::time::Duration;

use super::agent::Agent;
use super::changes::{next_change, Changes};
use crate::agent::error::{AgentError, Result};
use crate::rendezvous::{MembershipChange, Rendezvous};

/// Beyond the loss window, how long a failure waits for a silent member to be reported lost
/// (the monitor's reading of the store, and its report, take a moment).
const LOSS_VERDICT_SLACK: Duration = Duration::from_secs(2);

impl Agent {
    /// Whether the workers failed because a member of the round is gone: a node's death
    /// breaks its peers' collectives at once, a loss window before its heartbeats lapse. The
    /// members' agents are asked directly ([`Rendezvous::census`]; the gone ones are reported
    /// lost to everyone); a member that does not answer is settled by its heartbeats or lease,
    /// waited for up to a loss window when `patience` says so. `Some`: the change that
    /// explains the failure.
    pub(super) async fn member_loss(
        &mut self,
        changes: &mut Changes,
        patience: Patience,
    ) -> Result<Option<MembershipChange>> {
        // another member may have found the loss first
        if let Some(change) = changes.as_ref().and_then(|changes| changes.borrow().clone()) {
            return Ok(Some(change));
        }
        // Asking goes through the store, which may be what was lost: bounded by the loss
        // window, after which the heartbeats have settled it, and a signal ends it at once.
        let window = self.rdzv.loss_window() + LOSS_VERDICT_SLACK;
        let verdict = tokio::select! {
            verdict = tokio::time::timeout(window, ask_members(&mut self.rdzv)) => match verdict {
                Ok(verdict) => verdict,
                // the heartbeats had the window to settle it
                Err(_) => return Ok(changes.as_ref().and_then(|changes| changes.borrow().clone())),
            },
            change = next_change(changes) => return Ok(Some(change)),
            (signal, _) = self.signals.recv() => return Err(AgentError::Interrupted(signal)),
        };
        let unsure = match verdict {
            Verdict::Change(change) => return Ok(Some(change)),
            Verdict::Own => return Ok(None),
            // the store went with the failure (its host is lost, or this node is cut off): the
            // rendezvous noted it as the round's change; re-joining finds the store, or its
            // next site, or says why not
            Verdict::StoreUnreachable(error) => {
                let noted = changes.as_ref().and_then(|changes| changes.borrow().clone());
                let store = self.rdzv.describe_store();
                return Ok(noted.or(Some(MembershipChange::StoreUnreachable {
                    store,
                    silent_for: Duration::ZERO,
                    error,
                })));
            }
            Verdict::Unsure(unsure) => unsure,
        };
        if patience == Patience::Answers {
            tracing::info!("{} did not answer: the heartbeats will tell", unsure.join(", "));
            return Ok(None);
        }
        tracing::info!(
            "the workers failed and {} did not answer; waiting up to {window:.1?} for the heartbeats to say whether it is lost",
            unsure.join(", ")
        );
        tokio::select! {
            change = tokio::time::timeout(window, next_change(changes)) => Ok(change.ok()),
            (signal, _) = self.signals.recv() => Err(AgentError::Interrupted(signal)),
        }
    }
}

/// How long a question about a member's loss waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Patience {
    /// For the answers and the probes only: a suspicion while the workers run on.
    Answers,
    /// Then for the heartbeats of the members that did not answer, up to a loss window: the
    /// workers failed and wait for the verdict.
    Heartbeats,
}

/// What asking the round's members found after the workers failed.
enum Verdict {
    /// The round ended, or a member is gone: the workers' failure is its consequence.
    Change(MembershipChange),
    /// Every member answered: the failure is the workers' own.
    Own,
    /// The store does not answer (the error).
    StoreUnreachable(String),
    /// These members did not answer.
    Unsure(Vec<String>),
}

/// Asks the round whether it ended without this node's watcher saying so yet (the others
/// re-formed without it while its agent was stopped, or the store lost the state), then asks
/// every member directly ([`Rendezvous::census`]; the gone ones are reported lost to everyone).
async fn ask_members(rdzv: &mut Rendezvous) -> Verdict {
    match rdzv.round_ended().await {
        Ok(Some(change)) => return Verdict::Change(change),
        Err(err) if err.is_store_unreachable() => return Verdict::StoreUnreachable(err.to_string()),
        _ => {}
    }
    match rdzv.census(None).await {
        Ok(census) => match census.gone.into_iter().next() {
            Some((rank, node)) => Verdict::Change(MembershipChange::NodeLost { rank: Some(rank), node: Some(node) }),
            None if census.unsure.is_empty() => Verdict::Own,
            None => {
                Verdict::Unsure(census.unsure.iter().map(|(rank, why)| format!("group rank {rank} ({why})")).collect())
            }
        },
        Err(err) if err.is_store_unreachable() => Verdict::StoreUnreachable(err.to_string()),
        Err(err) => {
            tracing::warn!("could not ask the other members whether they are still there ({err}); counting the failure as the workers' own");
            Verdict::Own
        }
    }
}

/// A membership change in the words of the agent's log, events and summary.
pub(super) fn describe(change: &MembershipChange) -> String {
    match change {
        MembershipChange::NodesWaiting => "new nodes are waiting to join".to_owned(),
        MembershipChange::NodeLost { rank, node } => match (node, rank) {
            (Some(node), Some(rank)) => format!("node {node} (group rank {rank}) stopped responding"),
            (Some(node), None) => format!("node {node} stopped responding"),
            (None, Some(rank)) => format!("group rank {rank} stopped responding"),
            (None, None) => "a node stopped responding".to_owned(),
        },
        MembershipChange::RoundSuperseded { round } => format!("another node restarted (round {round})"),
        MembershipChange::StoreReset => "the rendezvous store restarted without the job's state".to_owned(),
        // Said from this node's side only: it cannot tell a store that is down for everyone
        // from one out of its own reach (the last error often can: a refused connection).
        MembershipChange::StoreUnreachable { store, silent_for, error } if silent_for.is_zero() => {
            format!("the rendezvous store at {store} stopped answering as the workers failed ({error})")
        }
        MembershipChange::StoreUnreachable { store, silent_for, error } => format!(
            "the rendezvous store at {store} has not answered this node for {:.1}s (last error: {error}); \
             a node out of contact this long counts as lost to any node the store still answers",
            silent_for.as_secs_f64()
        ),
        MembershipChange::StoreMoved { to } => format!("the job's rendezvous moved to {to}"),
        MembershipChange::Minority { reached, silent } => format!(
            "this node has reached no majority of the rendezvous sites for the loss window (it reaches {}; not {}): \
             it is on the minority side of a partition, where the job must not run",
            if reached.is_empty() { "none".to_owned() } else { reached.join(", ") },
            silent.join(", ")
        ),
        MembershipChange::Closed => "the job's rendezvous was closed".to_owned(),
    }
}
