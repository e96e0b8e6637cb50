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
use elastix_etcd::pb::etcdserverpb::{RangeRequest, TxnRequest, TxnResponse};
use elastix_etcd::pb::mvccpb::event::EventType;
use elastix_etcd::{EtcdClient, Lease, LeaseState, WatchItem, Watcher};

use super::keys::{EtcdKeys, KeyKind};
use super::ops::{self, etcd_error};
use crate::rendezvous::config::settings::RendezvousSettings;
use crate::rendezvous::error::{RendezvousError, Result};
use crate::rendezvous::node::NodeDesc;
use crate::rendezvous::records::{decode, encode, Arrival, Master, FORMAT_VERSION};

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

    /// Steps 2 and 3: waits for round `joined.round` to be sealed (sealing it when this node's
    /// turn comes) and returns this node's place in it.
    pub async fn outcome(&self, joined: &Joined, deadline: Instant) -> Result<Outcome> {
        let (settings, keys, r) = (self.settings, self.keys, joined.round);
        let (min, max) = (u64::from(settings.min_nodes), u64::from(settings.max_nodes));
        // the running round is full: this node is a spare and waits as long as it takes
        let spare = !joined.moved && joined.previous_live >= max;
        let full = joined.arrival >= max || (joined.moved && joined.previous_live == 0 && joined.arrival >= min);
        let mut seal_at = if full {
            Some(Instant::now())
        } else {
            (joined.arrival >= min).then(|| joined.entered_at + settings.last_call_timeout)
        };
        let outcome_range = keys.outcome(r);
        let mut watcher = self.client.watch(&outcome_range.key, &outcome_range.end, joined.revision + 1, false);
        let mut previous: Option<(Watcher, u64)> = None;
        let mut cutoff: Option<(i64, u32)> = None;
        let mut size: Option<Size> = None;
        let mut master: Option<Master> = None;
        let mut report_at = Instant::now() + settings.progress_interval;
        let mut lease_state = self.lease_state.clone();
        // a sealer that dies before it publishes the size: anyone reads it at the seal
        let size_patience = settings.node_lost_after() * 2;
        let mut size_due: Option<Instant> = None;
        let size = loop {
            if let Some(size) = size.take() {
                break size;
            }
            if cutoff.is_some() && size_due.is_none() {
                // sealed: only the size is awaited now
                size_due = Some(Instant::now() + size_patience);
                (seal_at, previous) = (None, None);
            }
            let mut wake = report_at;
            for due in [seal_at, size_due, (!spare && cutoff.is_none()).then_some(deadline)].into_iter().flatten() {
                wake = wake.min(due);
            }
            tokio::select! {
                item = watcher.next() => match item.map_err(|err| self.error(err))? {
                    WatchItem::Events(events) => {
                        for event in events {
                            let Some(kv) = event.kv.filter(|_| event.r#type == EventType::Put as i32) else { continue };
                            match keys.kind(&kv.key) {
                                KeyKind::Seal { .. } => {
                                    let mark: SealMark = decode(&kv.value, "seal")?;
                                    cutoff = Some((kv.mod_revision, mark.cutoff));
                                }
                                KeyKind::Size { .. } => size = Some(decode(&kv.value, "round size")?),
                                KeyKind::Master { .. } => master = Some(decode(&kv.value, "master address")?),
                                KeyKind::Closed { .. } => {
                                    let reason = String::from_utf8_lossy(&kv.value).into_owned();
                                    return Ok(Outcome::Closed { reason, spare });
                                }
                                _ => {}
                            }
                        }
                    }
                    WatchItem::Compacted { revision } => {
                        tracing::info!(round = r, "etcd compacted the history up to revision {revision}; reading the round's outcome again");
                        let (read, revision) = self.read_outcome(r).await?;
                        if let Some(reason) = read.closed {
                            return Ok(Outcome::Closed { reason, spare });
                        }
                        (cutoff, size, master) = (read.cutoff.or(cutoff), read.size.or(size), read.master.or(master));
                        watcher.restart(revision + 1);
                    }
                },
                item = next_of(&mut previous) => {
                    if let Some((watcher, count)) = previous.as_mut() {
                        match item.map_err(|err| self.error(err))? {
                            WatchItem::Events(events) => {
                                for event in events {
                                    if event.r#type == EventType::Delete as i32 {
                                        *count = count.saturating_sub(1);
                                    } else if event.kv.as_ref().is_some_and(|kv| kv.version == 1) {
                                        *count += 1;
                                    }
                                }
                            }
                            WatchItem::Compacted { .. } => {
                                let response = self.txn(TxnRequest {
                                    success: vec![ops::count(&keys.members(r - 1), 0)],
                                    ..Default::default()
                                }).await?;
                                *count = ops::counted(&response, 0);
                                watcher.restart(ops::revision(&response) + 1);
                            }
                        }
                        if *count == 0 {
                            previous = None;
                            seal_at = Some(Instant::now());
                        }
                    }
                },
                Ok(()) = lease_state.changed() => {
                    let state = lease_state.borrow().clone();
                    if state.is_over() {
                        return Ok(Outcome::LeaseLost(state));
                    }
                },
                _ = tokio::time::sleep_until(wake) => {
                    let now = Instant::now();
                    if seal_at.is_some_and(|at| at <= now) && cutoff.is_none() {
                        seal_at = None;
                        match self.try_seal(r, settings.max_nodes).await? {
                            SealAttempt::Sealed(sealed) => size = Some(sealed),
                            SealAttempt::Taken => {} // the watch brings it
                            SealAttempt::PreviousBusy { count, revision } => {
                                let range = keys.members(r - 1);
                                previous = Some((self.client.watch(&range.key, &range.end, revision + 1, false), count));
                            }
                        }
                    }
                    if size_due.is_some_and(|due| due <= now) && size.is_none() {
                        let (sealed_at, cut) = cutoff.expect("size_due follows the seal");
                        tracing::warn!(round = r, "round sealed but its size was not published; reading it");
                        size = Some(self.publish_size(r, sealed_at, cut, None).await?);
                    }
                    if report_at <= now {
                        report_at = now + settings.progress_interval;
                        self.report_progress(joined, spare, deadline).await;
                    }
                    if !spare && cutoff.is_none() && deadline <= now {
                        let err = self.timeout_error(joined).await;
                        let _ = self.client.delete(&keys.member(r, &member_id(self.lease))).await;
                        return Err(err);
                    }
                },
            }
        };
        let state = lease_state.borrow().clone();
        if state.is_over() {
            return Ok(Outcome::LeaseLost(state)); // this node's key may be gone at the seal
        }
        if size.live < min {
            tracing::warn!(round = r, live = size.live, "round cannot form: fewer than min_nodes live members");
            return Ok(Outcome::Next { spare: false });
        }
        let rank = if size.live == size.joins {
            joined.index.saturating_sub(1)
        } else {
            let request = ops::keys_created_before(&keys.members(r), size.revision, joined.created);
            self.client.range(request).await.map_err(|err| self.error(err))?.kvs.len() as u64
        };
        if rank >= u64::from(size.cutoff) {
            return Ok(Outcome::Next { spare: true });
        }
        let world_size = size.world_size();
        Ok(Outcome::Member {
            rank: rank as u32,
            world_size,
            sealed_at: size.revision,
            last_member: size.last_member,
            watcher: Box::new(watcher),
            master,
        })
    }

    /// Seals round `r` with the first `cutoff` members, if it is not sealed and round r-1 has
    /// no members left.
    async fn try_seal(&self, r: u64, cutoff: u32) -> Result<SealAttempt> {
        let keys = self.keys;
        let mut compare = vec![ops::absent(&keys.seal(r))];
        if r > 0 {
            compare.push(ops::empty(&keys.members(r - 1)));
        }
        let mark = encode(&SealMark { v: FORMAT_VERSION, cutoff });
        let request = TxnRequest {
            compare,
            success: vec![
                ops::put(&keys.seal(r), &mark, 0),
                ops::put(&keys.round(), r.to_string().as_bytes(), 0),
                ops::count(&keys.members(r), 0),
                ops::get(&keys.joined(r)),
            ],
            failure: vec![ops::get(&keys.seal(r)), ops::count(&keys.members(r.saturating_sub(1)), 0)],
        };
        let response = self.txn(request).await?;
        if !response.succeeded {
            if ops::found(&response, 0).is_some() || r == 0 {
                return Ok(SealAttempt::Taken);
            }
            return Ok(SealAttempt::PreviousBusy {
                count: ops::counted(&response, 1),
                revision: ops::revision(&response),
            });
        }
        let revision = ops::revision(&response);
        let live = ops::counted(&response, 2);
        let joins = ops::found(&response, 3).map_or(0, |kv| kv.version.max(0) as u64);
        tracing::debug!(round = r, live, "sealed the round");
        Ok(SealAttempt::Sealed(self.publish_size(r, revision, cutoff, Some((live, joins))).await?))
    }

    /// Publishes the size of round `r` at its seal (`sealed_at`): as the sealer counted it,
    /// or read at the seal (the sealer died before it published it).
    async fn publish_size(&self, r: u64, sealed_at: i64, cutoff: u32, counted: Option<(u64, u64)>) -> Result<Size> {
        let keys = self.keys;
        let (live, joins) = match counted {
            Some(counted) => counted,
            None => {
                let mut joined = ops::get(&keys.joined(r));
                if let Some(Request::RequestRange(range)) = joined.request.as_mut() {
                    range.revision = sealed_at;
                }
                let success = vec![ops::count(&keys.members(r), sealed_at), joined];
                let response = self.txn(TxnRequest { success, ..Default::default() }).await?;
                (ops::counted(&response, 0), ops::found(&response, 1).map_or(0, |kv| kv.version.max(0) as u64))
            }
        };
        let last_member = if live > u64::from(cutoff) {
            let request = ops::first_created(&keys.members(r), sealed_at, cutoff);
            let response = self.client.range(request).await.map_err(|err| self.error(err))?;
            response.kvs.last().map_or(i64::MAX, |kv| kv.create_revision)
        } else {
            i64::MAX // every key is a member's
        };
        let size = Size { v: FORMAT_VERSION, revision: sealed_at, cutoff, live, joins, last_member };
        self.client.put(&keys.size(r), &encode(&size)).await.map_err(|err| self.error(err))?;
        Ok(size)
    }

    /// Round r's outcome read afresh (after its watch was compacted away), and the revision.
    async fn read_outcome(&self, r: u64) -> Result<(OutcomeRead, i64)> {
        let keys = self.keys;
        let request = TxnRequest {
            success: vec![
                ops::get(&keys.seal(r)),
                ops::get(&keys.size(r)),
                ops::get(&keys.master(r)),
                ops::get(&keys.closed_marker(r)),
            ],
            ..Default::default()
        };
        let response = self.txn(request).await?;
        let cutoff = match ops::found(&response, 0) {
            Some(kv) => Some((kv.mod_revision, decode::<SealMark>(&kv.value, "seal")?.cutoff)),
            None => None,
        };
        let read = OutcomeRead {
            cutoff,
            size: ops::value(&response, 1).map(|bytes| decode(&bytes, "round size")).transpose()?,
            master: ops::value(&response, 2).map(|bytes| decode(&bytes, "master address")).transpose()?,
            closed: ops::value(&response, 3).map(|bytes| String::from_utf8_lossy(&bytes).into_owned()),
        };
        Ok((read, ops::revision(&response)))
    }

    /// How many members round r has now, and the names of the first [`NAMED`].
    async fn arrivals(&self, r: u64) -> (u64, Vec<String>) {
        let range = self.keys.members(r);
        let request = RangeRequest { key: range.key, range_end: range.end, limit: NAMED, ..Default::default() };
        let Ok(response) = self.client.range(request).await else { return (0, Vec::new()) };
        let count = response.count.max(0) as u64;
        let mut names: Vec<String> = response
            .kvs
            .iter()
            .filter_map(|kv| decode::<Arrival>(&kv.value, "member record").ok()?.node.map(|node| node.to_string()))
            .collect();
        if count > NAMED as u64 {
            names.push(format!("... {} more", count - NAMED as u64));
        }
        (count, names)
    }

    /// Says, at INFO, what this node waits for, from whom, and until when.
    async fn report_progress(&self, joined: &Joined, spare: bool, deadline: Instant) {
        let settings = self.settings;
        let (count, names) = self.arrivals(joined.round).await;
        let (min, max) = (settings.min_nodes, settings.max_nodes);
        let at = format!("etcd {}, run ID {}", self.client.endpoints(), settings.run_id);
        let remaining = deadline.saturating_duration_since(Instant::now()).as_secs();
        if spare {
            tracing::info!(
                "waiting as a spare: round {} is full ({max} node(s)) at {at}; this node joins when a slot opens",
                joined.round.saturating_sub(1)
            );
        } else if joined.previous_live > 0 && !joined.moved {
            tracing::info!(
                "waiting for round {} ({} node(s)) to re-form with this node at {at}, deadline in {remaining}s",
                joined.round - 1,
                joined.previous_live
            );
        } else if count < u64::from(min) {
            tracing::info!(
                "waiting for {} more node(s): {count} joined ({}) of {min}..{max} at {at}, deadline in {remaining}s",
                u64::from(min) - count,
                names.join(", ")
            );
        } else {
            tracing::info!(
                "last call: waiting for up to {} more node(s): {count} joined ({}) of {min}..{max} at {at}",
                u64::from(max).saturating_sub(count),
                names.join(", ")
            );
        }
    }

    async fn timeout_error(&self, joined: &Joined) -> RendezvousError {
        let settings = self.settings;
        let r = joined.round;
        if joined.previous_live > 0 && !joined.moved {
            return RendezvousError::Timeout(format!(
                "rendezvous {:?}: waited {:.0?} (join_timeout) as a late node for round {} ({} node(s)) to re-form, \
                 but its nodes did not come back",
                settings.run_id,
                settings.join_timeout,
                r - 1,
                joined.previous_live
            ));
        }
        let (count, names) = self.arrivals(r).await;
        RendezvousError::Timeout(format!(
            "rendezvous {:?} round {r} timed out after {:.0?} (join_timeout): {count} node(s) joined [{}], but the \
             round needs at least {} (at most {}); {} more node(s) missing",
            settings.run_id,
            settings.join_timeout,
            names.join(", "),
            settings.min_nodes,
            settings.max_nodes,
            u64::from(settings.min_nodes).saturating_sub(count),
        ))
    }
}

