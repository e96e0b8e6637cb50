//! The local worker processes of one attempt: started together, each in its own session and
//! process group with a parent-death signal, all in one cgroup where the job has one; their exits
//! arrive as events (no polling); stopped together (signal, grace period, SIGKILL to each
//! whole group and to the cgroup, every child reaped). A worker whose heartbeat or timer
//! lapsed ([`crate::agent::hangs::heartbeats`]) counts as failed: its stacks are dumped, then it is killed.

use std::collections::BTreeMap;
use std::process::ExitStatus;
use std::sync::PoisonError;
use std::time::{Duration, SystemTime};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::agent::error::Result;
use crate::agent::failure::Failure;
use crate::agent::hangs::dumps::{Asked, DumpRequests, FlightExchange, WorkerStacks};
use crate::agent::hangs::flight::{self, Holdup, RankFlights};
use crate::agent::hangs::heartbeats::{self, Heartbeats, Lapse, Slot};
use crate::agent::hangs::stacks;
use crate::agent::progress;
use crate::agent::stragglers::pace::PaceMeter;
use crate::agent::stragglers::{lock, Meters};
use crate::agent::workers::control::Control;
use crate::agent::workers::env::WorkerPlace;
use crate::agent::workers::reaper::{self, GroupCgroup};
pub use crate::agent::workers::spawn::Launch;
use crate::agent::workers::spawn::{duplicate_files, DuplicateFiles, Exits, Spawner, Worker};
use crate::agent::workers::standby::StandbyPool;
use crate::console;
use crate::rendezvous::records::WorkerProgress;

/// After SIGKILL, how long to wait for the kernel to reap a worker before giving up on it.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// After a worker exits, how long its output may take to drain: longer than a pump may wait
/// for a slow console ([`console::STALL_WAIT`]).
const DRAIN_WAIT: Duration = Duration::from_secs(2);
/// How long a failure's summary waits for the worker's last lines to reach the console.
const CONSOLE_WAIT: Duration = Duration::from_millis(500);
/// How often the heartbeats are read: hangs are found within this of their timeout.
const WATCH_EVERY: Duration = Duration::from_millis(100);

/// How an attempt's workers ended.
#[derive(Debug)]
pub enum GroupOutcome {
    Succeeded,
    /// The workers that failed: the first one, and any others that failed with it (within
    /// [`FAILED_TOGETHER`]), in the order they exited.
    Failed(Vec<Failure>),
}

/// What [`WorkerGroup::wait`] saw.
pub enum Waited {
    Done(GroupOutcome),
    /// Workers found hung, still running: [`WorkerGroup::stop_hung`] describes and stops them,
    /// a step of its own so that no membership change cuts it short and loses what it says.
    Hung(HungWorkers),
}

/// Workers found hung: their indexes, why, and their slots when found.
pub struct HungWorkers(Vec<(usize, Lapse, Slot)>);

/// Workers that fail within this long of the first failure are reported with it, when the
/// failure ends the job (one crash often takes every rank down at once; torchrun reports all
/// it sees at its next look). A failure the job restarts from does not wait: the restart
/// matters more than the list.
pub const FAILED_TOGETHER: Duration = Duration::from_millis(200);

pub struct WorkerGroup {
    workers: Vec<Worker>,
    exits: mpsc::UnboundedReceiver<(usize, std::io::Result<ExitStatus>, SystemTime)>,
    /// For a worker started again alone, its group kept ([`WorkerGroup::restart_exited`]).
    exits_sender: Exits,
    host: String,
    /// Holds the workers and all they start, even what left their process groups.
    cgroup: Option<GroupCgroup>,
    /// The workers' heartbeat slots (`None` if the page could not be made: no hang detection).
    heartbeats: Option<Heartbeats>,
    worker_timeout: Option<Duration>,
    /// Where each watch tick notes the workers' progress, if it is published.
    progress: Option<watch::Sender<Vec<WorkerProgress>>>,
    /// Each worker's pace, measured from its flight recorder at every look.
    meters: Meters,
    /// Watch ticks so far: without `--worker-timeout` the kernel is asked every
    /// [`LOOK_EVERY_WITHOUT_TIMEOUT`]th only (for `elastix status`, read by people).
    ticks: u64,
}

