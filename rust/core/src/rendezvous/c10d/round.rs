//! Forming one round, in O(1) store operations per node (plus O(1) multi-key requests by the
//! one node that seals it), with every wait pushed by the store (WAIT), never polled:
//!
//! 1. Arrive: `ADD joined 1` gives the node its arrival number `i`; it writes its record
//!    under `arrival/i`.
//! 2. Claim: membership is fixed by the first compare-and-set of `claim` to "cutoff claimer":
//!    by the arrival that fills the round (max_nodes, or the count expected when a round
//!    re-forms), or, once min_nodes have arrived, by a node whose last-call timer ran out
//!    (the min-th arrival first; later arrivals are backups). Arrivals below the cutoff are in.
//! 3. Seal: the claimer reads the members' records, ranks them in (address, pid, local id)
//!    order, writes every rank with one MULTI_SET, then `sealed` by compare-and-set.
//! 4. Everyone waits for `sealed` and reads its own rank.
//!
//! A claimer that dies before sealing is covered: after a bound, any node may seal the round
//! as aborted (the compare-and-set keeps a single outcome), and everyone moves on.

use std::time::Duration;

use tokio::time::Instant;

use super::keys::Keys;
use crate::rendezvous::config::settings::RendezvousSettings;
use crate::rendezvous::error::{RendezvousError, Result};
use crate::rendezvous::node::NodeDesc;
use crate::rendezvous::records::{decode, encode, Arrival, Seal, FORMAT_VERSION};
use crate::rendezvous::store::StoreConn;

/// Most arrivals named in a timeout message.
const NAMED_IN_ERRORS: u64 = 32;

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum JoinOutcome {
    Member {
        rank: u32,
        world_size: u32,
    },
    /// Arrived after the membership was fixed; `world_size` is the sealed round's.
    Late {
        world_size: u32,
    },
    /// The round could not form; the next one must be tried.
    Aborted,
}

/// "cutoff claimer": arrivals `0..cutoff` are members; `claimer` seals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Claim {
    cutoff: u64,
    claimer: u64,
}

impl Claim {
    fn encode(self) -> Vec<u8> {
        format!("{} {}", self.cutoff, self.claimer).into_bytes()
    }

    fn decode(bytes: &[u8]) -> Result<Claim> {
        let text = String::from_utf8_lossy(bytes);
        let mut parts = text.split(' ').map(str::parse::<u64>);
        match (parts.next(), parts.next(), parts.next()) {
            (Some(Ok(cutoff)), Some(Ok(claimer)), None) => Ok(Claim { cutoff, claimer }),
            _ => Err(RendezvousError::State(format!("unreadable round claim {text:?}"))),
        }
    }
}

pub(crate) struct RoundJoin<'a, C> {
    pub conn: &'a mut C,
    pub settings: &'a RendezvousSettings,
    pub node: &'a NodeDesc,
    pub round: u64,
    pub deadline: Instant,
    /// The rendezvous store's address, for progress messages.
    pub endpoint: &'a (String, u16),
}

