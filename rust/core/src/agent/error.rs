//! Agent errors: configuration problems, rendezvous failures, and failures to run workers.

use nix::sys::signal::Signal;

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
    /// A stop signal came before the agent was ready to run workers.
    #[error("interrupted by {0}")]
    Interrupted(Signal),
}

impl AgentError {
    /// Whether the rendezvous store could not be reached or stopped answering.
    pub fn is_store_unreachable(&self) -> bool {
        match self {
            AgentError::Rendezvous(err) => err.is_store_unreachable(),
            AgentError::Store(err) => err.is_unreachable(),
            _ => false,
        }
    }

    /// A short name for the kind of error, for launchers that map it to exception types.
    pub fn kind(&self) -> &'static str {
        match self {
            AgentError::Config(_) => "config",
            AgentError::Rendezvous(RendezvousError::Timeout(_)) => "rendezvous_timeout",
            AgentError::Rendezvous(RendezvousError::Closed { .. }) => "rendezvous_closed",
            AgentError::Rendezvous(RendezvousError::Config(_)) => "config",
            AgentError::Rendezvous(_) => "rendezvous",
            AgentError::Store(_) => "store",
            AgentError::Spawn(_) => "spawn",
            AgentError::Io(_) => "io",
            AgentError::Interrupted(_) => "interrupted",
        }
    }
}

pub type Result<T, E = AgentError> = std::result::Result<T, E>;