/// See [`WorkerGroup::ticks`].
const LOOK_EVERY_WITHOUT_TIMEOUT: u64 = 10;

impl WorkerGroup {
    /// Starts the workers, each from its standby when `standbys` has one ready.
    pub fn start(launch: &Launch<'_>, standbys: &mut StandbyPool) -> Result<WorkerGroup> {
        let (sender, exits) = mpsc::unbounded_channel();
        let cgroup = reaper::group_cgroup();
        let heartbeats = Heartbeats::for_attempt(launch.config.local_world_size as usize)
            .map_err(|err| tracing::warn!("cannot make the workers' heartbeat page ({err}): no hang detection"))
            .ok();
        let worker_timeout = launch.config.worker_timeout();
        let mut group = WorkerGroup {
            workers: Vec::new(),
            exits,
            exits_sender: sender,
            host: launch.host.to_owned(),
            cgroup,
            heartbeats,
            worker_timeout,
            progress: None,
            meters: Meters::default(),
            ticks: 0,
        };
        let duplicates = duplicate_files(launch)?;
        let spawner = group.spawner(launch, &duplicates);
        let mut workers = Vec::new();
        let mut started = Ok(());
        for local_rank in 0..launch.config.local_world_size {
            match spawner.spawn(local_rank, standbys.take(local_rank)) {
                Ok(worker) => workers.push(worker),
                Err(err) => {
                    started = Err(err);
                    break;
                }
            }
        }
        *lock(&group.meters) = workers.iter().map(|w| (w.place.global_rank, PaceMeter::default())).collect();
        group.workers = workers;
        if let Err(err) = started {
            // leave nothing half-started behind
            group.kill_all();
            return Err(err);
        }
        Ok(group)
    }

    fn spawner<'a>(&'a self, launch: &'a Launch<'a>, duplicates: &'a DuplicateFiles) -> Spawner<'a> {
        Spawner {
            launch,
            duplicates,
            heartbeat_page: self.heartbeats.as_ref().map(Heartbeats::path),
            cgroup: self.cgroup.as_ref().and_then(GroupCgroup::cgroup),
            exits: self.exits_sender.clone(),
        }
    }

    /// Records the exits that came while nobody watched (the agent re-forming the job).
    pub fn collect_exits(&mut self) {
        while let Ok((index, status, at)) = self.exits.try_recv() {
            self.workers[index].exit = Some((status.unwrap_or_else(|_| failed_status()), at));
        }
    }

    /// The running workers, by index, with the pid on their line to the agent if they are on
    /// one (they run `elastix.elastic` and said hello as their local rank, from their own
    /// process or from the Python process that claimed their heartbeat slot under a wrapper).
    pub fn lines(&self, control: &Control) -> Vec<(usize, Option<u32>)> {
        let running = self.workers.iter().enumerate().filter(|(_, w)| w.exit.is_none());
        running
            .map(|(index, worker)| {
                let owner = self.heartbeats.as_ref().and_then(|page| u32::try_from(page.slot(index).owner).ok());
                let on_line = [Some(worker.pid), owner]
                    .into_iter()
                    .flatten()
                    .find(|pid| *pid != 0 && control.local_rank_of(*pid) == Some(worker.place.local_rank));
                (index, on_line)
            })
            .collect()
    }

    /// The step of each running worker's last checkpoint save, as its heartbeat slot says
    /// (`None`: it saved none yet).
    pub fn saved_steps(&self) -> Vec<Option<u64>> {
        let running = self.workers.iter().enumerate().filter(|(_, w)| w.exit.is_none());
        running.map(|(index, _)| self.heartbeats.as_ref().and_then(|page| page.slot(index).saved)).collect()
    }

