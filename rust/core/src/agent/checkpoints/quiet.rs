//! Holding back the agent's background checkpoint work while a round restores. Persisting a
//! step and copying one to the buddy each move hundreds of MB, and a new round's restore is on
//! the job's critical path: a node that joins takes its state from a member, and every worker
//! copies its state back out of memory. Measured in the goodput benchmark (2 cores, 256 MB per
//! rank), a joiner's copy took 0.29 s with the machine otherwise quiet and 0.78 s beside the
//! members' persisting and copies. So when a round starts, this node's persisting and its
//! copies to the buddy pause between chunks until the workers train again, which a save newer
//! than any held at the hush tells (or [`MAX_HUSH`] at most: workers that never save, a save
//! that never comes).

use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::persist::newest_slots;

/// The longest a hush lasts: past it, background work goes on whatever the workers do.
pub const MAX_HUSH: Duration = Duration::from_secs(30);
/// How often held-back work looks again.
pub const LOOK_EVERY: Duration = Duration::from_millis(20);

/// Whether this node's background checkpoint work waits.
pub struct Quiet {
    memory: PathBuf,
    /// The newest step saved on this node when the hush began, and when it began.
    hushed: Mutex<Option<(Option<u64>, Instant)>>,
}

impl Quiet {
    /// For the checkpoints in `memory`; not hushed.
    pub fn new(memory: PathBuf) -> Quiet {
        Quiet { memory, hushed: Mutex::new(None) }
    }

    /// Background work waits from now until a newer step than any held now is saved.
    pub fn hush(&self) {
        let newest = self.newest();
        *self.lock() = Some((newest, Instant::now()));
    }

    /// Background work goes on (the run ends: what is in memory must reach the disk).
    pub fn lift(&self) {
        *self.lock() = None;
    }

    /// Whether background work should wait now; a hush that is over is lifted.
    pub fn holding_back(&self) -> bool {
        let Some((newest, since)) = *self.lock() else { return false };
        let over = since.elapsed() >= MAX_HUSH || self.newest() > newest;
        if over {
            let mut hushed = self.lock();
            // the hush looked at, not one a new round began meanwhile
            if hushed.is_some_and(|(_, began)| began == since) {
                *hushed = None;
            }
        }
        !over
    }

    /// Waits while background work is held back (on a blocking thread).
    pub fn wait_blocking(&self) {
        while self.holding_back() {
            std::thread::sleep(LOOK_EVERY);
        }
    }

    /// Waits while background work is held back.
    pub async fn wait(&self) {
        while self.holding_back() {
            tokio::time::sleep(LOOK_EVERY).await;
        }
    }

    /// The newest step any local rank saved (`None < Some(_)`).
    fn newest(&self) -> Option<u64> {
        newest_slots(&self.memory).into_iter().map(|(_, manifest, _)| manifest.step).max()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(Option<u64>, Instant)>> {
        self.hushed.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::checkpoints::layout::fixtures::{manifest, scratch, write_slot};

    #[test]
    fn a_hush_holds_back_until_a_newer_step_is_saved() {
        let memory = scratch("quiet");
        write_slot(&memory, 0, &manifest(0, 7, 4), b"abcd");
        let quiet = Quiet::new(memory.clone());
        assert!(!quiet.holding_back(), "not hushed");
        quiet.hush();
        assert!(quiet.holding_back());
        // the restored step saved again, by another rank too: not newer
        write_slot(&memory, 0, &manifest(1, 7, 4), b"efgh");
        assert!(quiet.holding_back());
        write_slot(&memory, 1, &manifest(0, 8, 4), b"ijkl");
        assert!(!quiet.holding_back(), "the workers train again");
        assert!(!quiet.holding_back(), "and the hush is over");
        let _ = std::fs::remove_dir_all(memory);
    }

    #[test]
    fn a_hush_with_nothing_saved_ends_at_the_first_save_and_a_lift_ends_any() {
        let memory = scratch("quiet-empty");
        let quiet = Quiet::new(memory.clone());
        quiet.hush();
        assert!(quiet.holding_back());
        quiet.lift();
        assert!(!quiet.holding_back());
        quiet.hush();
        write_slot(&memory, 0, &manifest(0, 0, 4), b"abcd");
        assert!(!quiet.holding_back());
        let _ = std::fs::remove_dir_all(memory);
    }
}
