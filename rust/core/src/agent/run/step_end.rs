//! Re-forming at the end of a step. A re-form that nothing forces to start at once (a node
//! waits to join; this node was asked to stop) lets the workers finish the step in progress
//! and save it first: the step is kept, not computed again after the re-form. The wait follows
//! the workers' own pace (half as long again as between their last two saves), is skipped
//! where they save rarely or have not saved twice, and a signal, another change or a worker's
//! failed collective ends it.

use std::time::Duration;

use tokio::time::Instant;

use super::agent::Agent;
use super::changes::{new_change, Changes};
use super::watch::{next_broken, Event};
use crate::agent::checkpoints::pace;
use crate::rendezvous::MembershipChange;

/// Saves further apart than this are not waited for: the step is computed again instead.
const LONGEST_STEP: Duration = Duration::from_secs(5);
/// How often the workers' slots are read while waiting.
const POLL: Duration = Duration::from_millis(10);

impl Agent {
    /// Waits, at most `cap`, until every local worker (global ranks `ranks`) saved the step it
    /// is in, before `what` ("a node waits to join; re-forming"). What ended the wait early (a
    /// signal, another change), if anything did.
    pub(super) async fn at_step_end(
        &mut self,
        ranks: &[u32],
        changes: &mut Changes,
        what: &str,
        cap: Duration,
    ) -> Option<Event> {
        // no checkpoints, or not saved twice yet: no step end to wait for
        let memory = self.checkpoints.as_ref().map(|checkpoints| checkpoints.memory().to_owned());
        let found = match &memory {
            Some(memory) => pace::read(memory.clone(), ranks.to_vec()).await.map(|pace| (memory, pace)),
            None => None,
        };
        let Some((memory, pace)) = found else {
            tracing::info!("{what}");
            return None;
        };
        if pace.every > LONGEST_STEP {
            tracing::info!(
                "{what} now (this node's workers save every {:.1?}: their step is computed again)",
                pace.every
            );
            return None;
        }
        let within = pace.every.mul_f64(1.5).min(cap);
        tracing::info!(
            "{what} once this node's workers saved the step after {} (they save every {:.0?}; waiting up to \
             {within:.1?})",
            pace.newest,
            pace.every
        );
        let until = Instant::now() + within;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(POLL) => {}
                // another node re-forming first is most likely this same join: every member
                // lets its own workers save the step, so that all hold it for the restore
                change = new_change(changes) => {
                    if !matches!(change, MembershipChange::NodesWaiting | MembershipChange::RoundSuperseded { .. }) {
                        return Some(Event::Change(change));
                    }
                }
                (signal, forward) = self.signals.recv() => return Some(Event::Signal(signal, forward)),
                // a member is gone (a host lost as another node came): the step cannot end
                broken = next_broken(&mut self.control) => {
                    let (pid, why) = &broken[0];
                    tracing::info!("the collective of worker pid {pid} failed ({why}): not waiting for its step");
                    return None;
                }
            }
            if let Some(now) = pace::read(memory.to_owned(), ranks.to_vec()).await {
                if now.newest > pace.newest {
                    tracing::info!("this node's workers saved step {}", now.newest);
                    return None;
                }
            }
            if Instant::now() >= until {
                tracing::info!("no save of this node's workers within {within:.1?}: their step is computed again");
                return None;
            }
        }
    }
}
