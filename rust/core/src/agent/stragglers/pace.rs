//! A rank's pace, from its flight recorder: how long it computes between two collectives of the
//! world group (from the end of one to its entry into the next) and how long it then waits
//! inside. Both are read on the rank's own clock, so no clock is compared across machines: a
//! slow rank computes longer between collectives, and the others wait longer inside them.

use serde::{Deserialize, Serialize};

use crate::agent::hangs::heartbeats::Flight;

/// The world group's number (elastix.collectives names it "0").
const WORLD: u64 = 0;

/// One rank's pace over a window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pace {
    pub rank: u32,
    /// Mean time computing before a collective, and waiting inside it, in ms.
    pub compute_ms: f64,
    pub wait_ms: f64,
    /// Pairs of consecutive collectives measured.
    pub samples: u32,
    /// The kind of collective it waited in longest (elastix.collectives' numbering).
    pub kind: u8,
    /// Which of its meter's paces this is (0 for the first): a member writes its ranks' latest
    /// pace every window, and a judge counts each measurement once.
    pub taken: u32,
}

/// Measures one worker's pace from the flights its slot shows at each look.
#[derive(Debug, Default)]
pub struct PaceMeter {
    /// The last finished world collective seen: its number and end.
    last: Option<(u64, u64)>,
    compute_ns: u64,
    wait_ns: u64,
    samples: u32,
    /// Time waited per kind of collective, this window.
    waits: [u64; 16],
    /// Paces taken so far.
    taken: u32,
}

impl PaceMeter {
    /// Takes in what the slot shows now (oldest first). A flight is read while the worker may
    /// write it: one that does not add up (ends before it began, a number out of order) is
    /// skipped, and a number that starts again (a new world group, after a re-form) starts the
    /// count afresh.
    pub fn look(&mut self, flights: &[Flight]) {
        for flight in flights.iter().filter(|f| f.group == WORLD && f.finished != 0 && f.finished >= f.entered) {
            match self.last {
                Some((seq, _)) if flight.seq == seq => continue,
                Some((seq, end)) if flight.seq == seq + 1 && flight.entered >= end => {
                    self.compute_ns += flight.entered - end;
                    let wait = flight.finished - flight.entered;
                    self.wait_ns += wait;
                    self.waits[usize::from(flight.kind) % 16] += wait;
                    self.samples += 1;
                }
                Some((seq, end)) if flight.seq < seq && flight.entered < end => continue, // an older one
                _ => {}
            }
            self.last = Some((flight.seq, flight.finished));
        }
    }

    /// The pace since the last one taken, once at least `enough` pairs were measured (then the
    /// count starts again; before, it goes on: slow steps are judged over longer spans).
    pub fn take(&mut self, rank: u32, enough: u32) -> Option<Pace> {
        if self.samples < enough.max(1) {
            return None;
        }
        let samples = std::mem::take(&mut self.samples);
        let (compute, wait) = (std::mem::take(&mut self.compute_ns), std::mem::take(&mut self.wait_ns));
        let waits = std::mem::take(&mut self.waits);
        if samples == 0 {
            return None;
        }
        let kind = (0..waits.len()).max_by_key(|kind| waits[*kind]).unwrap_or(0) as u8;
        let mean_ms = |ns: u64| ns as f64 / f64::from(samples) / 1e6;
        let taken = self.taken;
        self.taken += 1;
        Some(Pace { rank, compute_ms: mean_ms(compute), wait_ms: mean_ms(wait), samples, kind, taken })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn flight(seq: u64, entered_ms: u64, finished_ms: u64) -> Flight {
        Flight { kind: 1, group: WORLD, seq, bytes: 8, entered: entered_ms * MS, finished: finished_ms * MS }
    }

    #[test]
    fn compute_is_the_gap_between_collectives_and_wait_the_time_inside() {
        let mut meter = PaceMeter::default();
        // 10 ms of compute, then 2 ms inside, each time; seen twice over (looks overlap)
        meter.look(&[flight(1, 0, 2), flight(2, 12, 14)]);
        meter.look(&[flight(2, 12, 14), flight(3, 24, 26), flight(4, 36, 38)]);
        assert_eq!(meter.take(7, 4), None, "three pairs are not enough for four");
        let pace = meter.take(7, 3).unwrap();
        assert_eq!((pace.rank, pace.samples, pace.kind, pace.taken), (7, 3, 1, 0));
        assert!((pace.compute_ms - 10.0).abs() < 1e-9 && (pace.wait_ms - 2.0).abs() < 1e-9, "{pace:?}");
        assert_eq!(meter.take(7, 1), None, "counted again from there");
        // the next one goes on from the last collective seen
        meter.look(&[flight(5, 48, 50)]);
        let next = meter.take(7, 1).unwrap();
        assert_eq!((next.samples, next.taken), (1, 1));
    }

    #[test]
    fn torn_unfinished_missed_and_other_groups_flights_are_not_measured() {
        let mut meter = PaceMeter::default();
        let running = Flight { finished: 0, ..flight(2, 12, 0) };
        let torn = Flight { finished: MS, ..flight(2, 12, 0) }; // ends before it began
        let subgroup = Flight { group: 3, ..flight(2, 12, 14) };
        meter.look(&[flight(1, 0, 2), running, torn, subgroup]);
        assert_eq!(meter.take(0, 1), None);
        // collectives 2 and 3 were overwritten before a look: no gap spans them
        meter.look(&[flight(4, 40, 42)]);
        assert_eq!(meter.take(0, 1), None);
        meter.look(&[flight(5, 52, 54)]);
        assert_eq!(meter.take(0, 1).unwrap().samples, 1);
    }

    #[test]
    fn a_new_world_group_starts_the_count_again() {
        let mut meter = PaceMeter::default();
        meter.look(&[flight(40, 0, 2), flight(41, 12, 14)]);
        meter.take(0, 1);
        // re-formed: the new group's collectives are numbered from 1, later in time
        meter.look(&[flight(1, 5000, 5002), flight(2, 5012, 5014)]);
        let pace = meter.take(0, 1).unwrap();
        assert_eq!(pace.samples, 1);
        assert!((pace.compute_ms - 10.0).abs() < 1e-9);
    }
}
