//! `elastix status`'s questions (a job's state; the runs a store holds), put to the reader of
//! the backend they name.

use super::error::{RendezvousError, Result};
use super::kind::BackendKind;
use super::status::{JobStatus, StatusQuery};

fn no_shared_state() -> RendezvousError {
    RendezvousError::Config("--rdzv-backend static keeps no shared state for elastix status to read".into())
}

/// The job's state, or `None` when the store answers but holds no run with that ID.
pub async fn job_status(query: &StatusQuery) -> Result<Option<JobStatus>> {
    if query.run_id.is_empty() {
        return Err(RendezvousError::Config("--rdzv-id must not be empty".into()));
    }
    match BackendKind::parse(&query.backend)? {
        BackendKind::C10d => super::c10d::status::c10d_status(query).await,
        BackendKind::Etcd => super::etcd::etcd_status(query).await,
        BackendKind::Static => Err(no_shared_state()),
    }
}

/// The run IDs the store (c10d) or cluster (etcd) at the query's endpoint holds, in the order
/// they were first made (etcd: by name); the query's run ID is not used.
pub async fn job_runs(query: &StatusQuery) -> Result<Vec<String>> {
    match BackendKind::parse(&query.backend)? {
        BackendKind::C10d => super::c10d::status::c10d_runs(query).await,
        BackendKind::Etcd => super::etcd::etcd_runs(query).await,
        BackendKind::Static => Err(no_shared_state()),
    }
}
