//! What a member of a running round watches, with one watch: its fellow members' keys (a key
//! that vanishes without its node entering the next round is a node whose lease expired: lost),
//! the next round's arrivals (late nodes, or members that went on), the close, and its own
//! lease. No heartbeat keys: etcd's lease is the liveness.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use elastix_etcd::pb::etcdserverpb::TxnRequest;
use elastix_etcd::pb::mvccpb::event::EventType;
use elastix_etcd::pb::mvccpb::Event;
use elastix_etcd::{EtcdClient, LeaseState, WatchItem};

use super::keys::{EtcdKeys, KeyKind};
use super::ops;
use crate::rendezvous::change::MembershipChange;
use crate::rendezvous::node::NodeDesc;
use crate::rendezvous::participant::CloseNote;
use crate::rendezvous::records::{decode, Arrival};

/// What one batch of writes in a round's watch means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Seen {
    Closed(String),
    /// This node's own key vanished: its lease expired.
    SelfLost,
    /// A member's key vanished with no entry into the next round.
    Lost {
        created: i64,
        node: Option<NodeDesc>,
    },
    /// A member entered the next round (it restarted).
    Moved,
    /// A node that was not a member entered the next round.
    Arrived,
    /// Another member asks this one whether it is still there: it answers at `key`.
    Asked {
        key: Vec<u8>,
        nonce: Vec<u8>,
    },
}

/// Reads a batch of events of round `r`'s watch. `last_member` is the creation revision of the
/// round's last member: keys created after it belong to nodes left out of a full round.
pub(super) fn read_events(keys: &EtcdKeys, r: u64, me: &str, last_member: i64, events: &[Event]) -> Vec<Seen> {
    let member_of = |event: &Event, round: u64| -> Option<String> {
        let key = event.kv.as_ref().map(|kv| kv.key.as_slice())?;
        match keys.kind(key) {
            KeyKind::Member { round: of, id } if of == round => Some(id),
            _ => None,
        }
    };
    let is_put = |event: &Event| event.r#type == EventType::Put as i32;
    let entered: HashSet<String> =
        events.iter().filter(|event| is_put(event)).filter_map(|event| member_of(event, r + 1)).collect();
    let left: HashSet<String> =
        events.iter().filter(|event| !is_put(event)).filter_map(|event| member_of(event, r)).collect();
    let mut seen = Vec::new();
    for event in events {
        let Some(kv) = &event.kv else { continue };
        if is_put(event) {
            match keys.kind(&kv.key) {
                KeyKind::Closed { round } if round == r => {
                    seen.push(Seen::Closed(String::from_utf8_lossy(&kv.value).into_owned()));
                    continue;
                }
                KeyKind::Ask { round, id } if round == r && id == me => {
                    if let Some(nonce) = kv.value.strip_prefix(b"?") {
                        seen.push(Seen::Asked { key: kv.key.clone(), nonce: nonce.to_vec() });
                    }
                    continue;
                }
                KeyKind::Closed { .. } | KeyKind::Ask { .. } => continue,
                _ => {}
            }
            if member_of(event, r + 1).is_some_and(|id| !left.contains(&id)) {
                seen.push(Seen::Arrived);
            }
            continue;
        }
        let Some(id) = member_of(event, r) else { continue };
        let previous = event.prev_kv.as_ref();
        if previous.is_some_and(|kv| kv.create_revision > last_member) {
            continue; // a node left out of the full round went on to the next one
        }
        seen.push(if id == me {
            Seen::SelfLost
        } else if entered.contains(&id) {
            Seen::Moved
        } else {
            let node = previous.and_then(|kv| decode::<Arrival>(&kv.value, "member record").ok()).and_then(|a| a.node);
            Seen::Lost { created: previous.map_or(0, |kv| kv.create_revision), node }
        });
    }
    seen
}

/// A member's view of its round, for [`spawn`].
pub(super) struct RoundWatch {
    pub client: EtcdClient,
    pub keys: EtcdKeys,
    pub round: u64,
    pub world_size: u32,
    pub max_nodes: u32,
    pub me: String,
    /// The seal's revision, and the last member's creation revision.
    pub sealed_at: i64,
    pub last_member: i64,
    pub lease_ttl: Duration,
    pub lease_state: watch::Receiver<LeaseState>,
    pub changes: Arc<watch::Sender<Option<MembershipChange>>>,
    pub closed: CloseNote,
}

