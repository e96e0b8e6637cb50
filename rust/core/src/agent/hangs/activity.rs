//! What the kernel says a worker did, the evidence automatic hang detection rests on: whether
//! its main thread ran at all, and whether the worker, with the processes it started, used CPU.
//!
//! A thread that waits (in `recv()`, on a lock, in `Event.wait()`, in `time.sleep()`) is off
//! the CPU and the kernel counts nothing for it; the moment it wakes, however briefly, its run
//! count and CPU time (`/proc/<pid>/task/<tid>/schedstat`) go up. So a loop of short sleeps or
//! short I/O waits shows its main thread running at every wake, while a main thread blocked
//! for good shows nothing at all, even while a side thread (a logger, a data thread) wakes now
//! and then. A sampled frame and line cannot tell these apart: a loop that spends its time on
//! one line looks the same at every sample.
//!
//! What it cannot see: a main thread blocked for good while another thread (or a child
//! process) keeps computing. That is a worker busy with something, maybe for good reason (the
//! main thread joins a thread that computes); it is shown as "blocked, process busy" and never
//! killed on this evidence. A worker whose main thread spins without progress (a busy loop) is
//! busy too: only explicit heartbeats can tell.

use std::collections::VecDeque;
use std::time::Duration;

pub use crate::rendezvous::records::Doing;

/// The span CPU use is measured over.
pub const WINDOW: Duration = Duration::from_secs(1);
/// The share of one CPU over [`WINDOW`] that counts as busy: a blocked process's side threads
/// waking now and then (a timer, a logger) use a tiny fraction of that.
pub const BUSY_SHARE: f64 = 0.1;
/// Processes of a worker's tree read at most (a runaway fork loop must not cost the agent).
const TREE_LIMIT: usize = 256;
/// How often a worker's tree is read at most while its main thread does not run: the CPU is
/// judged over [`WINDOW`], and a torch worker has dozens of threads to look under.
const TREE_EVERY: Duration = Duration::from_millis(250);

/// A reading that changes whenever thread `tid` of process `pid` has run: its CPU time in
/// nanoseconds and the number of times it was put on a CPU (`schedstat`), else, on a kernel
/// without schedstat, its context switches (a thread that never runs never switches).
pub fn thread_runs(pid: u32, tid: u32) -> Option<(u64, u64)> {
    let task = format!("/proc/{pid}/task/{tid}");
    if let Ok(text) = std::fs::read_to_string(format!("{task}/schedstat")) {
        let mut fields = text.split_whitespace().map(str::parse::<u64>);
        if let (Some(Ok(ran_ns)), Some(Ok(_waited)), Some(Ok(runs))) = (fields.next(), fields.next(), fields.next()) {
            return Some((ran_ns, runs));
        }
    }
    let status = std::fs::read_to_string(format!("{task}/status")).ok()?;
    let count = |name: &str| -> Option<u64> {
        let line = status.lines().find(|line| line.starts_with(name))?;
        line[name.len()..].trim_start_matches(':').trim().parse().ok()
    };
    Some((count("voluntary_ctxt_switches")?, count("nonvoluntary_ctxt_switches")?))
}

/// The CPU time (user + system, all threads, and children it waited for) of process `pid`, in
/// clock ticks.
fn process_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // the command name (field 2) is in parentheses and may hold spaces: count after it
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    // fields 14 to 17 (utime, stime, cutime, cstime) are the 12th to 15th after the name
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    let cutime: u64 = fields.next()?.parse().ok()?;
    let cstime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime + cutime + cstime)
}

/// The processes any thread of `pid` started that still run.
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    let mut found = Vec::new();
    for task in tasks.flatten() {
        if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
            found.extend(text.split_whitespace().filter_map(|child| child.parse::<u32>().ok()));
        }
    }
    found
}

/// The CPU time of process `pid` and of every process below it, in clock ticks (`None`: it is
/// gone). A data loader's processes, a compiler the worker waits for: their work is its work.
pub fn tree_ticks(pid: u32) -> Option<u64> {
    let mut total = process_ticks(pid)?;
    let mut pending = children(pid);
    let mut seen = 0;
    while let Some(child) = pending.pop() {
        seen += 1;
        if seen > TREE_LIMIT {
            break;
        }
        if let Some(ticks) = process_ticks(child) {
            total += ticks;
            pending.extend(children(child));
        }
    }
    Some(total)
}

