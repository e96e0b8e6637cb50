//! Who holds everyone up. When workers hang in a collective, the ones waiting inside it are not
//! the cause: a peer that never entered it is. Each rank's flight recorder (its last few
//! collectives, in its heartbeat slot: [`crate::agent::hangs::heartbeats::Flight`]) says where it is; merged,
//! they name the ranks that wait, the collective they wait in, and the ranks they wait for,
//! with where those are (the main thread's innermost frame, from their stack dump).

use serde::{Deserialize, Serialize};

use crate::agent::hangs::heartbeats::Flight;

/// The collectives' kinds, by the number their records (and descriptors) carry; Python's
/// elastix.collectives.descriptor takes them from here.
pub const KINDS: [&str; 11] = [
    "?",
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "barrier",
    "send/recv",
];

/// The world group's number (elastix.collectives names it "0").
const WORLD: u64 = 0;

/// What one rank's slot and stacks say (shared between nodes as JSON).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankFlights {
    pub rank: u32,
    /// Oldest first.
    pub flights: Vec<Flight>,
    /// Where its main thread is ([`main_thread_frame`]), if its stacks were dumped.
    pub at: Option<String>,
}

impl RankFlights {
    /// The collective it is inside, if any.
    pub fn in_flight(&self) -> Option<Flight> {
        self.flights.last().filter(|flight| flight.finished == 0).copied()
    }
}

/// Ranks waiting inside one collective for ranks that never entered it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holdup {
    pub waiting: Vec<u32>,
    pub kind: &'static str,
    pub group: u64,
    pub seq: u64,
    /// The ranks waited for, with where each one is (if its stacks say).
    pub missing: Vec<(u32, Option<String>)>,
}

impl Holdup {
    /// Whether the waiting ranks wait for `rank`.
    pub fn is_missing(&self, rank: u32) -> bool {
        self.missing.iter().any(|(missing, _)| *missing == rank)
    }
}

impl std::fmt::Display for Holdup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |ranks: &mut dyn Iterator<Item = u32>| ranks.map(|r| r.to_string()).collect::<Vec<_>>().join(",");
        let plural = |n: usize| if n == 1 { "rank" } else { "ranks" };
        let verb = if self.waiting.len() == 1 { "waits" } else { "wait" };
        write!(
            f,
            "{} {} {verb} in {} #{} (group {}) for {} {}",
            plural(self.waiting.len()),
            list(&mut self.waiting.iter().copied()),
            self.kind,
            self.seq,
            self.group,
            plural(self.missing.len()),
            list(&mut self.missing.iter().map(|(rank, _)| *rank)),
        )?;
        for (rank, at) in &self.missing {
            match at {
                Some(at) => write!(f, "; rank {rank} is in {at}")?,
                None => write!(f, "; rank {rank} never entered it")?,
            }
        }
        Ok(())
    }
}

/// The collective that ranks wait in for others that never entered it, if the records show
/// one: the furthest unfinished one (highest sequence number), in its group.
pub fn holdup(records: &[RankFlights]) -> Option<Holdup> {
    let target = records
        .iter()
        .filter_map(RankFlights::in_flight)
        .max_by_key(|flight| (flight.seq, std::cmp::Reverse(flight.group)))?;
    let mut waiting: Vec<u32> = records
        .iter()
        .filter(|record| record.in_flight().is_some_and(|f| f.group == target.group && f.seq == target.seq))
        .map(|record| record.rank)
        .collect();
    waiting.sort_unstable();
    let mut missing: Vec<(u32, Option<String>)> = records
        .iter()
        .filter(|record| !waiting.contains(&record.rank))
        .filter(|record| {
            let reached = record.flights.iter().filter(|f| f.group == target.group).map(|f| f.seq).max();
            // a rank with no record of the group is in it only if it is the world
            match reached {
                Some(seq) => seq < target.seq,
                None => target.group == WORLD,
            }
        })
        .map(|record| (record.rank, record.at.clone()))
        .collect();
    missing.sort_unstable();
    if missing.is_empty() {
        return None;
    }
    let kind = KINDS.get(target.kind as usize).copied().unwrap_or("?");
    Some(Holdup { waiting, kind, group: target.group, seq: target.seq, missing })
}

