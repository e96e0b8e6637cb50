//! Agent errors: configuration problems, rendezvous failures, and failures to run workers.

use crate::rendezvous::RendezvousError;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Rendezvous(#[from] RendezvousError),
    #[error("store error: {0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    Spawn(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = AgentError> = std::result::Result<T, E>;
