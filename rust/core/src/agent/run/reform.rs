//! Re-forming in process: workers that run `elastix.elastic` are not restarted when the job
//! re-forms (a member lost or joined, another node restarted, this node's own worker failed).
//! Their agent tells them at once to stop their collectives, keeps them through the
//! rendezvous, and gives them their place in the next round; only the workers that exited are
//! started again. Plain workers are stopped and started as before.

use std::time::Duration;

use super::agent::Agent;
use crate::agent::error::Result;
use crate::agent::workers::control::{Control, ToWorker};
use crate::agent::workers::env::{worker_env, WorkerPlace};
use crate::agent::workers::group::{Launch, WorkerGroup};
use crate::agent::workers::standby::StandbyPool;

/// How long a kept worker waits for its next place before it gives up and exits. The agent's
/// own bounds (the join timeout, the rank exchange) end a re-form first, and an agent that
/// gives up stops its workers; this is the worker's backstop should its agent vanish.
pub(super) const PLACE_DEADLINE: Duration = Duration::from_secs(900);

impl Agent {
    /// Keeps `group` through the re-form `why` if every running worker runs `elastix.elastic`:
    /// tells each to stop its collectives now and holds the group for the next round. Gives the
    /// group back when it cannot be kept.
    pub(super) async fn keep(&mut self, group: WorkerGroup, why: &str) -> Option<WorkerGroup> {
        let Some(control) = self.control.as_ref() else { return Some(group) };
        let lines = group.lines(control);
        let Some(pids) = lines.iter().map(|(_, pid)| *pid).collect::<Option<Vec<u32>>>() else { return Some(group) };
        if pids.is_empty() {
            return Some(group);
        }
        let deadline_ms = PLACE_DEADLINE.as_millis() as u64;
        let told =
            pids.iter().filter(|pid| control.send(**pid, &ToWorker::Abort { round: self.round, why, deadline_ms }));
        if told.count() < pids.len() {
            // a worker left its line meanwhile: it could not be told where to go next
            return Some(group);
        }
        tracing::info!("the workers (pids {pids:?}) run elastix.elastic: they stay up and re-form in process");
        self.events.workers_kept(self.round, &pids, why).await;
        self.kept = Some(group);
        None
    }

    /// Stops the workers kept for a re-form that will not come (the run ends).
    pub(super) async fn stop_kept(&mut self) {
        if let Some(mut group) = self.kept.take() {
            group.stop(nix::sys::signal::Signal::SIGTERM, self.config.shutdown_timeout()).await;
            self.events.workers_stopped(self.round, "ended").await;
        }
    }
}

/// The kept `group` in `launch`'s round: the workers that exited meanwhile are started again,
/// each of the others is told its new place.
pub(super) fn place_kept(
    mut group: WorkerGroup,
    launch: &Launch<'_>,
    control: &Control,
    standbys: &mut StandbyPool,
) -> Result<WorkerGroup> {
    group.collect_exits();
    let lines = group.lines(control);
    let restarted = group.restart_exited(launch, standbys)?;
    for (index, pid) in lines {
        let place = WorkerPlace::new(
            group.place(index).local_rank,
            launch.assignment,
            launch.restart_count,
            group.place(index).error_file.clone(),
        );
        let env = worker_env(launch.config, launch.info, launch.assignment, &place);
        let told = pid.is_some_and(|pid| control.send(pid, &ToWorker::Assign { round: launch.info.round, env: &env }));
        if !told {
            // it exits by itself at its deadline, or is found hung, and is started again then
            tracing::warn!("{} left its line to the agent before its new place reached it", place.name(pid));
        }
        group.move_to(index, place);
    }
    if !restarted.is_empty() {
        let ranks: Vec<u32> = restarted.iter().map(|index| group.place(*index).global_rank).collect();
        tracing::info!("started again the workers that exited (ranks {ranks:?}); the others re-form in process");
    }
    Ok(group)
}