/// Watches round `watch.round` from its seal on and reports what ends it; after the first
/// such change, only the close still matters (it tells a node at its exit barrier).
pub(super) fn spawn(round: RoundWatch) -> JoinHandle<()> {
    tokio::spawn(async move {
        let r = round.round;
        let range = round.keys.round_watch(r);
        let mut watcher = round.client.watch(&range.key, &range.end, round.sealed_at + 1, true);
        // watched until it reports the end of the lease (once is enough)
        let mut lease_state = Some(round.lease_state.clone());
        // while renewals fail: when the lease lapses unless one gets through
        let mut lapses_at: Option<Instant> = None;
        let mut ended = false;
        loop {
            tokio::select! {
                item = watcher.next() => match item {
                    Ok(WatchItem::Events(events)) => {
                        let last = events.iter().filter_map(|event| event.kv.as_ref()).map(|kv| kv.mod_revision).max();
                        for seen in read_events(&round.keys, r, &round.me, round.last_member, &events) {
                            if let Some(change) = round.change(seen).await {
                                ended |= change != MembershipChange::Closed;
                                if round.changes.send(Some(change)).is_err() {
                                    return; // nobody listens any more
                                }
                            }
                        }
                        if ended {
                            // from here on only the close matters: watch the round's outcome alone
                            let outcome = round.keys.outcome(r);
                            let from = last.map_or(round.sealed_at, |last| last) + 1;
                            watcher = round.client.watch(&outcome.key, &outcome.end, from, false);
                            ended = false;
                            lease_state = None;
                        }
                    }
                    Ok(WatchItem::Compacted { revision }) => match round.resync().await {
                        Ok((change, read_at)) => {
                            tracing::info!(round = r, "etcd compacted the history up to revision {revision}; read the round again at {read_at}");
                            if let Some(change) = change {
                                let _ = round.changes.send(Some(change));
                            }
                            watcher.restart(read_at + 1);
                        }
                        Err(err) => tracing::debug!(round = r, "reading the round again after a compaction: {err}"),
                    },
                    Err(err) => {
                        tracing::warn!(round = r, "etcd refused the round's watch: {err}");
                        return;
                    }
                },
                state = lease_changed(&mut lease_state) => match state {
                    LeaseState::Alive => lapses_at = None,
                    LeaseState::Failing { renewed_at, .. } => lapses_at = Some(renewed_at + round.lease_ttl),
                    over => {
                        if let Some(change) = round.lease_change(&over) {
                            let _ = round.changes.send(Some(change));
                        }
                        (lease_state, lapses_at) = (None, None);
                    }
                },
                () = sleep_until_some(lapses_at) => {
                    // cut off from a cluster others may reach: they count this node lost. Every
                    // endpoint refusing is no proof that etcd is down for everyone (a firewall
                    // that rejects looks the same), so this node stops its workers all the same
                    lapses_at = None;
                    let change = MembershipChange::StoreUnreachable {
                        store: format!("etcd {}", round.client.endpoints()),
                        silent_for: round.lease_ttl,
                        error: format!(
                            "this node's lease can no longer be live: no renewal got through for its TTL ({:?})",
                            round.lease_ttl
                        ),
                    };
                    let _ = round.changes.send(Some(change));
                    lease_state = None;
                },
            }
        }
    })
}

/// The lease's next state; never, once its end was reported (`None`) or when nobody renews it
/// any more.
async fn lease_changed(watched: &mut Option<watch::Receiver<LeaseState>>) -> LeaseState {
    if let Some(receiver) = watched {
        if receiver.changed().await.is_ok() {
            return receiver.borrow_and_update().clone();
        }
    }
    std::future::pending().await
}

