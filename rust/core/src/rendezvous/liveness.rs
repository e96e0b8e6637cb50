//! Heartbeats of a sealed round, and their watchers. Each member writes a numbered beat key
//! every `keep_alive_interval`; each member watches the next rank in the ring by WAITing for
//! that neighbour's next beat (pushed by the store, no polling) and reports it lost when
//! `keep_alive_max_attempt` intervals pass without one. O(1) store operations per node per
//! interval, whatever the job size; one dead node is reported once, by its ring predecessor.

use tokio::task::JoinHandle;
use tokio::time::{sleep, timeout};

use super::error::Result;
use super::events;
use super::keys::Keys;
use super::node::NodeDesc;
use super::records::{decode, Arrival, Event, FORMAT_VERSION};
use super::settings::RendezvousSettings;
use super::store::{RendezvousStore, StoreConn};

/// Beat counter of one member: `ADD` returns the beat's number.
fn beat_counter(round: u64, rank: u32) -> String {
    format!("r{round}/hb/{rank}")
}

/// Starts the beats of `rank` in `round`.
pub(crate) fn spawn_heartbeats<S: RendezvousStore>(
    store: S,
    settings: RendezvousSettings,
    round: u64,
    rank: u32,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut conn: Option<S::Conn> = None;
        loop {
            if let Err(err) = beat(&store, &mut conn, &settings, round, rank).await {
                tracing::warn!(round, rank, "heartbeat failed: {err}");
                conn = None; // a timed-out request leaves the connection unusable
            }
            sleep(settings.keep_alive_interval).await;
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
            *conn = Some(store.connect().await?);
        }
        let conn = conn.as_mut().expect("connected above");
        let seq = conn.add(&beat_counter(round, rank), 1).await? as u64;
        conn.set(&Keys::heartbeat(round, rank, seq), b"").await?;
        if seq > 2 {
            conn.delete(&Keys::heartbeat(round, rank, seq - 2)).await?;
        }
        Ok(())
    };
    match timeout(settings.heartbeat_timeout, write).await {
        Ok(result) => result,
        Err(_) => Err(super::error::RendezvousError::Timeout(format!(
            "heartbeat write took longer than {:?} (heartbeat_timeout)",
            settings.heartbeat_timeout
        ))),
    }
}

/// Watches the next rank of the ring and publishes [`Event::Lost`] once if its beats stop
/// while `round` is still the current round.
pub(crate) fn spawn_monitor<S: RendezvousStore>(
    store: S,
    settings: RendezvousSettings,
    round: u64,
    rank: u32,
    world_size: u32,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let neighbour = (rank + 1) % world_size;
        if let Err(err) = watch_neighbour(&store, &settings, round, neighbour).await {
            tracing::warn!(round, rank, neighbour, "heartbeat monitor stopped: {err}");
        }
    })
}

async fn watch_neighbour<S: RendezvousStore>(
    store: &S,
    settings: &RendezvousSettings,
    round: u64,
    neighbour: u32,
) -> Result<()> {
    let mut conn = store.connect().await?;
    loop {
        let latest = conn.add(&beat_counter(round, neighbour), 0).await? as u64;
        let next = [Keys::heartbeat(round, neighbour, latest + 1)];
        if conn.wait(&next, Some(settings.node_lost_after())).await? {
            continue;
        }
        // Silence after the round ended is no loss: the neighbour moved on.
        let current = conn.add(Keys::ROUND, 0).await? as u64;
        if current != round || conn.check(&[Keys::CLOSED.to_owned()]).await? {
            return Ok(());
        }
        let node = member(&mut conn, round, neighbour).await;
        tracing::warn!(round, rank = neighbour, node = ?node, "node lost: no heartbeat for {:?}", settings.node_lost_after());
        events::publish(&mut conn, &Event::Lost { v: FORMAT_VERSION, round, rank: neighbour, node }).await?;
        return Ok(());
    }
}

/// The node holding `rank` in `round`, if it published itself.
async fn member<C: StoreConn>(conn: &mut C, round: u64, rank: u32) -> Option<NodeDesc> {
    let key = member_key(round, rank);
    match conn.check(std::slice::from_ref(&key)).await {
        Ok(true) => conn.get(&key).await.ok().and_then(|bytes| decode::<Arrival>(&bytes, "member").ok()?.node),
        _ => None,
    }
}

/// Where a member announces itself (for loss reports and status tools).
pub(crate) fn member_key(round: u64, rank: u32) -> String {
    format!("r{round}/member/{rank}")
}
