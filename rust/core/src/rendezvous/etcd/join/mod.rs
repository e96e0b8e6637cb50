//! Forming one round on etcd, in a constant number of requests per node and no polling:
//!
//! 1. Enter: one transaction, if round r is neither sealed nor the job closed, writes the
//!    node's member key under its lease (leaving its key of an earlier round), counts one more
//!    arrival (`j/<r>`), and counts round r-1's members and, from the min_nodes-th arrival on,
//!    round r's (a count reads the whole range: one per arrival would make a round O(N²)).
//! 2. Seal: once the round is full (max_nodes, or the last of round r-1's members re-formed),
//!    or once a last call that started at min_nodes ran out, a node seals it with one
//!    transaction. The seal also requires that round r-1 has no members left: a running round
//!    is never replaced behind its members' back, and nodes that join meanwhile wait.
//!    The sealer publishes the round's size at the seal's revision S.
//! 3. Everyone learns the seal and size from a watch on round r's outcome, started at the
//!    revision of its own entry (nothing can be missed). Ranks follow the order in which the
//!    members' keys were created: with no departure before S, a node's rank is its arrival
//!    count; otherwise one read at S (keys created before this node's) gives it.

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

use elastix_etcd::pb::etcdserverpb::request_op::Request;
use elastix_etcd::pb::etcdserverpb::response_op::Response;
use elastix_etcd::pb::etcdserverpb::{TxnRequest, TxnResponse};
use elastix_etcd::{EtcdClient, Lease, LeaseState, Watcher};

mod outcome;
mod progress;
mod seal;

pub(super) use outcome::wait_master;

use super::keys::EtcdKeys;
use super::ops::{self, etcd_error};
use crate::rendezvous::config::settings::RendezvousSettings;
use crate::rendezvous::error::{RendezvousError, Result};
use crate::rendezvous::node::NodeDesc;
use crate::rendezvous::records::{encode, Arrival, Master, FORMAT_VERSION};

/// Most arrivals named in a progress message or a timeout.
const NAMED: i64 = 32;

/// Round r's seal: the first `cutoff` members by creation are in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct SealMark {
    v: u32,
    cutoff: u32,
}

/// Round r at its seal's revision: `live` member keys, of `joins` ever written; the last
/// member's key was created at `last_member` (later keys are nodes left out of a full round).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Size {
    v: u32,
    revision: i64,
    cutoff: u32,
    live: u64,
    joins: u64,
    last_member: i64,
}

impl Size {
    /// Members of the round: the live keys at the seal, up to the cutoff.
    pub(super) fn world_size(&self) -> u32 {
        self.live.min(u64::from(self.cutoff)) as u32
    }
}

/// What one node works with while it forms a round.
pub(super) struct Ctx<'a> {
    pub client: &'a EtcdClient,
    pub keys: &'a EtcdKeys,
    pub settings: &'a RendezvousSettings,
    pub node: &'a NodeDesc,
    pub lease: Lease,
    pub lease_state: watch::Receiver<LeaseState>,
}

/// This node's key name in a round.
pub(super) fn member_id(lease: Lease) -> String {
    format!("{:016x}", lease.id as u64)
}

pub(super) enum Entry {
    Joined(Joined),
    /// Round r is sealed already; `latest` is the last sealed round.
    Taken {
        latest: Option<u64>,
    },
    Closed {
        reason: String,
    },
}

pub(super) struct Joined {
    pub round: u64,
    /// The entry's revision: the watch for the outcome starts after it.
    revision: i64,
    /// This node's key's creation revision (the entry's, unless a retried entry found it).
    created: i64,
    /// Live members of round r with this node (arrivals before the min_nodes-th: `index`, an
    /// upper bound that decides the same), and arrivals ever (this node's number).
    arrival: u64,
    index: u64,
    /// Members of round r-1 left after this node's entry, and whether it was one of them.
    previous_live: u64,
    moved: bool,
    entered_at: Instant,
}

pub(super) enum Outcome {
    Member {
        rank: u32,
        world_size: u32,
        /// The seal's revision, and the creation revision of the round's last member.
        sealed_at: i64,
        last_member: i64,
        /// The round's outcome watch, which brings rank 0's address if it was not seen yet.
        watcher: Box<Watcher>,
        master: Option<Master>,
    },
    /// The round formed without this node (`spare`: it is full) or could not form.
    Next { spare: bool },
    /// `spare`: this node waited as a spare.
    Closed { reason: String, spare: bool },
    /// The lease ended (its keys are gone): take a new one and enter again.
    LeaseLost(LeaseState),
}

enum SealAttempt {
    Sealed(Size),
    Taken,
    /// Round r-1 still has `count` members (at `revision`).
    PreviousBusy {
        count: u64,
        revision: i64,
    },
}

