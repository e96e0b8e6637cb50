//! c10d's part of [`crate::rendezvous::trust`]: rank 0 reads each member's published address
//! from the round (as it appears, in the background) and lets plain clients from it in.

use std::time::Duration;

use tokio::task::JoinHandle;

use super::liveness::member_key;
use crate::rendezvous::records::{decode, Arrival};
use crate::rendezvous::store::{RendezvousStore, StoreConn};
use crate::rendezvous::trust::let_in;
use crate::store::server::Trusts;

/// Starts learning the members of `round` (ranks 0..`world_size`), for up to `patience` each:
/// a member publishes its address as the round seals, before its workers start.
pub(crate) fn spawn_member_trust<S: RendezvousStore>(
    store: S,
    round: u64,
    world_size: u32,
    patience: Duration,
    trusts: Trusts,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        // in the background: a store that stays away is the agent's to report
        let mut conn = match store.connect_site(store.active_site(), patience).await {
            Ok(conn) => conn,
            Err(err) => return tracing::warn!(round, "cannot read the round's members for the workers' store: {err}"),
        };
        for rank in 0..world_size {
            let arrival = match conn.wait_get(&member_key(round, rank), Some(patience)).await {
                Ok(Some(bytes)) => decode::<Arrival>(&bytes, "member"),
                Ok(None) => continue, // it died with the seal: the round ends without it
                Err(err) => {
                    return tracing::warn!(round, "cannot read the round's members for the workers' store: {err}")
                }
            };
            let Ok(Arrival { node: Some(node), .. }) = arrival else { continue };
            let_in(&trusts, &node, round).await;
        }
    })
}
