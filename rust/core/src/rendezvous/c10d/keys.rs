//! Where the rendezvous keeps its state in the store. Everything of one run lives under the
//! run's base prefix; each round has its own sub-tree, so a round is written once and never
//! rewritten (no read-modify-write of a growing shared blob).

use crate::rendezvous::records;

/// Keys relative to the run's base prefix.
pub struct Keys;

impl Keys {
    /// JSON [`crate::rendezvous::records::Meta`]: format version and node bounds, written once per run.
    pub const META: &'static str = "meta";
    /// The current round number (decimal); moved forward with compare-and-set.
    pub const ROUND: &'static str = "round";
    /// Exists once the job is over.
    pub const CLOSED: &'static str = "closed";
    /// Count of published events; event `n` is under [`Keys::event`].
    pub const EVENTS: &'static str = "events";
    /// Job-wide count of restarts after failures.
    pub const RESTARTS: &'static str = "restarts";

    /// JSON [`FailureRecord`](crate::rendezvous::records::FailureRecord): the job's last worker
    /// failure, for `elastix status` (each failing node overwrites it; at failure time only).
    pub const LAST_FAILURE: &'static str = records::LAST_FAILURE_KEY;

    pub fn event(n: i64) -> String {
        format!("event/{n}")
    }

    /// Arrivals in round `r` (a counter: each node's ADD returns its arrival number).
    pub fn joined(r: u64) -> String {
        format!("r{r}/joined")
    }

    /// Arrival `i`'s JSON record.
    pub fn arrival(r: u64, i: u64) -> String {
        format!("r{r}/arrival/{i}")
    }

    /// How many arrivals are expected when a round re-forms (written by whoever opened it).
    pub fn expected(r: u64) -> String {
        format!("r{r}/expected")
    }

    /// "cutoff claimer": the first claim (compare-and-set) fixes the round's membership.
    pub fn claim(r: u64) -> String {
        format!("r{r}/claim")
    }

    /// Arrival `i`'s rank, for members of the sealed round.
    pub fn rank(r: u64, i: u64) -> String {
        format!("r{r}/rank/{i}")
    }

    /// JSON [`crate::rendezvous::records::Seal`], written once by compare-and-set.
    pub fn sealed(r: u64) -> String {
        format!("r{r}/sealed")
    }

    /// Failure reports for round `r`: only the first counts as a job-wide restart.
    pub fn failures(r: u64) -> String {
        format!("r{r}/failures")
    }

    /// Marks member `rank` of round `r` reported lost (compare-and-set: one report each).
    pub fn lost(r: u64, rank: u32) -> String {
        format!("r{r}/lost/{rank}")
    }

    /// Members of round `r` reported lost: the next round expects that many fewer back.
    pub fn lost_count(r: u64) -> String {
        format!("r{r}/lost")
    }

    /// Late nodes that want the job to re-form with them (torch's wait list).
    pub fn waiting(r: u64) -> String {
        format!("r{r}/waiting")
    }

    /// Late nodes that arrived while the round was full.
    pub fn spares(r: u64) -> String {
        format!("r{r}/spares")
    }

    /// JSON address of the workers' store, published by rank 0.
    pub fn master(r: u64) -> String {
        format!("r{r}/master")
    }

    /// JSON [`crate::rendezvous::records::NodeStatus`] of the member with group rank `rank`, written once
    /// its workers run (for `elastix status`).
    pub fn node_status(r: u64, rank: u32) -> String {
        format!("r{r}/node/{rank}")
    }

    /// Beat counter of rank `rank` in round `r`: `ADD` returns the beat's number.
    pub fn beats(r: u64, rank: u32) -> String {
        format!("r{r}/hb/{rank}")
    }

    /// Asks to member `rank` of round `r` (a counter): another member that suspects it gone
    /// counts one up and writes [`Keys::ask`]; the member answers with a heartbeat at once.
    pub fn asks(r: u64, rank: u32) -> String {
        format!("r{r}/ask/{rank}")
    }

    /// Ask number `n` to member `rank` of round `r` (the key the member waits for).
    pub fn ask(r: u64, rank: u32, n: u64) -> String {
        format!("r{r}/ask/{rank}/{n}")
    }

    /// Where a member announces itself (for loss reports and status tools).
    pub fn member(r: u64, rank: u32) -> String {
        format!("r{r}/member/{rank}")
    }

    /// Heartbeat number `seq` of rank `rank` in round `r`; its value is the sender's clock
    /// (milliseconds since the Unix epoch), which tells `elastix status` its age.
    pub fn heartbeat(r: u64, rank: u32, seq: u64) -> String {
        format!("r{r}/hb/{rank}/{seq}")
    }

    /// The prefix of the round's store, handed to the agent (and its users) as a namespace.
    pub fn round_store(r: u64) -> String {
        records::round_store(r)
    }
}

/// The base prefix of a run's keys on a TCPStore (the leading `/` makes them ordinary torch
/// keys, visible to `list_keys`).
pub fn run_prefix(run_id: &str) -> String {
    format!("/elastix/rdzv/{run_id}/")
}
