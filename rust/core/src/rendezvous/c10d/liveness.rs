//! Heartbeats of a sealed round, and their watchers. Each member writes a numbered beat key
//! every `keep_alive_interval`; each member watches the next rank in the ring by WAITing for
//! that neighbour's next beat (pushed by the store, no polling) and reports it lost when
//! `keep_alive_max_attempt` intervals pass without one. O(1) store operations per node per
//! interval, whatever the job size; one dead node is reported once, by its ring predecessor.
//!
//! Between beats a member waits for an ask ([`Keys::ask`]) rather than sleeping: a member that
//! suspects it gone (its collectives broke) asks through the store, and a live member that
//! reaches the store beats at once ([`ask`]). Only a member that does not answer can be lost.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{sleep, timeout, Instant};

use super::contact::Contact;
use super::events;
use super::keys::Keys;
use crate::rendezvous::change::MembershipChange;
use crate::rendezvous::config::settings::RendezvousSettings;
use crate::rendezvous::error::{RendezvousError, Result};
use crate::rendezvous::node::NodeDesc;
use crate::rendezvous::records::{decode, now_ms, Arrival, Event, FORMAT_VERSION};
use crate::rendezvous::store::{RendezvousStore, StoreConn};

/// What the background tasks of one round share.
#[derive(Clone)]
pub(crate) struct RoundContext<S> {
    pub store: S,
    pub settings: RendezvousSettings,
    pub round: u64,
    pub contact: Arc<Contact>,
    pub changes: Arc<watch::Sender<Option<MembershipChange>>>,
}

/// Starts the beats of `rank`. They also keep [`Contact`]: a store this node cannot reach for
/// as long as the others take to count it lost ends the round for it
/// ([`MembershipChange::StoreUnreachable`]).
pub(crate) fn spawn_heartbeats<S: RendezvousStore>(context: RoundContext<S>, rank: u32) -> JoinHandle<()> {
    tokio::spawn(async move {
        let RoundContext { store, settings, round, contact, changes } = &context;
        let lost_after = settings.node_lost_after();
        let outage_limit = settings.store_outage_limit();
        let mut conn: Option<S::Conn> = None;
        let mut reported = false;
        // asks answered so far: the next one to wait for is one more
        let mut answered = 0u64;
        // a failed beat, or a wait for asks the store left unanswered: the store is out of
        // reach for as long as no request went through
        let mut failed = |err: String, conn: &mut Option<S::Conn>| {
            *conn = None; // a timed-out request leaves the connection unusable
            let (silent_for, first) = contact.failed(Instant::now());
            if first {
                tracing::warn!(
                    round,
                    rank,
                    "heartbeat to the rendezvous store at {} failed: {err}; retrying",
                    store.describe()
                );
            }
            if silent_for >= outage_limit && !reported {
                reported = true;
                let store = store.describe();
                let _ = changes.send(Some(MembershipChange::StoreUnreachable { store, silent_for, error: err }));
            }
        };
        loop {
            match beat(store, &mut conn, settings, *round, rank).await {
                Ok(()) => {
                    crate::metrics::agent::get().heartbeat_sent();
                    if let Some(outage) = contact.succeeded(Instant::now()) {
                        tracing::info!(
                            round,
                            "the rendezvous store at {} answers again after {outage:.1?}",
                            store.describe()
                        );
                    }
                }
                Err(err) => failed(err.to_string(), &mut conn),
            }
            let asleep = Instant::now();
            match next_ask(&mut conn, settings, *round, rank, answered).await {
                Ok(asked) => answered = asked,
                Err(err) => failed(err, &mut conn),
            }
            let late = asleep.elapsed().saturating_sub(settings.keep_alive_interval + ASK_SLACK);
            if late >= lost_after {
                // the whole agent was stopped (SIGSTOP, a frozen machine): the others may have
                // counted it lost meanwhile, which the event log will say
                tracing::warn!(round, "this agent did not run for {late:.1?} (it was stopped or its machine stalled)");
            }
        }
    })
}