    /// Starts again, each in its place in `launch`'s round, the workers found exited (see
    /// [`WorkerGroup::collect_exits`]) while the others were kept through a re-form; returns
    /// their indexes.
    pub fn restart_exited(&mut self, launch: &Launch<'_>, standbys: &mut StandbyPool) -> Result<Vec<usize>> {
        let exited: Vec<usize> = (0..self.workers.len()).filter(|i| self.workers[*i].exit.is_some()).collect();
        if exited.is_empty() {
            return Ok(exited);
        }
        let duplicates = duplicate_files(launch)?;
        let mut started = Vec::with_capacity(exited.len());
        for &index in &exited {
            // what the old process left in its process group goes with it
            if !self.workers[index].watch.is_released() {
                let _ = killpg(Pid::from_raw(self.workers[index].pid as i32), Signal::SIGKILL);
            }
            if let Some(page) = &self.heartbeats {
                page.clear(index);
            }
            let worker = self.spawner(launch, &duplicates).spawn(index as u32, standbys.take(index as u32))?;
            lock(&self.meters)[index] = (worker.place.global_rank, PaceMeter::default());
            self.workers[index] = worker;
            started.push(index);
        }
        Ok(started)
    }

    /// Worker `index`'s place (its ranks, as of the round it was started or kept in).
    pub fn place(&self, index: usize) -> &WorkerPlace {
        &self.workers[index].place
    }

    /// Moves kept worker `index` to its place in the next round.
    pub fn move_to(&mut self, index: usize, place: WorkerPlace) {
        lock(&self.meters)[index] = (place.global_rank, PaceMeter::default());
        self.workers[index].place = place;
    }

    /// The workers' pace meters, for the stragglers' exchange.
    pub fn meters(&self) -> Meters {
        self.meters.clone()
    }

    /// Notes the workers' progress in `notes` at every watch tick from now on.
    pub fn note_progress_in(&mut self, notes: watch::Sender<Vec<WorkerProgress>>) {
        self.progress = Some(notes);
    }

    /// The workers' progress, from their slots and what the kernel showed, for whoever
    /// publishes it.
    fn note_progress(&self, now: u64) {
        let (Some(notes), Some(page)) = (&self.progress, &self.heartbeats) else { return };
        let blocked_after = self.worker_timeout.unwrap_or(progress::BLOCKED_AFTER);
        let workers = self.workers.iter().enumerate().map(|(index, w)| {
            progress::progress_of(w.place.global_rank, &page.slot(index), &w.activity, now, blocked_after)
        });
        notes.send_replace(workers.collect());
    }

    pub fn global_ranks(&self) -> Vec<u32> {
        self.workers.iter().map(|w| w.place.global_rank).collect()
    }

    pub fn pids(&self) -> Vec<u32> {
        self.workers.iter().map(|w| w.pid).collect()
    }