/// Sleeps until `at`; never without it.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl RoundWatch {
    async fn change(&self, seen: Seen) -> Option<MembershipChange> {
        match seen {
            Seen::Closed(reason) => {
                self.closed.set(reason);
                Some(MembershipChange::Closed)
            }
            Seen::SelfLost => self.lease_change(&LeaseState::Expired),
            Seen::Moved => Some(MembershipChange::RoundSuperseded { round: self.round + 1 }),
            Seen::Arrived => (self.world_size < self.max_nodes).then_some(MembershipChange::NodesWaiting),
            Seen::Asked { key, nonce } => {
                // alive and reaching etcd: the answer is the proof
                let answer = [b"!".as_slice(), &nonce].concat();
                if let Err(err) = self.client.put(&key, &answer).await {
                    tracing::debug!(round = self.round, "could not answer another member's ask: {err}");
                }
                None
            }
            Seen::Lost { created, node } => {
                let rank = self.rank_of(created).await;
                Some(MembershipChange::NodeLost { rank, node })
            }
        }
    }

    fn lease_change(&self, state: &LeaseState) -> Option<MembershipChange> {
        let (silent_for, error) = match state {
            LeaseState::Alive | LeaseState::Failing { .. } => return None,
            LeaseState::Expired => (self.lease_ttl, "etcd says this node's lease expired".to_owned()),
            LeaseState::Unreachable { silent_for, detail } => (*silent_for, detail.clone()),
        };
        let store = format!("etcd {}", self.client.endpoints());
        Some(MembershipChange::StoreUnreachable { store, silent_for, error })
    }

    /// The rank of the member whose key was created at `created`: the members created before it.
    async fn rank_of(&self, created: i64) -> Option<u32> {
        let request = ops::keys_created_before(&self.keys.members(self.round), self.sealed_at, created);
        match self.client.range(request).await {
            Ok(response) => Some(response.kvs.len() as u32),
            Err(err) => {
                tracing::debug!(round = self.round, "cannot tell the lost node's rank: {err}");
                None
            }
        }
    }

    /// After the watch's history was compacted: reads what it may have missed.
    async fn resync(&self) -> Result<(Option<MembershipChange>, i64), elastix_etcd::EtcdError> {
        let (keys, r) = (&self.keys, self.round);
        let request = TxnRequest {
            success: vec![
                ops::get(&keys.closed_marker(r)),
                ops::count(&keys.members(r), 0),
                ops::count(&keys.members(r + 1), 0),
            ],
            ..Default::default()
        };
        let response = self.client.txn(request).await?;
        let revision = ops::revision(&response);
        if let Some(reason) = ops::value(&response, 0) {
            return Ok((self.change(Seen::Closed(String::from_utf8_lossy(&reason).into_owned())).await, revision));
        }
        let change = if ops::counted(&response, 1) < u64::from(self.world_size) {
            Some(MembershipChange::RoundSuperseded { round: r + 1 })
        } else if ops::counted(&response, 2) > 0 {
            self.change(Seen::Arrived).await
        } else {
            None
        };
        Ok((change, revision))
    }
}

#[cfg(test)]
mod tests {
    use elastix_etcd::pb::mvccpb::KeyValue;

    use super::*;
    use crate::rendezvous::records::{encode, FORMAT_VERSION};

    fn put(key: Vec<u8>, value: &[u8]) -> Event {
        Event {
            r#type: EventType::Put as i32,
            kv: Some(KeyValue { key, value: value.to_vec(), ..Default::default() }),
            prev_kv: None,
        }
    }

    fn delete(key: Vec<u8>, created: i64, node: Option<NodeDesc>) -> Event {
        let value = encode(&Arrival { v: FORMAT_VERSION, node });
        Event {
            r#type: EventType::Delete as i32,
            kv: Some(KeyValue { key: key.clone(), ..Default::default() }),
            prev_kv: Some(KeyValue { key, value, create_revision: created, ..Default::default() }),
        }
    }

    #[test]
    fn a_member_that_vanishes_is_lost_and_one_that_went_on_restarted() {
        let keys = EtcdKeys::new("/p/".into());
        let node = NodeDesc { order: None, addr: "b".into(), pid: 7, local_id: 0, presence: None };
        let lost = read_events(&keys, 4, "me", 100, &[delete(keys.member(4, "b"), 20, Some(node.clone()))]);
        assert_eq!(lost, vec![Seen::Lost { created: 20, node: Some(node) }]);
        let moved = [delete(keys.member(4, "c"), 21, None), put(keys.member(5, "c"), b"{}")];
        assert_eq!(read_events(&keys, 4, "me", 100, &moved), vec![Seen::Moved]);
        assert_eq!(read_events(&keys, 4, "me", 100, &[delete(keys.member(4, "me"), 22, None)]), vec![Seen::SelfLost]);
    }

    #[test]
    fn newcomers_closes_and_nodes_left_out_of_a_full_round_are_told_apart() {
        let keys = EtcdKeys::new("/p/".into());
        assert_eq!(read_events(&keys, 4, "me", 100, &[put(keys.member(5, "new"), b"{}")]), vec![Seen::Arrived]);
        let closed = read_events(&keys, 4, "me", 100, &[put(keys.closed_marker(4), b"succeeded")]);
        assert_eq!(closed, vec![Seen::Closed("succeeded".into())]);
        // a spare (created after the last member) moving on disturbs nobody
        let spare = [delete(keys.member(4, "s"), 101, None), put(keys.member(5, "s"), b"{}")];
        assert_eq!(read_events(&keys, 4, "me", 100, &spare), vec![]);
        // the outcome keys the round already knows are not news
        assert_eq!(read_events(&keys, 4, "me", 100, &[put(keys.master(4), b"{}"), put(keys.size(4), b"{}")]), vec![]);
    }
}