/// Clock ticks a second (asked once: it never changes while the system runs).
fn ticks_per_second() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        // SAFETY: sysconf takes a plain integer and touches no memory of ours.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        u64::try_from(ticks).ok().filter(|t| *t > 0).unwrap_or(100)
    })
}

/// What one look at a worker's process found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reading {
    /// [`thread_runs`] of its main thread (`None`: it could not be read).
    pub main_runs: Option<(u64, u64)>,
    /// [`tree_ticks`] (`None`: not read; it is only when the main thread did not run).
    pub tree_ticks: Option<u64>,
}

/// One worker's activity as the agent has seen it.
#[derive(Debug, Default)]
pub struct Activity {
    /// The last reading of the main thread.
    main_runs: Option<(u64, u64)>,
    /// The last moment (monotonic ns) its main thread was seen to have run; 0: not watched yet.
    main_ran_at: u64,
    /// (when, tree ticks) over the last [`WINDOW`], oldest first.
    samples: VecDeque<(u64, u64)>,
    /// The last moment it was busy; 0: never seen busy.
    busy_at: u64,
}

impl Activity {
    /// Looks at process `pid` (the worker's main process) at `now_ns`: its main thread (whose
    /// id is the pid), and, when that did not run, the CPU time of its tree.
    pub fn look(&mut self, now_ns: u64, pid: u32) {
        let main_runs = thread_runs(pid, pid);
        let ran = main_runs.is_some() && main_runs != self.main_runs;
        let due =
            self.samples.back().map_or(true, |(at, _)| now_ns.saturating_sub(*at) >= TREE_EVERY.as_nanos() as u64);
        let tree_ticks = if ran || !due { None } else { tree_ticks(pid) };
        self.observe(now_ns, Reading { main_runs, tree_ticks });
    }

    /// Takes in what a look at `now_ns` found.
    pub fn observe(&mut self, now_ns: u64, reading: Reading) {
        let ran = reading.main_runs.is_some() && reading.main_runs != self.main_runs;
        if self.main_ran_at == 0 || ran {
            // the first look counts as a run: the watch starts then
            self.main_ran_at = now_ns;
        }
        if reading.main_runs.is_some() {
            self.main_runs = reading.main_runs;
        }
        if ran {
            // CPU use is beside the point now, and a gap in the samples must not pass for a
            // busy stretch later
            self.samples.clear();
        }
        if let Some(ticks) = reading.tree_ticks {
            self.observe_cpu(now_ns, ticks);
        }
    }

    fn observe_cpu(&mut self, now_ns: u64, ticks: u64) {
        let window = WINDOW.as_nanos() as u64;
        while self.samples.len() > 1 && self.samples[1].0 + window <= now_ns {
            self.samples.pop_front();
        }
        if let Some(&(then, before)) = self.samples.front() {
            let elapsed = now_ns.saturating_sub(then).max(1) as f64 / 1e9;
            let used = ticks.saturating_sub(before) as f64 / ticks_per_second() as f64;
            // judged over a full window only: two samples 100 ms apart say little
            if now_ns.saturating_sub(then) * 2 >= window && used >= BUSY_SHARE * elapsed {
                self.busy_at = now_ns;
            }
        }
        self.samples.push_back((now_ns, ticks));
    }

    /// An activity whose main thread last ran at `main_ran_at`, busy last at `busy_at`.
    #[cfg(test)]
    pub fn seen(main_ran_at: u64, busy_at: u64) -> Activity {
        Activity { main_ran_at, busy_at, ..Activity::default() }
    }

    /// The last moment its main thread was seen to have run (monotonic ns; 0: never watched).
    pub fn main_ran_at(&self) -> u64 {
        self.main_ran_at
    }

    /// The last moment its processes were busy (monotonic ns; 0: never).
    pub fn busy_at(&self) -> u64 {
        self.busy_at
    }

