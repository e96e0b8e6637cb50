//! The connection to a round's store the agent keeps (the rank exchange, the exit barrier).

use std::time::Duration;

use crate::agent::error::Result;
use crate::auth::Secret;
use crate::store::{TcpStore, TcpStoreOptions};

/// A connection to the round's store at `at` (host, port), proving `secret`, kept in `slot`
/// while it stays usable; a new one is tried for up to `patience`.
pub(super) async fn connect_store<'a>(
    slot: &'a mut Option<TcpStore>,
    at: &(String, u16),
    secret: Option<&Secret>,
    patience: Duration,
) -> Result<&'a mut TcpStore> {
    let reusable =
        slot.as_ref().is_some_and(|store| store.client().is_usable() && store.host() == at.0 && store.port() == at.1);
    if !reusable {
        let options = TcpStoreOptions {
            timeout: Some(patience),
            secret: secret.cloned(),
            ..TcpStoreOptions::new(at.0.clone(), at.1)
        };
        *slot = Some(TcpStore::open(options).await?);
    }
    Ok(slot.as_mut().expect("opened above"))
}
