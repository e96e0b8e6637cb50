//! Who is a straggler: a rank that, measurement after measurement, computes clearly longer
//! between collectives than the others do (its pace against the median of the others' latest
//! paces), while they wait for it. A slow measurement alone names no one, and neither does a
//! job-wide slowdown (every rank slower alike is no rank slower than the others). Each rank's
//! measurements come at its own rate (a pace needs a few collectives, and slow steps take
//! longer to give them), so each is counted once, when it is new, against the others' latest.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::pace::Pace;
use crate::agent::hangs::flight::KINDS;

/// A rank whose compute takes this many times the others' median is behind (NVIDIA's
/// resiliency extension marks a straggler at a relative score under 0.75: 1 / 0.75).
pub const SLOWER: f64 = 1.0 / 0.75;
/// And by at least this much, per collective: a loop of microseconds is all noise.
const MIN_BEHIND_MS: f64 = 2.0;
/// Pairs of collectives a rank's pace needs to count (a meter keeps counting until it has them).
pub const MIN_SAMPLES: u32 = 3;
/// Measurements in a row behind before a rank is named, and not behind before it is cleared.
pub const NAME_AFTER: u32 = 2;
const CLEAR_AFTER: u32 = 3;

/// A rank's standing in the last window: its pace and its score (the others' median compute
/// over its own: 1 keeps pace, under 0.75 is behind).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Standing {
    pub rank: u32,
    pub node: String,
    pub score: f64,
    pub compute_ms: f64,
    pub others_ms: f64,
    /// Named a straggler (since `since_ms`, ms since the epoch).
    pub straggler: bool,
    pub since_ms: Option<u64>,
    /// The collective the others wait in for it.
    pub waited_in: String,
}

/// What changed in a window.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    Named(Standing),
    Cleared(Standing),
}

/// Each rank's run of windows behind (or caught up, once named).
#[derive(Debug, Default)]
pub struct Judge {
    runs: BTreeMap<u32, Run>,
}

#[derive(Debug, Default)]
struct Run {
    /// The last of the rank's measurements counted.
    counted: Option<u32>,
    behind: u32,
    caught_up: u32,
    named_since: Option<u64>,
}

impl Judge {
    /// Judges one window's paces (`(node, pace)` of every rank heard from) at `now_ms`: every
    /// rank's standing, and who was named or cleared.
    pub fn window(&mut self, paces: &[(String, Pace)], now_ms: u64) -> (Vec<Standing>, Vec<Change>) {
        let counted: Vec<&(String, Pace)> = paces.iter().filter(|(_, pace)| pace.samples >= MIN_SAMPLES).collect();
        let mut standings = Vec::with_capacity(counted.len());
        let mut changes = Vec::new();
        // sorted once: each rank's "others" are the sorted list without it (one judge reads
        // every rank of a job of thousands of nodes every window)
        let mut sorted: Vec<f64> = counted.iter().map(|(_, pace)| pace.compute_ms).collect();
        sorted.sort_by(f64::total_cmp);
        for (node, pace) in &counted {
            let at = sorted.partition_point(|ms| ms.total_cmp(&pace.compute_ms).is_lt());
            let Some(others_ms) = median_without(&sorted, at) else { continue }; // alone: nobody to be behind
            let score = if pace.compute_ms > 0.0 { (others_ms / pace.compute_ms).min(1.0) } else { 1.0 };
            let behind = pace.compute_ms >= others_ms * SLOWER && pace.compute_ms - others_ms >= MIN_BEHIND_MS;
            let run = self.runs.entry(pace.rank).or_default();
            let was_named = run.named_since.is_some();
            if run.counted != Some(pace.taken) {
                run.count(behind, now_ms);
                run.counted = Some(pace.taken);
            }
            let standing = Standing {
                rank: pace.rank,
                node: node.clone(),
                score,
                compute_ms: pace.compute_ms,
                others_ms,
                straggler: run.named_since.is_some(),
                since_ms: run.named_since,
                waited_in: KINDS.get(usize::from(pace.kind)).copied().unwrap_or("?").to_owned(),
            };
            match (was_named, standing.straggler) {
                (false, true) => changes.push(Change::Named(standing.clone())),
                (true, false) => changes.push(Change::Cleared(standing.clone())),
                _ => {}
            }
            standings.push(standing);
        }
        (standings, changes)
    }
}

impl Run {
    /// One new measurement: behind the others or not.
    fn count(&mut self, behind: bool, now_ms: u64) {
        if behind {
            self.behind += 1;
            self.caught_up = 0;
        } else {
            self.behind = 0;
            self.caught_up += 1;
        }
        if behind && self.behind >= NAME_AFTER && self.named_since.is_none() {
            self.named_since = Some(now_ms);
        } else if self.named_since.is_some() && self.caught_up >= CLEAR_AFTER {
            self.named_since = None;
        }
    }
}