    /// What it looks like at `now_ns`; `blocked_after`: how long a main thread that does not
    /// run must wait before a busy process counts as blocked (`None`: never watched).
    pub fn doing(&self, now_ns: u64, blocked_after: Duration) -> Option<Doing> {
        if self.main_ran_at == 0 {
            return None;
        }
        let idle = Duration::from_nanos(now_ns.saturating_sub(self.main_ran_at));
        let busy = self.busy_at != 0 && Duration::from_nanos(now_ns.saturating_sub(self.busy_at)) <= WINDOW * 2;
        Some(match (idle >= WINDOW, busy) {
            (false, _) => Doing::Running,
            (true, true) if idle >= blocked_after => Doing::BlockedBusy,
            (true, true) => Doing::Running,
            (true, false) => Doing::Waiting,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn main_only(runs: u64) -> Reading {
        Reading { main_runs: Some((runs * 1000, runs)), tree_ticks: None }
    }

    #[test]
    fn a_main_thread_that_wakes_at_all_has_run() {
        let mut sleeper = Activity::default();
        for step in 0..50u64 {
            // a loop of 0.1 s sleeps: one wake (a few microseconds of CPU) per look
            sleeper.observe(step * 100 * MS, main_only(step));
        }
        assert_eq!(sleeper.main_ran_at(), 49 * 100 * MS);
        assert_eq!(sleeper.doing(49 * 100 * MS, Duration::from_secs(2)), Some(Doing::Running));
    }

    #[test]
    fn a_blocked_main_thread_is_seen_blocked_whatever_side_threads_do() {
        let hz = ticks_per_second();
        let mut blocked = Activity::default();
        let mut busy = Activity::default();
        for step in 0..30u64 {
            let now = step * 100 * MS;
            // the main thread's counts never change; a side thread ticks now and then
            blocked.observe(now, Reading { main_runs: Some((5, 1)), tree_ticks: Some(step / 25) });
            // another thread computes: a whole CPU
            busy.observe(now, Reading { main_runs: Some((5, 1)), tree_ticks: Some(step * hz / 10) });
        }
        let now = 29 * 100 * MS;
        assert_eq!(blocked.busy_at(), 0, "a tick now and then is not busy");
        assert_eq!(blocked.doing(now, Duration::from_secs(2)), Some(Doing::Waiting));
        assert_eq!(busy.busy_at(), now);
        assert_eq!(busy.doing(now, Duration::from_secs(2)), Some(Doing::BlockedBusy));
        assert_eq!(busy.doing(now, Duration::from_secs(5)), Some(Doing::Running), "not blocked for long yet");
        assert_eq!(Activity::default().doing(now, Duration::ZERO), None, "never watched");
    }

    #[test]
    fn cpu_is_judged_afresh_after_the_main_thread_ran() {
        let hz = ticks_per_second();
        let mut activity = Activity::default();
        activity.observe(0, Reading { main_runs: Some((1, 1)), tree_ticks: Some(0) });
        activity.observe(100 * MS, main_only(2));
        // ticks accumulated while unread must not count as one burst over the gap
        activity.observe(2000 * MS, Reading { main_runs: Some((2000, 2)), tree_ticks: Some(10 * hz) });
        activity.observe(2100 * MS, Reading { main_runs: Some((2000, 2)), tree_ticks: Some(10 * hz) });
        assert_eq!(activity.busy_at(), 0);
    }

    #[test]
    fn this_process_and_its_threads_can_be_read() {
        let pid = std::process::id();
        let before = thread_runs(pid, pid).expect("the main thread");
        let start = tree_ticks(pid).unwrap();
        let until = std::time::Instant::now() + Duration::from_millis(200);
        let mut x = 0u64;
        while std::time::Instant::now() < until {
            x = x.wrapping_add(1);
        }
        assert!(x > 0 && tree_ticks(pid).unwrap() > start);
        // the test runs on another thread than main: main's counts are its own
        assert!(thread_runs(pid, pid).is_some_and(|after| after >= before));
        assert_eq!(tree_ticks(u32::MAX), None);
        assert_eq!(thread_runs(u32::MAX, u32::MAX), None);
    }

    #[test]
    fn a_child_processes_cpu_counts_for_its_parent() {
        let mut child = std::process::Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let pid = std::process::id();
        let (mine, tree) = (process_ticks(pid).unwrap(), tree_ticks(pid).unwrap());
        let found = children(pid);
        let _ = child.kill();
        let _ = child.wait();
        assert!(found.contains(&child.id()), "{found:?}");
        assert!(tree > mine, "the spinning child's ticks count: {tree} > {mine}");
    }
}
