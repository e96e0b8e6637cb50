//! `elastix status`'s questions (a job's state; the runs a store holds), put to the reader of
//! the backend they name.

use super::error::{RendezvousError, Result};
use super::status::{JobStatus, StatusQuery};

/// The job's state, or `None` when the store answers but holds no run with that ID.
pub async fn job_status(query: &StatusQuery) -> Result<Option<JobStatus>> {
    if query.run_id.is_empty() {
        return Err(RendezvousError::Config("--rdzv-id must not be empty".into()));
    }
    match query.backend.as_str() {
        "c10d" => super::c10d::status::c10d_status(query).await,
        "etcd" | "etcd-v3" => super::etcd::etcd_status(query).await,
        "static" => Err(RendezvousError::Config(
            "--rdzv-backend static keeps no shared state for elastix status to read".into(),
        )),
        other => Err(unknown(other)),
    }
}

/// The run IDs the store (c10d) or cluster (etcd) at the query's endpoint holds, in the order
/// they were first made (etcd: by name); the query's run ID is not used.
pub async fn job_runs(query: &StatusQuery) -> Result<Vec<String>> {
    match query.backend.as_str() {
        "c10d" => super::c10d::status::c10d_runs(query).await,
        "etcd" | "etcd-v3" => super::etcd::etcd_runs(query).await,
        "static" => Err(RendezvousError::Config(
            "--rdzv-backend static keeps no shared state for elastix status to read".into(),
        )),
        other => Err(unknown(other)),
    }
}

fn unknown(backend: &str) -> RendezvousError {
    RendezvousError::Config(format!("--rdzv-backend {backend:?} is unknown; elastix status reads c10d and etcd"))
}
