//! The run's event log: a counter plus one key per event, so that a waiter blocks on the next
//! event's key (a push from the store) and every event costs O(1) per interested node.
//! Events are rare by construction: a round opening, the first late node of a round, a lost
//! node, the end of the job.

use std::time::Duration;

use super::keys::Keys;
use crate::rendezvous::error::Result;
use crate::rendezvous::records::{decode, encode, Event};
use crate::rendezvous::store::StoreConn;

/// Appends `event` to the log. Producers change the state first and publish after, so a
/// reader that sees the event also sees the change.
pub(crate) async fn publish<C: StoreConn>(conn: &mut C, event: &Event) -> Result<()> {
    let n = conn.count_up(Keys::EVENTS).await?;
    conn.set(&Keys::event(n), &encode(event)).await
}

/// Number of events published so far; the next one will be `count + 1`.
pub(crate) async fn count<C: StoreConn>(conn: &mut C) -> Result<i64> {
    conn.tally(Keys::EVENTS).await
}

/// Waits up to `timeout` for event number `n`.
pub(crate) async fn wait_for<C: StoreConn>(conn: &mut C, n: i64, timeout: Option<Duration>) -> Result<Option<Event>> {
    match conn.wait_get(&Keys::event(n), timeout).await? {
        Some(bytes) => Ok(Some(decode(&bytes, "event")?)),
        None => Ok(None),
    }
}