/// The median of `sorted` without its element at `skip` (`None`: nothing left).
fn median_without(sorted: &[f64], skip: usize) -> Option<f64> {
    let left = sorted.len().checked_sub(1).filter(|left| *left > 0)?;
    let nth = |n: usize| sorted[if n < skip { n } else { n + 1 }];
    let mid = left / 2;
    Some(if left % 2 == 1 { nth(mid) } else { (nth(mid - 1) + nth(mid)) / 2.0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(rank: u32, compute_ms: f64, taken: u32) -> (String, Pace) {
        (format!("node{rank}"), Pace { rank, compute_ms, wait_ms: 1.0, samples: 10, kind: 1, taken })
    }

    fn pace(rank: u32, compute_ms: f64) -> (String, Pace) {
        measured(rank, compute_ms, 0)
    }

    /// A window in which every rank's pace is a new measurement.
    fn window(judge: &mut Judge, computes: &[f64], at: u64) -> (Vec<Standing>, Vec<Change>) {
        let paces: Vec<_> =
            computes.iter().enumerate().map(|(rank, ms)| measured(rank as u32, *ms, at as u32)).collect();
        judge.window(&paces, at)
    }

    #[test]
    fn a_rank_behind_window_after_window_is_named_then_cleared_once_it_keeps_pace() {
        let mut judge = Judge::default();
        let (standings, changes) = window(&mut judge, &[100.0, 101.0, 200.0, 99.0], 1);
        assert!(changes.is_empty(), "one window names no one");
        assert!((standings[2].score - 0.5).abs() < 0.01, "{standings:?}");
        let (_, changes) = window(&mut judge, &[100.0, 101.0, 190.0, 99.0], 2);
        let [Change::Named(named)] = changes.as_slice() else { panic!("{changes:?}") };
        assert_eq!((named.rank, named.node.as_str(), named.since_ms), (2, "node2", Some(2)));
        assert_eq!(named.waited_in, "all_reduce");
        assert!((named.others_ms - 100.0).abs() < 1e-9);
        // still behind: named once
        assert!(window(&mut judge, &[100.0, 100.0, 200.0, 100.0], 3).1.is_empty());
        // keeping pace again: cleared after a few windows, not at once
        assert!(window(&mut judge, &[100.0, 100.0, 100.0, 100.0], 4).1.is_empty());
        assert!(window(&mut judge, &[100.0, 100.0, 100.0, 100.0], 5).1.is_empty());
        let (standings, changes) = window(&mut judge, &[100.0, 100.0, 100.0, 100.0], 6);
        assert!(matches!(changes.as_slice(), [Change::Cleared(s)] if s.rank == 2), "{changes:?}");
        assert!(standings.iter().all(|s| !s.straggler));
    }

    #[test]
    fn noise_a_slow_window_and_a_job_wide_slowdown_name_no_one() {
        let mut judge = Judge::default();
        let noisy = [[100.0, 112.0, 95.0, 120.0], [118.0, 97.0, 104.0, 101.0], [99.0, 125.0, 100.0, 93.0]];
        for (at, computes) in noisy.iter().enumerate() {
            assert!(window(&mut judge, computes, at as u64).1.is_empty());
        }
        // one rank slow for one window only, between normal ones
        for (at, computes) in [[100.0, 300.0, 100.0, 100.0], [100.0, 100.0, 100.0, 100.0]].iter().enumerate() {
            assert!(window(&mut judge, computes, 10 + at as u64).1.is_empty());
        }
        // everyone twice as slow, for long
        for at in 20..30 {
            let (standings, changes) = window(&mut judge, &[200.0, 205.0, 198.0, 201.0], at);
            assert!(changes.is_empty() && standings.iter().all(|s| s.score > 0.9), "{standings:?}");
        }
        // microsecond loops: twice as slow, yet far under the absolute floor
        for at in 30..40 {
            assert!(window(&mut judge, &[0.01, 0.02, 0.01, 0.01], at).1.is_empty());
        }
    }

    #[test]
    fn each_measurement_counts_once_against_the_others_latest() {
        let mut judge = Judge::default();
        // rank 2's one slow measurement, seen in three windows: not named
        for at in 0..3 {
            let paces = [measured(0, 100.0, at), measured(1, 100.0, at), measured(2, 200.0, 0)];
            let (standings, changes) = judge.window(&paces, u64::from(at));
            assert!(changes.is_empty(), "{changes:?}");
            assert!((standings[2].score - 0.5).abs() < 0.01, "still shown: {standings:?}");
        }
        // its next one, against the others' paces of earlier windows: named
        let paces = [measured(0, 100.0, 2), measured(1, 100.0, 2), measured(2, 200.0, 1)];
        let (_, changes) = judge.window(&paces, 3);
        assert!(matches!(changes.as_slice(), [Change::Named(s)] if s.rank == 2), "{changes:?}");
    }

    #[test]
    fn the_median_of_the_others_leaves_out_the_rank_judged() {
        let sorted = [1.0, 2.0, 4.0, 8.0];
        assert_eq!(median_without(&sorted, 0), Some(4.0));
        assert_eq!(median_without(&sorted, 2), Some(2.0));
        assert_eq!(median_without(&sorted, 3), Some(2.0));
        assert_eq!(median_without(&[1.0, 2.0, 4.0], 1), Some(2.5));
        assert_eq!(median_without(&[5.0, 7.0], 1), Some(5.0));
        assert_eq!(median_without(&[5.0], 0), None);
        assert_eq!(median_without(&[], 0), None);
    }

    #[test]
    fn two_ranks_are_judged_against_each_other_and_thin_windows_are_not_judged() {
        let mut judge = Judge::default();
        for at in 0..2 {
            window(&mut judge, &[100.0, 150.0], at);
        }
        assert!(judge.runs[&1].named_since.is_some(), "1.5x the other rank");
        let mut judge = Judge::default();
        let thin =
            |rank, ms| (format!("n{rank}"), Pace { rank, compute_ms: ms, wait_ms: 0.0, samples: 1, kind: 1, taken: 0 });
        for at in 0..5 {
            let (standings, changes) = judge.window(&[thin(0, 100.0), thin(1, 300.0)], at);
            assert!(standings.is_empty() && changes.is_empty());
        }
        let (standings, _) = judge.window(&[pace(0, 100.0)], 9);
        assert!(standings.is_empty(), "a rank alone is behind no one");
    }
}