impl Ctx<'_> {
    fn error(&self, err: elastix_etcd::EtcdError) -> RendezvousError {
        etcd_error(err, self.client)
    }

    async fn txn(&self, request: TxnRequest) -> Result<TxnResponse> {
        self.client.txn(request).await.map_err(|err| self.error(err))
    }

    /// Step 1: enters round `r`, leaving this node's key `from` (its round and name).
    pub async fn enter(&self, r: u64, from: Option<(u64, String)>) -> Result<Entry> {
        let (keys, id) = (self.keys, member_id(self.lease));
        let mut success = Vec::new();
        let moved = r > 0 && from.as_ref().is_some_and(|(round, _)| *round == r - 1);
        if let Some((round, name)) = from.filter(|place| *place != (r, id.clone())) {
            success.push(ops::delete(&keys.member(round, &name)));
        }
        let base = success.len();
        let record = encode(&Arrival { v: FORMAT_VERSION, node: Some(self.node.clone()) });
        let mut put = ops::put(&keys.member(r, &id), &record, self.lease.id);
        if let Some(Request::RequestPut(request)) = put.request.as_mut() {
            request.prev_kv = true;
        }
        success.push(put);
        success.push(ops::put_counted(&keys.joined(r)));
        // counting reads every key of a round: done by every node, forming a round of N would
        // cost etcd O(N²). Live members are never more than arrivals, and fewer than min_nodes
        // decide nothing, so only the arrivals from the min_nodes-th on count them
        let min = u64::from(self.settings.min_nodes);
        let from_min = ops::written_at_least(&keys.joined(r), min.saturating_sub(1));
        success.push(ops::only_if(from_min, ops::count(&keys.members(r), 0)));
        if r > 0 {
            success.push(ops::count(&keys.members(r - 1), 0));
        }
        let request = TxnRequest {
            compare: vec![ops::absent(&keys.seal(r)), ops::absent(&keys.closed())],
            success,
            // a retry whose first attempt got in before the seal (its answer lost) must not
            // leave that key behind: the next round would count this node as still in this one
            failure: vec![ops::get(&keys.closed()), ops::get(&keys.round()), ops::delete(&keys.member(r, &id))],
        };
        let response = self.txn(request).await?;
        if !response.succeeded {
            if let Some(reason) = ops::value(&response, 0) {
                return Ok(Entry::Closed { reason: String::from_utf8_lossy(&reason).into_owned() });
            }
            let latest = ops::value(&response, 1).map(|bytes| ops::number(&bytes, "round")).transpose()?;
            return Ok(Entry::Taken { latest: latest.map(|r| r.max(0) as u64) });
        }
        let revision = ops::revision(&response);
        let index = ops::written_times(&response, base + 1);
        let created = match response.responses.get(base).and_then(|op| op.response.as_ref()) {
            Some(Response::ResponsePut(put)) => {
                put.prev_kv.as_ref().map_or(revision, |previous| previous.create_revision)
            }
            _ => revision,
        };
        Ok(Entry::Joined(Joined {
            round: r,
            revision,
            created,
            index,
            arrival: ops::counted_if(&response, base + 2).unwrap_or(index),
            previous_live: if r > 0 { ops::counted(&response, base + 3) } else { 0 },
            moved,
            entered_at: Instant::now(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use elastix_etcd::testing::LocalEtcd;

    use super::*;

    /// A retried entry whose first attempt got in (its answer lost), finding the round sealed
    /// meanwhile, leaves no key of this node in that round: the next round would count it as
    /// still there (and wait for it until the join timeout).
    #[tokio::test]
    async fn a_retried_entry_that_finds_the_round_sealed_leaves_no_key_behind() {
        let Some(etcd) = LocalEtcd::start() else { return };
        let client = etcd.client();
        let keys = EtcdKeys::new("/elastix/rdzv/retry/".into());
        let settings = RendezvousSettings::new("retry", 1, 2).unwrap();
        let node = NodeDesc::this_process(Some("127.0.0.1"));
        let lease = client.grant_lease(Duration::from_secs(10)).await.unwrap();
        let (_keep, lease_state) = watch::channel(LeaseState::Alive);
        let ctx = Ctx { client: &client, keys: &keys, settings: &settings, node: &node, lease, lease_state };
        // the first attempt: applied by etcd (its answer, say, never arrived)
        assert!(matches!(ctx.enter(0, None).await.unwrap(), Entry::Joined(_)));
        let mine = keys.member(0, &member_id(lease));
        assert!(client.get(&mine).await.unwrap().0.is_some());
        // another node seals the round meanwhile
        client.put(&keys.seal(0), b"sealed").await.unwrap();
        // the retry
        assert!(matches!(ctx.enter(0, None).await.unwrap(), Entry::Taken { .. }));
        assert_eq!(client.get(&mine).await.unwrap().0, None, "the first attempt's key is gone");
    }
}
