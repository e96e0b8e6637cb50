//! The pace of the workers' saves, read from the slots they saved. A re-form that nothing
//! forces to start at once (a node waits to join; this node was asked to stop) may wait for
//! the end of the step in progress: once every local worker saved it, the step is kept rather
//! than computed again.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::layout::{rank_dir, read_slot, SLOTS};

/// How this node's workers save: the newest step every one of them saved, and the longest
/// time between the last two saves of one of them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pace {
    pub newest: u64,
    pub every: Duration,
}

/// The pace of the workers of global ranks `ranks` (their slots under `memory`); `None` when
/// one of them has not saved twice (no pace to go by).
pub fn pace(memory: &Path, ranks: &[u32]) -> Option<Pace> {
    let mut found: Option<Pace> = None;
    for rank in ranks {
        let dir = rank_dir(memory, *rank);
        let mut saves: Vec<(u64, f64)> = (0..SLOTS)
            .filter_map(|slot| read_slot(&dir, *rank, slot))
            .map(|(manifest, _)| (manifest.step, manifest.saved))
            .collect();
        saves.sort_unstable_by_key(|(step, _)| *step);
        let [.., (_, before), (newest, last)] = saves[..] else { return None };
        let every = Duration::try_from_secs_f64(last - before).unwrap_or_default();
        found = Some(match found {
            None => Pace { newest, every },
            Some(pace) => Pace { newest: pace.newest.min(newest), every: pace.every.max(every) },
        });
    }
    found
}

/// [`pace`], read off the control loop.
pub async fn read(memory: PathBuf, ranks: Vec<u32>) -> Option<Pace> {
    tokio::task::spawn_blocking(move || pace(&memory, &ranks)).await.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::checkpoints::layout::fixtures::{manifest, scratch, write_slot};

    fn save(memory: &Path, rank: u32, slot: u32, step: u64, saved: f64) {
        write_slot(memory, slot, &super::super::layout::SlotManifest { saved, ..manifest(rank, step, 4) }, b"data");
    }

    #[test]
    fn the_newest_step_all_saved_and_the_slowest_interval() {
        let memory = scratch("pace");
        save(&memory, 0, 0, 7, 100.0);
        save(&memory, 0, 1, 8, 101.0);
        save(&memory, 1, 2, 6, 99.5);
        save(&memory, 1, 0, 7, 101.5);
        // rank 2 is another round's: not asked about
        save(&memory, 2, 0, 90, 50.0);
        let found = pace(&memory, &[0, 1]).unwrap();
        assert_eq!(found, Pace { newest: 7, every: Duration::from_secs(2) });
    }

    #[test]
    fn no_pace_before_every_rank_saved_twice() {
        let memory = scratch("pace-once");
        save(&memory, 0, 0, 7, 100.0);
        save(&memory, 0, 1, 8, 101.0);
        save(&memory, 1, 0, 8, 101.0);
        assert_eq!(pace(&memory, &[0, 1]), None);
        assert_eq!(pace(&memory, &[5]), None);
        assert!(pace(&memory, &[0]).is_some());
    }

    #[test]
    fn a_clock_that_went_back_is_no_interval_not_a_panic() {
        let memory = scratch("pace-clock");
        save(&memory, 0, 0, 7, 100.0);
        save(&memory, 0, 1, 8, 90.0);
        assert_eq!(pace(&memory, &[0]).unwrap().every, Duration::ZERO);
    }
}