    /// Waits until a worker fails or hangs, or every worker has succeeded; answers stack dump
    /// requests meanwhile, and looks after the next attempt's `standbys` once a second.
    /// Workers that fail within `together` of a first failure are reported with it (zero:
    /// those that already did).
    pub async fn wait(&mut self, dumps: &mut DumpRequests, standbys: &mut StandbyPool, together: Duration) -> Waited {
        let mut ticks = tokio::time::interval(WATCH_EVERY);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                exit = self.exits.recv() => {
                    let Some((index, status, at)) = exit else { return Waited::Done(GroupOutcome::Succeeded) };
                    let status = status.unwrap_or_else(|_| failed_status());
                    self.workers[index].exit = Some((status, at));
                    if !status.success() {
                        let mut failed = vec![index];
                        failed.extend(self.failing_together(together).await);
                        let mut failures = Vec::with_capacity(failed.len());
                        for index in failed {
                            failures.push(self.failure(index).await);
                        }
                        return Waited::Done(GroupOutcome::Failed(failures));
                    }
                    if self.workers.iter().all(|w| w.exit.is_some()) {
                        return Waited::Done(GroupOutcome::Succeeded);
                    }
                }
                _ = ticks.tick(), if self.heartbeats.is_some() => {
                    if self.ticks % LOOK_EVERY_WITHOUT_TIMEOUT == 0 {
                        standbys.check();
                    }
                    let now = heartbeats::now_ns();
                    let hung = self.hung(now);
                    self.note_progress(now);
                    if !hung.is_empty() {
                        return Waited::Hung(HungWorkers(hung));
                    }
                }
                Some(asked) = dumps.next() => {
                    match asked {
                        Asked::Stacks { rank, answer } => drop(answer.send(self.dump_stacks(rank).await)),
                        Asked::Flights { answer } => {
                            drop(answer.send(self.rank_flights(&mut BTreeMap::new()).await))
                        }
                    }
                }
            }
        }
    }

    /// The stacks of the running workers (of global rank `rank` only, if given).
    async fn dump_stacks(&self, rank: Option<u32>) -> Vec<WorkerStacks> {
        let mut answers = Vec::new();
        for (index, worker) in self.workers.iter().enumerate() {
            if worker.exit.is_some() || rank.is_some_and(|rank| rank != worker.place.global_rank) {
                continue;
            }
            let (stacks, error) = match self.stacks_of(index).await {
                Ok(stacks) => (Some(stacks), None),
                Err(why) => (None, Some(why)),
            };
            answers.push(WorkerStacks {
                rank: worker.place.global_rank,
                local_rank: worker.place.local_rank,
                pid: worker.pid,
                stacks,
                error,
            });
        }
        answers
    }

    /// Worker `index`'s threads' stacks, dumped now (or why there are none).
    async fn stacks_of(&self, index: usize) -> StacksOrWhy {
        let worker = &self.workers[index];
        let signal = self.heartbeats.as_ref().map_or(0, |page| page.slot(index).dump_signal);
        stacks::dump(worker.pid, signal, &worker.stacks_file).await
    }

    /// The running workers whose heartbeat or timer lapsed, or whose main thread has not run
    /// while their processes used no CPU, with their slots, as of `now`.
    fn hung(&mut self, now: u64) -> Vec<(usize, Lapse, Slot)> {
        let Some(page) = &self.heartbeats else { return Vec::new() };
        self.ticks += 1;
        let look = self.worker_timeout.is_some() || self.ticks % LOOK_EVERY_WITHOUT_TIMEOUT == 1;
        let mut hung = Vec::new();
        let mut meters = lock(&self.meters);
        for (index, worker) in self.workers.iter_mut().enumerate().filter(|(_, w)| w.exit.is_none()) {
            meters[index].1.look(&page.flights(index));
            let slot = page.slot(index);
            crate::metrics::agent::get().worker_heartbeat_at(index as u32, heartbeats::instant(slot.last_beat));
            // the process that claimed the slot (the Python worker, under any wrapper) is watched
            let watched = u32::try_from(slot.owner).ok().filter(|owner| *owner != 0).map(|owner| {
                if look {
                    worker.activity.look(now, owner);
                }
                &worker.activity
            });
            if let Some(lapse) = slot.lapse(now, self.worker_timeout, watched) {
                hung.push((index, lapse, slot));
            }
        }
        hung
    }

    /// Dumps the stacks of hung workers, kills them and describes them as failures.
    pub async fn stop_hung(&mut self, hung: HungWorkers, exchange: Option<&FlightExchange>) -> Vec<Failure> {
        let mut described = Vec::with_capacity(hung.0.len());
        for (index, lapse, slot) in hung.0 {
            described.push((index, lapse, heartbeats::wall_time(slot.last_beat), self.stacks_of(index).await));
        }
        // before anyone is killed: the ranks waited for are asked for their stacks too
        let mut dumped: BTreeMap<usize, StacksOrWhy> = described.iter().map(|d| (d.0, d.3.clone())).collect();
        let holdup = self.holdup(&mut dumped, exchange).await;
        // a rank waited for is the cause even if it has not lapsed itself: it goes with them
        for index in self.held_up_for(holdup.as_ref(), &described) {
            let last = self.heartbeats.as_ref().and_then(|page| heartbeats::wall_time(page.slot(index).last_beat));
            let stacks = match dumped.remove(&index) {
                Some(stacks) => stacks,
                None => self.stacks_of(index).await,
            };
            described.push((index, Lapse::HoldsOthersUp, last, stacks));
        }
        for (index, lapse, _, stacks) in &described {
            let worker = &self.workers[*index];
            let name = worker.place.name(Some(worker.pid));
            let why = holdup.as_ref().map_or_else(|| lapse.to_string(), |holdup| format!("{lapse}; {holdup}"));
            match stacks {
                Ok(stacks) => tracing::warn!(
                    "{name} is hung: {why}; killing it. Its stacks (kept in {}):\n{stacks}",
                    worker.stacks_file.display()
                ),
                Err(no) => tracing::warn!("{name} is hung: {why}; killing it (no stacks: {no})"),
            }
            let _ = killpg(Pid::from_raw(worker.pid as i32), Signal::SIGKILL);
        }
        let deadline = tokio::time::Instant::now() + KILL_WAIT;
        while described.iter().any(|(index, ..)| self.workers[*index].exit.is_none()) {
            match tokio::time::timeout_at(deadline, self.exits.recv()).await {
                Ok(Some((index, status, at))) => {
                    self.workers[index].exit = Some((status.unwrap_or_else(|_| failed_status()), at));
                }
                _ => break,
            }
        }
        let mut failures = Vec::with_capacity(described.len());
        for (index, lapse, last, stacks) in described {
            if self.workers[index].exit.is_none() {
                self.workers[index].exit = Some((killed_status(), SystemTime::now()));
            }
            failures.push(self.failure(index).await.hung(&lapse, holdup.as_ref(), last, stacks));
        }
        failures
    }

    /// The running workers of this node that `holdup` says the others wait for, and that are
    /// not among the hung ones already.
    fn held_up_for(&self, holdup: Option<&Holdup>, described: &[HungWorker]) -> Vec<usize> {
        let Some(holdup) = holdup else { return Vec::new() };
        (0..self.workers.len())
            .filter(|index| self.workers[*index].exit.is_none() && !described.iter().any(|d| d.0 == *index))
            .filter(|index| holdup.is_missing(self.workers[*index].place.global_rank))
            .collect()
    }

    /// The collective the hung workers wait in for ranks that never entered it, from every
    /// running worker's flight records, and in a job of several nodes from the other nodes'
    /// too (asked through `exchange` when no rank of this node is the one waited for).
    async fn holdup(
        &self,
        dumped: &mut BTreeMap<usize, StacksOrWhy>,
        exchange: Option<&FlightExchange>,
    ) -> Option<Holdup> {
        let mut records = self.rank_flights(dumped).await;
        let local = flight::holdup(&records);
        let Some(exchange) = exchange.filter(|_| records.iter().any(|record| record.in_flight().is_some())) else {
            return local;
        };
        exchange.share(&records).await;
        if local.is_some() {
            return local;
        }
        records.extend(exchange.gather().await);
        flight::holdup(&records)
    }

    /// Every running worker's flight records, with where its main thread is for those not
    /// inside a collective (the ones others may wait for): from its stacks in `dumped`, else
    /// dumped now and kept there.
    async fn rank_flights(&self, dumped: &mut BTreeMap<usize, StacksOrWhy>) -> Vec<RankFlights> {
        let Some(page) = &self.heartbeats else { return Vec::new() };
        let mut records = Vec::new();
        for (index, worker) in self.workers.iter().enumerate().filter(|(_, w)| w.exit.is_none()) {
            let mut record = RankFlights { rank: worker.place.global_rank, flights: page.flights(index), at: None };
            if record.in_flight().is_none() {
                if let std::collections::btree_map::Entry::Vacant(entry) = dumped.entry(index) {
                    entry.insert(self.stacks_of(index).await);
                }
                record.at = dumped[&index].as_deref().ok().and_then(flight::main_thread_frame);
            }
            records.push(record);
        }
        records
    }

    /// The other workers that fail within `window` of a first failure.
    async fn failing_together(&mut self, window: Duration) -> Vec<usize> {
        let until = tokio::time::Instant::now() + window;
        let mut failed = Vec::new();
        while let Ok(Some((index, status, at))) = tokio::time::timeout_at(until, self.exits.recv()).await {
            let status = status.unwrap_or_else(|_| failed_status());
            self.workers[index].exit = Some((status, at));
            if !status.success() {
                failed.push(index);
            }
            if self.workers.iter().all(|w| w.exit.is_some()) {
                break;
            }
        }
        failed
    }

    async fn failure(&mut self, index: usize) -> Failure {
        let worker = &mut self.workers[index];
        // the exit can overtake the last lines of stderr (often the traceback): drain first
        worker.pumps = drain(std::mem::take(&mut worker.pumps)).await;
        // and on the console before the agent's summary (unless stderr is not being read)
        console::stderr().flush(CONSOLE_WAIT).await;
        let (status, at) = worker.exit.expect("recorded before");
        let tail: Vec<String> =
            worker.stderr_tail.lock().unwrap_or_else(PoisonError::into_inner).iter().cloned().collect();
        Failure::new(
            worker.place.global_rank,
            worker.place.local_rank,
            &self.host,
            worker.pid,
            exit_code(status),
            at,
            &worker.place.error_file,
            &tail,
        )
    }

    /// Waits up to `DRAIN_WAIT` for the workers' output to be read to the end (after they
    /// exited); what is still running then is left to finish by itself.
    pub async fn drain_output(&mut self) {
        drop(drain(self.take_pumps()).await);
    }

    /// Sends `signal` to every running worker's process group.
    pub fn signal_all(&self, signal: Signal) {
        for worker in self.workers.iter().filter(|w| w.exit.is_none()) {
            let _ = killpg(Pid::from_raw(worker.pid as i32), signal);
        }
    }

    /// Stops every worker: `signal` to each process group, up to `grace` for them to exit,
    /// then SIGKILL; every worker is reaped, and what is left of its process group is killed.
    pub async fn stop(&mut self, signal: Signal, grace: Duration) {
        self.signal_all(signal);
        if !self.reap_until(tokio::time::Instant::now() + grace).await {
            self.signal_all(Signal::SIGKILL);
            if !self.reap_until(tokio::time::Instant::now() + KILL_WAIT).await {
                let stuck: Vec<u32> = self.workers.iter().filter(|w| w.exit.is_none()).map(|w| w.pid).collect();
                tracing::warn!(
                    "workers {stuck:?} did not exit after SIGKILL (uninterruptible sleep?); giving up on them"
                );
            }
        }
        self.kill_all();
        // a grandchild that kept a pipe open must not hold the agent
        for pump in drain(self.take_pumps()).await {
            pump.abort();
        }
    }

    fn take_pumps(&mut self) -> Vec<JoinHandle<()>> {
        self.workers.iter_mut().flat_map(|w| std::mem::take(&mut w.pumps)).collect()
    }

    /// Collects exits until all workers have exited (true) or the deadline passed (false).
    async fn reap_until(&mut self, deadline: tokio::time::Instant) -> bool {
        while self.workers.iter().any(|w| w.exit.is_none()) {
            match tokio::time::timeout_at(deadline, self.exits.recv()).await {
                Ok(Some((index, status, at))) => {
                    self.workers[index].exit = Some((status.unwrap_or_else(|_| failed_status()), at));
                }
                Ok(None) | Err(_) => return false,
            }
        }
        true
    }

    /// SIGKILL to every worker's process group, exited or not, and to the group's cgroup:
    /// nothing they started survives, not even what left their process groups.
    fn kill_all(&self) {
        // a group found empty after its worker was reaped is not signalled: its id may be reused
        for worker in self.workers.iter().filter(|w| !w.watch.is_released()) {
            let _ = killpg(Pid::from_raw(worker.pid as i32), Signal::SIGKILL);
        }
        if let Some(cgroup) = &self.cgroup {
            cgroup.kill();
        }
    }
}