async fn beat<S: RendezvousStore>(
    store: &S,
    conn: &mut Option<S::Conn>,
    settings: &RendezvousSettings,
    round: u64,
    rank: u32,
) -> Result<()> {
    let write = async {
        if conn.is_none() {
            *conn = Some(store.connect_site(store.active_site(), settings.heartbeat_timeout).await?);
        }
        let conn = conn.as_mut().expect("connected above");
        let seq = conn.count_up(&Keys::beats(round, rank)).await? as u64;
        conn.set(&Keys::heartbeat(round, rank, seq), now_ms().to_string().as_bytes()).await?;
        if seq > 2 {
            conn.delete(&Keys::heartbeat(round, rank, seq - 2)).await?;
        }
        Ok(())
    };
    match timeout(settings.heartbeat_timeout, write).await {
        Ok(result) => result,
        Err(_) => Err(RendezvousError::Timeout(format!(
            "heartbeat write took longer than {:?} (heartbeat_timeout)",
            settings.heartbeat_timeout
        ))),
    }
}

/// How much longer than the interval a wait for asks may take (its cancel is one round trip):
/// a store that does not answer that is out of reach.
const ASK_SLACK: Duration = Duration::from_secs(1);

/// Waits up to `keep_alive_interval` for ask `answered + 1` to member `rank`, on the beats'
/// connection; returns how many asks have been made so far (answered by the beat that follows).
/// Without a usable connection it sleeps the interval. `Err`: the store did not answer.
async fn next_ask<C: StoreConn>(
    conn: &mut Option<C>,
    settings: &RendezvousSettings,
    round: u64,
    rank: u32,
    answered: u64,
) -> std::result::Result<u64, String> {
    let interval = settings.keep_alive_interval;
    let Some(live) = conn.as_mut() else {
        sleep(interval).await;
        return Ok(answered);
    };
    let asked = async {
        let next = [Keys::ask(round, rank, answered + 1)];
        if live.wait(&next, Some(interval)).await? {
            return Ok::<_, RendezvousError>(live.tally(&Keys::asks(round, rank)).await?.max(0) as u64);
        }
        Ok(answered)
    };
    // a store that stalls holds the cancel of the wait: bounded, and the connection dropped
    match timeout(interval + ASK_SLACK, asked).await {
        Ok(Ok(asked)) => Ok(asked.max(answered)),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no answer to a wait of {interval:?} within {:?} more", ASK_SLACK)),
    }
}

/// Asks member `rank` of `round` whether it is still there, through the store: a member whose
/// agent runs and reaches the store answers with a heartbeat at once. Returns its beat count
/// before the ask, for [`answered`].
pub(crate) async fn ask<C: StoreConn>(conn: &mut C, round: u64, rank: u32) -> Result<i64> {
    let before = conn.tally(&Keys::beats(round, rank)).await?;
    let n = conn.count_up(&Keys::asks(round, rank)).await?;
    conn.set(&Keys::ask(round, rank, n.max(0) as u64), b"").await?;
    Ok(before)
}

/// Whether member `rank` beat after `before` (its count when it was asked), waiting up to
/// `within` for it.
pub(crate) async fn answered<C: StoreConn>(
    conn: &mut C,
    round: u64,
    rank: u32,
    before: i64,
    within: Duration,
) -> Result<bool> {
    let next = [Keys::heartbeat(round, rank, before.max(0) as u64 + 1)];
    if !within.is_zero() && conn.wait(&next, Some(within)).await? {
        return Ok(true);
    }
    // a beat whose key later beats already deleted still counted
    Ok(conn.tally(&Keys::beats(round, rank)).await? > before)
}

/// Watches the next rank of the ring and publishes [`Event::Lost`] once if its beats stop
/// while the round is still the current one.
pub(crate) fn spawn_monitor<S: RendezvousStore>(
    context: RoundContext<S>,
    rank: u32,
    world_size: u32,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let neighbour = (rank + 1) % world_size;
        watch_neighbour(&context, neighbour).await;
    })
}

/// How much later than asked a wait may end and still count as the store answering in time.
const ANSWER_SLACK: Duration = Duration::from_secs(1);

