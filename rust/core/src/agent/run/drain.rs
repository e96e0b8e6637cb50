//! Re-forming for a node that joins at a step boundary: nothing was lost, so interrupting the
//! workers would only throw away the step they compute. Instead the members agree on a step
//! none of their workers has saved yet (the newest step any saved, plus one: the one the
//! furthest computes), every elastic worker stops after its checkpoint save of that step, and
//! the job re-forms from it. A member whose workers cannot stop so (plain workers, no save yet)
//! says so, and every member then interrupts its workers as for any re-form; so does a worker
//! that is past the step when told, and a drain that does not end in time.

use std::time::Duration;

use tokio::time::Instant;

use super::agent::Agent;
use super::changes::{new_change, Changes};
use super::reform::PLACE_DEADLINE;
use super::round_store::connect_store;
use super::watch::Event;
use crate::agent::error::AgentError;
use crate::agent::workers::control::{DrainReport, ToWorker};
use crate::agent::workers::group::WorkerGroup;
use crate::rendezvous::{MembershipChange, RendezvousInfo};

/// How long the members take to agree on the step: their agents see a join within
/// milliseconds of each other (the round's event log); a member that says nothing by then is
/// not waited for (every member interrupts its workers then).
const AGREE_WITHIN: Duration = Duration::from_secs(2);
/// How long the workers may take to reach the agreed step (at most two steps away): past it,
/// they are interrupted.
const DRAIN_WITHIN: Duration = Duration::from_secs(20);
/// How often the agent looks whether a worker it waits for left its line (it exited).
const LOOK_EVERY: Duration = Duration::from_millis(100);
/// What a member whose workers cannot stop at a step publishes instead of its step.
const NO_DRAIN: &[u8] = b"-";

impl Agent {
    /// A node joins: this member's elastic workers stop after the save of the step the
    /// members agree on, and this returns once they did (or it is given up: the re-form then
    /// interrupts them). `Some`: an event that came first and ends the attempt instead (a
    /// signal, another membership change).
    pub(super) async fn drain(
        &mut self,
        info: &RendezvousInfo,
        group: &WorkerGroup,
        changes: &mut Changes,
    ) -> Option<Event> {
        let workers = self.drainable(group);
        if workers.is_none() {
            tracing::info!(
                "a node joins: this node's workers cannot stop at a step (a worker is not on its line, or has saved no \
                 checkpoint yet); the job re-forms by interrupting them"
            );
        }
        let step = self.agree_on_drain_step(info, workers.as_ref().map(|(_, saved)| *saved)).await?;
        let (mut waiting, _) = workers?;
        let control = self.control.as_mut()?;
        let why = format!("a node joins: the job re-forms after step {step}");
        let deadline_ms = PLACE_DEADLINE.as_millis() as u64; // as for an abort
        waiting.retain(|pid| control.send(*pid, &ToWorker::Drain { round: self.round, step, why: &why, deadline_ms }));
        let deadline = Instant::now() + DRAIN_WITHIN;
        tracing::info!(
            "{why}: the workers (pids {waiting:?}) stop after their checkpoint save of step {step}; waiting up to \
             {DRAIN_WITHIN:?}"
        );
        let mut look = tokio::time::interval(LOOK_EVERY);
        while !waiting.is_empty() {
            tokio::select! {
                report = control.drain_report() => match report {
                    DrainReport::Drained(drained) if drained.round == self.round => {
                        waiting.retain(|pid| *pid != drained.pid);
                    }
                    DrainReport::Drained(_) => {}
                    DrainReport::Broken((pid, why)) => {
                        tracing::info!("the collective of worker pid {pid} failed while the workers drained ({why}); interrupting them");
                        return None;
                    }
                },
                _ = look.tick() => waiting.retain(|pid| control.local_rank_of(*pid).is_some()),
                () = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(
                        "the workers (pids {waiting:?}) did not stop after step {step} within {DRAIN_WITHIN:?}; \
                         interrupting them"
                    );
                    return None;
                }
                change = new_change(changes) => match change {
                    // a member whose workers stopped first opened the next round, or more nodes
                    // came: this node's workers still finish their save, the round waits for them
                    MembershipChange::RoundSuperseded { .. } | MembershipChange::NodesWaiting => {}
                    change if change.is_about_the_store() => {}
                    change => return Some(Event::Change(change)),
                },
                (signal, forward) = self.signals.recv() => return Some(Event::Signal(signal, forward)),
            }
        }
        tracing::info!("every worker stopped after its save of step {step}");
        None
    }

    /// This node's elastic workers (pids), and the newest step any of them saved, if every
    /// running worker is on its line and saved a step (only those can stop at a step).
    fn drainable(&self, group: &WorkerGroup) -> Option<(Vec<u32>, u64)> {
        let pids = group.lines(self.control.as_ref()?).into_iter().map(|(_, pid)| pid).collect::<Option<Vec<u32>>>()?;
        let saved = group.saved_steps().into_iter().collect::<Option<Vec<u64>>>()?;
        Some((pids, saved.into_iter().max()?))
    }

    /// Publishes the newest step this node's workers saved (`None`: they cannot stop at a
    /// step) and reads every member's: the step all stop after (the newest any saved, plus
    /// one), or `None` when a member cannot, or did not say in time.
    async fn agree_on_drain_step(&mut self, info: &RendezvousInfo, saved: Option<u64>) -> Option<u64> {
        let keys: Vec<Vec<u8>> =
            (0..info.world_size).map(|rank| format!("{}/drain/{rank}", info.store_prefix).into_bytes()).collect();
        let value = saved.map_or_else(|| NO_DRAIN.to_vec(), |step| step.to_string().into_bytes());
        let secret = self.rdzv.secret().cloned();
        let at = (info.store_host.clone(), info.store_port);
        let agreeing = async {
            let store = connect_store(&mut self.store, &at, secret.as_ref(), AGREE_WITHIN).await?;
            store.set(&keys[info.rank as usize], &value).await?;
            let all: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            Ok::<_, AgentError>(store.multi_get_within(&all, Some(AGREE_WITHIN)).await?)
        };
        let values = match tokio::time::timeout(AGREE_WITHIN * 2, agreeing).await {
            Ok(Ok(values)) => values,
            Ok(Err(err)) => {
                tracing::info!("the members did not agree on a step to stop at ({err}); interrupting the workers");
                return None;
            }
            Err(_) => {
                tracing::info!("the members did not agree on a step to stop at in time; interrupting the workers");
                return None;
            }
        };
        let step = agreed_step(&values);
        if step.is_none() && saved.is_some() {
            tracing::info!("a member's workers cannot stop at a step; interrupting the workers");
        }
        step
    }
}

/// The step every member's workers stop after, from the newest step each member's workers
/// saved: the one after the newest any saved (none has saved it yet, the furthest computes it).
/// `None` when a member cannot stop at a step.
fn agreed_step<V: AsRef<[u8]>>(published: &[V]) -> Option<u64> {
    let steps: Option<Vec<u64>> =
        published.iter().map(|value| std::str::from_utf8(value.as_ref()).ok()?.parse().ok()).collect();
    steps?.into_iter().max().map(|newest| newest + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_members_stop_after_the_step_past_the_newest_any_saved_or_not_at_all() {
        assert_eq!(agreed_step(&["41", "42", "41"]), Some(43));
        assert_eq!(agreed_step(&["7"]), Some(8));
        assert_eq!(agreed_step(&["41", "-", "42"]), None, "a member that cannot stop at a step");
        assert_eq!(agreed_step(&["41", "x"]), None);
        assert_eq!(agreed_step::<&str>(&[]), None);
    }
}