/// The main thread's innermost frame of the program's own code in a faulthandler dump, as
/// `function (file:line)`: the main thread is the one whose outermost frame is module code,
/// and the program's own code is what is not under a `lib/pythonX.Y` directory (the standard
/// library, installed packages), unless nothing else is.
pub fn main_thread_frame(stacks: &str) -> Option<String> {
    let mut frames: Vec<&str> = Vec::new();
    let mut found = None;
    let mut close = |frames: &mut Vec<&str>| {
        if found.is_none() && frames.last().is_some_and(|outer| outer.ends_with(" in <module>")) {
            let own = frames.iter().find(|frame| !frame.contains("/lib/python"));
            found = own.or(frames.first()).map(|inner| (*inner).to_owned());
        }
        frames.clear();
    };
    for line in stacks.lines() {
        let line = line.trim();
        if line.starts_with("File \"") {
            frames.push(line);
        } else {
            close(&mut frames);
        }
    }
    close(&mut frames);
    // File "path", line N in function
    let frame = found?;
    let (path, rest) = frame.strip_prefix("File \"")?.split_once("\", line ")?;
    let (line, function) = rest.split_once(" in ")?;
    Some(format!("{function} ({path}:{line})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flight(group: u64, seq: u64, finished: bool) -> Flight {
        Flight { kind: 1, group, seq, bytes: 40, entered: 10, finished: if finished { 20 } else { 0 } }
    }

    fn record(rank: u32, flights: &[Flight], stacks: Option<&str>) -> RankFlights {
        RankFlights { rank, flights: flights.to_vec(), at: stacks.and_then(main_thread_frame) }
    }

    const STUCK: &str = r#"Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 622 in wait
  File "/tmp/side.py", line 3 in side

Current thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/tmp/train.py", line 12 in stuck_before_collective
  File "/tmp/train.py", line 30 in <module>
"#;

    #[test]
    fn the_rank_that_never_entered_is_named_not_the_ones_that_wait() {
        let done = [flight(0, 4, true)];
        let waiting = [flight(0, 4, true), flight(0, 5, false)];
        let records = [record(0, &waiting, None), record(1, &done, Some(STUCK)), record(2, &waiting, None)];
        let found = holdup(&records).unwrap();
        assert_eq!(
            found.to_string(),
            "ranks 0,2 wait in all_reduce #5 (group 0) for rank 1; rank 1 is in stuck_before_collective \
             (/tmp/train.py:12)"
        );
    }

    #[test]
    fn records_merged_from_several_nodes_name_the_remote_rank() {
        let done = [flight(0, 4, true)];
        let waiting = [flight(0, 4, true), flight(0, 5, false)];
        // this node's ranks first, then what the other node shared (as JSON)
        let mut records = vec![record(1, &waiting, None), record(0, &waiting, None)];
        assert_eq!(holdup(&records), None, "nobody missing among this node's ranks");
        let shared = serde_json::to_string(&[record(3, &waiting, None), record(2, &done, Some(STUCK))]).unwrap();
        records.extend(serde_json::from_str::<Vec<RankFlights>>(&shared).unwrap());
        assert_eq!(
            holdup(&records).unwrap().to_string(),
            "ranks 0,1,3 wait in all_reduce #5 (group 0) for rank 2; rank 2 is in stuck_before_collective \
             (/tmp/train.py:12)"
        );
    }

    #[test]
    fn nothing_in_flight_or_nobody_missing_is_no_holdup() {
        let done = [flight(0, 5, true)];
        let waiting = [flight(0, 5, false)];
        assert_eq!(holdup(&[record(0, &done, None)]), None);
        let all_in = [record(0, &waiting, None), record(1, &waiting, None)];
        assert_eq!(holdup(&all_in), None, "everyone is inside: the cause is elsewhere (another node?)");
        // a subgroup's waiters do not wait for ranks that never used that group
        let sub = [flight(3, 1, false)];
        let records = [record(0, &sub, None), record(1, &[], None)];
        assert_eq!(holdup(&records), None);
        let never = [record(0, &waiting, None), record(1, &[], None)];
        assert_eq!(
            holdup(&never).unwrap().to_string(),
            "rank 0 waits in all_reduce #5 (group 0) for rank 1; rank 1 never entered it"
        );
    }

    #[test]
    fn the_main_thread_is_the_one_running_module_code() {
        assert_eq!(main_thread_frame(STUCK).unwrap(), "stuck_before_collective (/tmp/train.py:12)");
        assert_eq!(main_thread_frame("Thread 0x1 (most recent call first):\n  File \"a.py\", line 1 in f\n"), None);
    }
}