impl Drop for WorkerGroup {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// A worker found hung: its index, why, its last heartbeat and its stacks (or why none).
type HungWorker = (usize, Lapse, Option<SystemTime>, StacksOrWhy);
/// A worker's stacks, or why there are none.
type StacksOrWhy = std::result::Result<String, String>;

/// Waits up to [`DRAIN_WAIT`] for output pumps to reach EOF; returns those still running.
async fn drain(pumps: Vec<JoinHandle<()>>) -> Vec<JoinHandle<()>> {
    let deadline = tokio::time::Instant::now() + DRAIN_WAIT;
    let mut running = Vec::new();
    for mut pump in pumps {
        if tokio::time::timeout_at(deadline, &mut pump).await.is_err() {
            running.push(pump);
        }
    }
    running
}

/// Python's convention: the exit code, or minus the signal that killed the process.
pub fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status.code().unwrap_or_else(|| -status.signal().unwrap_or(0))
}

fn failed_status() -> ExitStatus {
    use std::os::unix::process::ExitStatusExt;
    ExitStatus::from_raw(1 << 8)
}

/// What a worker killed by SIGKILL and never reaped counts as.
fn killed_status() -> ExitStatus {
    use std::os::unix::process::ExitStatusExt;
    ExitStatus::from_raw(libc::SIGKILL)
}
