//! Each worker's progress (heartbeats, step, when last seen) for `elastix status`. The group
//! notes it from the heartbeat page at every watch tick (a send on a watch channel, never a
//! wait), and a task of the agent's own republishes the member's status with it at most
//! every [`PUBLISH_EVERY`]: the control loop never waits on the store for it.

use std::collections::HashMap;
use std::time::{Duration, UNIX_EPOCH};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::agent::hangs::activity::Activity;
use crate::agent::hangs::heartbeats::{self, Slot};
use crate::agent::stragglers::{lock, Standings};
use crate::rendezvous::backend::StatusWriter;
use crate::rendezvous::records::{AgentFacts, HeldCheckpoint, RankPace, WorkerProgress};

/// What the agent holds of each global rank's checkpoints now.
pub type HeldView = std::sync::Arc<dyn Fn() -> HashMap<u32, HeldCheckpoint> + Send + Sync>;

/// How often a member's progress reaches the store at most: `elastix status` is read by
/// people, and a job of thousands of nodes must not turn it into load.
const PUBLISH_EVERY: Duration = Duration::from_secs(5);
/// Bound on one write: a store that does not answer is tried again next time.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// Without `--worker-timeout`, how long a main thread that does not run while its processes
/// are busy takes to show as blocked.
pub const BLOCKED_AFTER: Duration = Duration::from_secs(10);

/// The task that publishes one attempt's progress; stopped when dropped.
pub struct ProgressPublisher {
    task: JoinHandle<()>,
}

impl ProgressPublisher {
    /// Republishes `facts` with the workers' progress whenever the returned sender has news,
    /// with their checkpoints as `held` shows them then, and their paces as `standings` do.
    pub fn start(
        writer: StatusWriter,
        facts: AgentFacts,
        held: Option<HeldView>,
        standings: Standings,
    ) -> (ProgressPublisher, watch::Sender<Vec<WorkerProgress>>) {
        let (sender, mut news) = watch::channel(Vec::<WorkerProgress>::new());
        let task = tokio::spawn(async move {
            while news.changed().await.is_ok() {
                let mut workers = news.borrow_and_update().clone();
                {
                    let paces = lock(&standings);
                    for worker in &mut workers {
                        worker.pace = paces.get(&worker.rank).map(|s| RankPace {
                            score: s.score,
                            compute_ms: s.compute_ms,
                            others_ms: s.others_ms,
                            straggler: s.straggler,
                        });
                    }
                }
                if let Some(held) = &held {
                    let checkpoints = held();
                    for worker in &mut workers {
                        worker.checkpoint = checkpoints.get(&worker.rank).cloned();
                    }
                }
                let write = writer(AgentFacts { workers, ..facts.clone() });
                match tokio::time::timeout(WRITE_TIMEOUT, write).await {
                    Ok(Ok(())) => {}
                    Ok(Err(err)) => tracing::debug!("could not publish the workers' progress: {err}"),
                    Err(_) => tracing::debug!("publishing the workers' progress took over {WRITE_TIMEOUT:?}; skipped"),
                }
                tokio::time::sleep(PUBLISH_EVERY).await;
            }
        });
        (ProgressPublisher { task }, sender)
    }
}

impl Drop for ProgressPublisher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What global rank `rank`'s slot, and what the kernel showed of it (`activity`), say of its
/// progress at `now`; a main thread that has not run for `blocked_after` while the processes
/// are busy shows as blocked.
pub fn progress_of(rank: u32, slot: &Slot, activity: &Activity, now: u64, blocked_after: Duration) -> WorkerProgress {
    let seen = heartbeats::wall_time(slot.last_beat.max(activity.main_ran_at()));
    let seen_ms = seen.and_then(|at| at.duration_since(UNIX_EPOCH).ok()).map(|since| since.as_millis() as u64);
    let doing = activity.doing(now, blocked_after);
    WorkerProgress { rank, beats: slot.beats, step: slot.step, seen_ms, doing, checkpoint: None, pace: None }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_is_seen_at_its_last_beat_or_run_whichever_is_later() {
        let now = heartbeats::now_ns();
        let slot = Slot { last_beat: now - 3_000_000_000, beats: 7, step: Some(41), ..Slot::default() };
        let mut activity = Activity::default();
        activity.observe(
            now - 1_000_000_000,
            crate::agent::hangs::activity::Reading { main_runs: Some((1, 1)), tree_ticks: None },
        );
        let progress = progress_of(5, &slot, &activity, now, BLOCKED_AFTER);
        let age_ms = crate::rendezvous::records::now_ms() - progress.seen_ms.unwrap();
        assert!((900..1500).contains(&age_ms), "{age_ms}");
        assert_eq!((progress.rank, progress.beats, progress.step), (5, 7, Some(41)));
        assert_eq!(
            progress.doing,
            Some(crate::agent::hangs::activity::Doing::Waiting),
            "its main thread waits a second"
        );
        let never = progress_of(0, &Slot::default(), &Activity::default(), now, BLOCKED_AFTER);
        assert_eq!((never.seen_ms, never.doing), (None, None), "never seen");
    }
}
