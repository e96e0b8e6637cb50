//! Whether a worker burns CPU: a worker inside one long C call (a big matmul, a hash) shows no
//! progress from Python, yet is busy, not hung. The agent reads the worker's CPU time from
//! `/proc/<pid>/stat` each time it looks at the heartbeats, and counts the worker active while
//! it used at least [`BUSY_SHARE`] of a CPU over the last [`WINDOW`]: a blocked process's
//! occasional tick (a sampling thread, a timer) never reaches that.

use std::collections::VecDeque;
use std::time::Duration;

/// The span CPU use is measured over.
pub const WINDOW: Duration = Duration::from_secs(1);
/// The share of one CPU over [`WINDOW`] that counts as busy.
pub const BUSY_SHARE: f64 = 0.1;

/// The CPU time (user + system, all threads) of process `pid`, in clock ticks.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // the command name (field 2) is in parentheses and may hold spaces: count after it
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    // fields 14 and 15 (utime, stime) are the 12th and 13th after the name
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
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

/// One worker's recent CPU use.
#[derive(Debug, Default)]
pub struct CpuActivity {
    /// (when, ticks) over the last [`WINDOW`], oldest first.
    samples: VecDeque<(u64, u64)>,
    /// The last moment (monotonic ns) it was busy; 0: never seen busy.
    busy_at: u64,
}

impl CpuActivity {
    /// Records that the process had used `ticks` at `now_ns`.
    pub fn observe(&mut self, now_ns: u64, ticks: u64) {
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

    /// The last moment it was busy (monotonic ns; 0: never).
    pub fn busy_at(&self) -> u64 {
        self.busy_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn a_busy_process_is_seen_busy_and_a_blocked_one_is_not() {
        let hz = ticks_per_second();
        let mut busy = CpuActivity::default();
        let mut blocked = CpuActivity::default();
        for step in 0..30u64 {
            let now = step * 100 * MS;
            busy.observe(now, step * hz / 10); // a whole CPU
            blocked.observe(now, step / 25); // a tick now and then
        }
        assert_eq!(busy.busy_at(), 29 * 100 * MS);
        assert_eq!(blocked.busy_at(), 0);
    }

    #[test]
    fn this_process_has_a_cpu_time() {
        let start = cpu_ticks(std::process::id()).unwrap();
        let mut x = 0u64;
        let until = std::time::Instant::now() + Duration::from_millis(200);
        while std::time::Instant::now() < until {
            x = x.wrapping_add(1);
        }
        assert!(x > 0 && cpu_ticks(std::process::id()).unwrap() > start);
        assert_eq!(cpu_ticks(u32::MAX), None);
    }
}
