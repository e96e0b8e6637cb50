//! Where a round's store is, for the agent's background tasks (the checkpoint ring, the
//! stragglers' exchange), each of which opens a connection of its own to it.

use std::time::Duration;

use crate::auth::Secret;
use crate::store::{StoreError, TcpStore, TcpStoreOptions};

/// How long one of a background task's store requests may take.
const PATIENCE: Duration = Duration::from_secs(5);

/// The round's store, and the prefix of the round's keys.
#[derive(Clone, Debug)]
pub struct RoundStore {
    pub host: String,
    pub port: u16,
    pub prefix: String,
    pub secret: Option<Secret>,
}

impl RoundStore {
    /// A connection of the task's own: quiet, since a store outage is the agent's to report
    /// (a second countdown of the same outage would only confuse).
    pub async fn open(&self) -> Result<TcpStore, StoreError> {
        let options = TcpStoreOptions {
            timeout: Some(PATIENCE),
            secret: self.secret.clone(),
            quiet: true,
            ..TcpStoreOptions::new(self.host.clone(), self.port)
        };
        TcpStore::open(options).await
    }
}