impl<C: StoreConn> RoundJoin<'_, C> {
    pub async fn run(mut self) -> Result<JoinOutcome> {
        let r = self.round;
        let arrival = (self.conn.count_up(&Keys::joined(r)).await? - 1) as u64;
        let record = Arrival { v: FORMAT_VERSION, node: Some(self.node.clone()) };
        self.conn.set(&Keys::arrival(r, arrival), &encode(&record)).await?;
        let claim = match self.await_claim(arrival).await {
            Ok(claim) => claim,
            Err(err) => {
                // leave the slot empty so that a later seal does not count this node in
                let gone = Arrival { v: FORMAT_VERSION, node: None };
                let _ = self.conn.set(&Keys::arrival(r, arrival), &encode(&gone)).await;
                return Err(err);
            }
        };
        if claim.claimer == arrival {
            self.seal(claim.cutoff).await?;
        }
        let seal = self.await_seal().await?;
        if seal.aborted {
            return Ok(JoinOutcome::Aborted);
        }
        let rank_key = Keys::rank(r, arrival);
        // below the cutoff but left out by the sealer (its record came too late): late too
        let rank = match self.conn.try_get(&rank_key).await? {
            Some(rank) if arrival < claim.cutoff => rank,
            _ => return Ok(JoinOutcome::Late { world_size: seal.world_size }),
        };
        let rank = String::from_utf8_lossy(&rank)
            .parse()
            .map_err(|_| RendezvousError::State(format!("unreadable rank {:?} in round {r}", rank)))?;
        Ok(JoinOutcome::Member { rank, world_size: seal.world_size })
    }

    /// Arrivals that complete the round without a last call: max_nodes, or the expected count
    /// of a re-forming round when that lies within the bounds.
    async fn full_at(&mut self) -> Result<u64> {
        let (min, max) = (u64::from(self.settings.min_nodes), u64::from(self.settings.max_nodes));
        let Some(expected) = self.conn.try_get(&Keys::expected(self.round)).await? else { return Ok(max) };
        let expected = String::from_utf8_lossy(&expected).parse::<u64>().ok();
        Ok(expected.filter(|e| (min..=max).contains(e)).unwrap_or(max))
    }

    async fn await_claim(&mut self, arrival: u64) -> Result<Claim> {
        let (min, max) = (u64::from(self.settings.min_nodes), u64::from(self.settings.max_nodes));
        let arrived = arrival + 1;
        if arrived == self.full_at().await? {
            self.try_claim(Claim { cutoff: arrived, claimer: arrival }).await?;
        }
        let claim_key = Keys::claim(self.round);
        let last_call_ends = (arrived >= min).then(|| Instant::now() + self.settings.last_call_timeout);
        loop {
            let until = last_call_ends.map_or(self.deadline, |end| end.min(self.deadline));
            // never silent for long: wake to say who is still awaited
            let report_at = Instant::now() + self.settings.progress_interval;
            let wake = until.min(report_at);
            if let Some(claim) =
                self.conn.wait_get(&claim_key, Some(wake.saturating_duration_since(Instant::now()))).await?
            {
                return Claim::decode(&claim);
            }
            let count = self.conn.tally(&Keys::joined(self.round)).await? as u64;
            if Instant::now() >= self.deadline {
                if count < min {
                    return Err(self.timeout_error().await);
                }
                // the join deadline with enough nodes: the round starts with them, whatever
                // is left of a last call (any node may claim it now)
                self.try_claim(Claim { cutoff: count.min(max), claimer: arrival }).await?;
                continue;
            }
            if wake < until {
                self.report_progress(last_call_ends).await;
                continue;
            }
            // last call over: the round starts with everyone who has arrived
            self.try_claim(Claim { cutoff: count.min(max), claimer: arrival }).await?;
        }
    }

    async fn try_claim(&mut self, claim: Claim) -> Result<()> {
        self.conn.compare_set(&Keys::claim(self.round), b"", &claim.encode()).await?;
        Ok(())
    }

    /// Ranks the members and fixes the outcome.
    async fn seal(&mut self, cutoff: u64) -> Result<()> {
        let r = self.round;
        let keys: Vec<String> = (0..cutoff).map(|i| Keys::arrival(r, i)).collect();
        // A node writes its record right after arriving; one that never does has died.
        let present = if self.conn.wait(&keys, Some(self.settings.node_lost_after())).await? {
            (0..cutoff).collect()
        } else {
            self.present_arrivals(cutoff).await?
        };
        let present_keys: Vec<String> = present.iter().map(|i| Keys::arrival(r, *i)).collect();
        let records = self.conn.multi_get(&present_keys).await?;
        let mut members: Vec<(NodeDesc, u64)> = Vec::with_capacity(records.len());
        for (i, bytes) in present.iter().zip(records) {
            if let Some(node) = decode::<Arrival>(&bytes, "arrival record")?.node {
                members.push((node, *i));
            }
        }
        members.sort();
        let seal = if members.len() < self.settings.min_nodes as usize {
            tracing::warn!(round = r, live = members.len(), "round cannot form: fewer than min_nodes live arrivals");
            Seal { v: FORMAT_VERSION, world_size: 0, aborted: true }
        } else {
            let ranks: Vec<(String, Vec<u8>)> = members
                .iter()
                .enumerate()
                .map(|(rank, (_, i))| (Keys::rank(r, *i), rank.to_string().into_bytes()))
                .collect();
            self.conn.multi_set(&ranks).await?;
            Seal { v: FORMAT_VERSION, world_size: members.len() as u32, aborted: false }
        };
        self.conn.compare_set(&Keys::sealed(r), b"", &encode(&seal)).await?;
        Ok(())
    }

    async fn present_arrivals(&mut self, cutoff: u64) -> Result<Vec<u64>> {
        let mut present = Vec::new();
        for i in 0..cutoff {
            if self.conn.check(&[Keys::arrival(self.round, i)]).await? {
                present.push(i);
            }
        }
        Ok(present)
    }

    /// Waits for the seal; if it does not come (the claimer died), seals the round as aborted
    /// so that everyone can move on. The compare-and-set keeps whichever came first.
    async fn await_seal(&mut self) -> Result<Seal> {
        let key = Keys::sealed(self.round);
        let patience = self.settings.node_lost_after() * 2;
        let stored = match self.conn.wait_get(&key, Some(patience)).await? {
            Some(bytes) => bytes,
            None => {
                tracing::warn!(round = self.round, "round claimed but never sealed; aborting it");
                let aborted = Seal { v: FORMAT_VERSION, world_size: 0, aborted: true };
                self.conn.compare_set(&key, b"", &encode(&aborted)).await?
            }
        };
        decode(&stored, "seal")
    }

    /// How many nodes have arrived, and the names of the first [`NAMED_IN_ERRORS`].
    async fn arrivals(&mut self) -> (u64, Vec<String>) {
        let r = self.round;
        let arrived = self.conn.tally(&Keys::joined(r)).await.unwrap_or(0).max(0) as u64;
        let mut names = Vec::new();
        for i in 0..arrived.min(NAMED_IN_ERRORS) {
            let key = Keys::arrival(r, i);
            if let Ok(Some(bytes)) = self.conn.try_get(&key).await {
                if let Ok(Arrival { node: Some(node), .. }) = decode::<Arrival>(&bytes, "arrival record") {
                    names.push(node.to_string());
                }
            }
        }
        if arrived > NAMED_IN_ERRORS {
            names.push(format!("... {} more", arrived - NAMED_IN_ERRORS));
        }
        (arrived, names)
    }

    /// Says, at INFO, what this node is waiting for, from whom, and until when.
    async fn report_progress(&mut self, last_call_ends: Option<Instant>) {
        let (arrived, names) = self.arrivals().await;
        let now = Instant::now();
        let until = last_call_ends.map_or(self.deadline, |end| end.min(self.deadline));
        tracing::info!(
            "{}",
            progress_message(self.settings, self.endpoint, arrived, &names, until.saturating_duration_since(now))
        );
    }

    /// Names the run, the round, the bounds and who had arrived.
    async fn timeout_error(&mut self) -> RendezvousError {
        let r = self.round;
        let (arrived, names) = self.arrivals().await;
        let settings = self.settings;
        RendezvousError::Timeout(format!(
            "rendezvous {:?} round {r} timed out after {:.0?} (join_timeout): {arrived} node(s) joined [{}], \
             but the round needs at least {} (at most {}); {} more node(s) missing",
            settings.run_id,
            settings.join_timeout,
            names.join(", "),
            settings.min_nodes,
            settings.max_nodes,
            u64::from(settings.min_nodes).saturating_sub(arrived),
        ))
    }
}