struct OutcomeRead {
    cutoff: Option<(i64, u32)>,
    size: Option<Size>,
    master: Option<Master>,
    closed: Option<String>,
}

/// The next item of an optional watch; never, without one.
async fn next_of(watch: &mut Option<(Watcher, u64)>) -> std::result::Result<WatchItem, elastix_etcd::EtcdError> {
    match watch.as_mut() {
        Some((watcher, _)) => watcher.next().await,
        None => std::future::pending().await,
    }
}

/// The workers' store address of round `r`, from the round's outcome watch, up to `deadline`.
pub(super) async fn wait_master(ctx: &Ctx<'_>, r: u64, watcher: &mut Watcher, deadline: Instant) -> Result<Master> {
    let waiting = async {
        loop {
            match watcher.next().await.map_err(|err| ctx.error(err))? {
                WatchItem::Events(events) => {
                    for event in events {
                        let Some(kv) = event.kv else { continue };
                        match ctx.keys.kind(&kv.key) {
                            KeyKind::Master { .. } => return decode(&kv.value, "master address"),
                            KeyKind::Closed { .. } => {
                                return Err(RendezvousError::Closed { run_id: ctx.settings.run_id.clone() })
                            }
                            _ => {}
                        }
                    }
                }
                WatchItem::Compacted { .. } => {
                    let (read, revision) = ctx.read_outcome(r).await?;
                    if let Some(master) = read.master {
                        return Ok(master);
                    }
                    watcher.restart(revision + 1);
                }
            }
        }
    };
    match tokio::time::timeout(ctx.settings.master_wait(deadline), waiting).await {
        Ok(result) => result,
        Err(_) => Err(RendezvousError::Timeout(format!(
            "rendezvous {:?} round {r}: rank 0 never published the workers' store address",
            ctx.settings.run_id
        ))),
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