/// The neighbour is lost only if its beats stopped while the store answered this node
/// throughout: a store that stalled or was away (a blip, a SIGSTOP of its host) silences every
/// node alike, so the window starts again once it answers.
async fn watch_neighbour<S: RendezvousStore>(context: &RoundContext<S>, neighbour: u32) {
    let RoundContext { store, settings, round, contact, .. } = context;
    let round = *round;
    let window = settings.node_lost_after();
    let mut conn: Option<S::Conn> = None;
    loop {
        let live = match conn.as_mut() {
            Some(live) => live,
            None => match store.connect_site(store.active_site(), settings.heartbeat_timeout).await {
                Ok(fresh) => conn.insert(fresh),
                Err(err) => {
                    tracing::debug!(round, neighbour, "heartbeat monitor cannot reach the store: {err}");
                    contact.failed(Instant::now());
                    sleep(settings.keep_alive_interval).await;
                    continue;
                }
            },
        };
        let started = Instant::now();
        let silent = async {
            let counter = Keys::beats(round, neighbour);
            let latest = live.tally(&counter).await?;
            let next = [Keys::heartbeat(round, neighbour, latest as u64 + 1)];
            if live.wait(&next, Some(window)).await? {
                return Ok::<_, RendezvousError>(false);
            }
            // a beat whose key write was lost (a link that dropped mid-beat) still counted:
            // any later beat shows the neighbour alive
            Ok(live.tally(&counter).await? == latest)
        };
        match silent.await {
            Ok(false) => continue,
            Ok(true) => {
                let answered_in_time = started.elapsed() <= window + ANSWER_SLACK;
                // this node's own beats must be going through too
                let beating = contact.answered_within(Instant::now(), settings.keep_alive_interval * 2 + ANSWER_SLACK);
                if !answered_in_time || !beating || !contact.undisturbed_since(started) {
                    tracing::debug!(round, neighbour, "no beat while the store itself was unresponsive; not blaming");
                    continue;
                }
                match blame(live, settings, round, neighbour).await {
                    Ok(()) => return,
                    Err(err) => {
                        tracing::debug!(round, neighbour, "heartbeat monitor: {err}");
                        conn = None;
                    }
                }
            }
            Err(err) => {
                tracing::debug!(round, neighbour, "heartbeat monitor lost its connection: {err}");
                contact.failed(Instant::now());
                conn = None;
                sleep(settings.keep_alive_interval).await;
            }
        }
    }
}

/// Reports `neighbour` lost, unless the round ended meanwhile (silence after the round ended
/// is no loss: the neighbour moved on).
async fn blame<C: StoreConn>(conn: &mut C, settings: &RendezvousSettings, round: u64, neighbour: u32) -> Result<()> {
    let node = member(conn, round, neighbour).await;
    let why = format!("no heartbeat for {:?}", settings.node_lost_after());
    report_lost(conn, round, neighbour, node, &why).await.map(drop)
}

/// Reports member `rank` of `round` lost (for `why`), once however many members find it: the
/// first report counts it in [`Keys::lost_count`] and tells every member ([`Event::Lost`]).
/// Nothing is reported once the round is over or the job closed. True if this was the report.
pub(crate) async fn report_lost<C: StoreConn>(
    conn: &mut C,
    round: u64,
    rank: u32,
    node: Option<NodeDesc>,
    why: &str,
) -> Result<bool> {
    let current = conn.add(Keys::ROUND, 0).await? as u64;
    if current != round || conn.check(&[Keys::CLOSED.to_owned()]).await? {
        return Ok(false);
    }
    // compare-and-set answers the desired value both when it swaps and when the key already
    // held it: a token of this report's own tells the one report that won
    let token = fastrand::u64(..).to_string();
    if conn.compare_set(&Keys::lost(round, rank), b"", token.as_bytes()).await?.as_ref() != token.as_bytes() {
        return Ok(false); // another member reported it first
    }
    conn.count_up(&Keys::lost_count(round)).await?;
    let who =
        node.as_ref().map_or_else(|| format!("group rank {rank}"), |node| format!("node {node} (group rank {rank})"));
    tracing::warn!("round {round}: {who} lost: {why}");
    events::publish(conn, &Event::Lost { v: FORMAT_VERSION, round, rank, node }).await?;
    Ok(true)
}

/// The node holding `rank` in `round`, if it published itself.
async fn member<C: StoreConn>(conn: &mut C, round: u64, rank: u32) -> Option<NodeDesc> {
    let key = member_key(round, rank);
    match conn.try_get(&key).await {
        Ok(Some(bytes)) => decode::<Arrival>(&bytes, "member").ok()?.node,
        _ => None,
    }
}

/// Where a member announces itself (for loss reports and status tools).
pub(crate) fn member_key(round: u64, rank: u32) -> String {
    Keys::member(round, rank)
}