/// "waiting for N more node(s): k joined (names) of min..max at HOST:PORT, run ID id, deadline
/// in T" (or, once min_nodes are in, the last call's end).
fn progress_message(
    settings: &RendezvousSettings,
    endpoint: &(String, u16),
    arrived: u64,
    names: &[String],
    remaining: Duration,
) -> String {
    let (min, max) = (u64::from(settings.min_nodes), u64::from(settings.max_nodes));
    let waiting_for = if arrived < min {
        format!("waiting for {} more node(s)", min - arrived)
    } else {
        format!("last call: waiting for up to {} more node(s)", max.saturating_sub(arrived))
    };
    let (host, port) = endpoint;
    let host = if host.contains(':') { format!("[{host}]") } else { host.clone() };
    format!(
        "{waiting_for}: {arrived} joined ({}) of {min}..{max} at {host}:{port}, run ID {}, {} in {}s",
        names.join(", "),
        settings.run_id,
        if arrived < min { "deadline" } else { "round starts" },
        remaining.as_secs(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_names_who_is_awaited_where_and_until_when() {
        let settings = RendezvousSettings::new("job7", 3, 4).unwrap();
        let endpoint = ("node0".to_owned(), 29400);
        let names = vec!["node1(pid 12)".to_owned()];
        let text = progress_message(&settings, &endpoint, 1, &names, Duration::from_millis(599_700));
        assert_eq!(
            text,
            "waiting for 2 more node(s): 1 joined (node1(pid 12)) of 3..4 at node0:29400, run ID job7, deadline in 599s"
        );
        let text = progress_message(&settings, &("::1".to_owned(), 5), 3, &names, Duration::from_secs(20));
        assert!(text.starts_with("last call: waiting for up to 1 more node(s): 3 joined"), "{text}");
        assert!(text.contains("at [::1]:5") && text.ends_with("round starts in 20s"), "{text}");
    }

    #[test]
    fn claims_round_trip_and_garbage_is_refused() {
        let claim = Claim { cutoff: 4, claimer: 3 };
        assert_eq!(Claim::decode(&claim.encode()).unwrap(), claim);
        assert!(Claim::decode(b"4").is_err());
        assert!(Claim::decode(b"a b").is_err());
        assert!(Claim::decode(b"1 2 3").is_err());
    }
}
