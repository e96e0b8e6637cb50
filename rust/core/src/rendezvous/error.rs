//! Rendezvous errors. Every message says which run and round, and for timeouts who joined
//! and what was still missing.

use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// The job's rendezvous was closed (the job is over); no node may join any more.
    #[error("rendezvous {run_id:?} is closed: the job has finished, no node can join it")]
    Closed { run_id: String },

    /// A node that waited as a spare leaves without counting as a failure: the job finished
    /// without needing it.
    #[error("rendezvous {run_id:?} closed while this node waited as a spare; leaving without error")]
    GracefulExit { run_id: String },

    /// A deadline passed. The message names what happened and who was there.
    #[error("{0}")]
    Timeout(String),

    /// The store could not be reached or failed.
    #[error("rendezvous store error: {0}")]
    Store(#[from] StoreError),

    /// The shared state is not what this version understands (another version of elastix, or
    /// agents started with different settings).
    #[error("{0}")]
    State(String),

    /// The backend no longer knows this node's lease (etcd: it expired while the node was cut
    /// off): the node enters again with a new one.
    #[error("{0}")]
    LeaseGone(String),

    /// The settings are unusable (bad --rdzv-conf, min > max, empty run id, ...).
    #[error("{0}")]
    Config(String),
}

impl RendezvousError {
    /// Whether the store could not be reached or stopped answering (it may come back, or the
    /// state may move to another site), as opposed to an answer that settles the matter.
    pub fn is_store_unreachable(&self) -> bool {
        matches!(self, RendezvousError::Store(err) if err.is_unreachable())
    }
}

pub type Result<T, E = RendezvousError> = std::result::Result<T, E>;
