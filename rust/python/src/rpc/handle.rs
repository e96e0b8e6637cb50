//! `RRefHandle`: what a Python RRef holds. Dropping it (the RRef was collected) tells the
//! RRef table, which sends USER_DELETE, or deletes the OwnerRRef, when that was the last.

use std::sync::{Arc, Weak};

use elastix_core::rpc::endpoint::Endpoint;
use elastix_core::rpc::ids::Gid;
use elastix_core::rpc::refs::Handle;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use super::{tuple, GidTuple};

#[pyclass(module = "elastix._core", frozen)]
pub struct RRefHandle {
    endpoint: Weak<Endpoint>,
    handle: Handle,
    owner: u32,
    rref: GidTuple,
}

impl RRefHandle {
    pub fn new(endpoint: &Arc<Endpoint>, handle: Handle, owner: u32, rref: Gid) -> RRefHandle {
        RRefHandle { endpoint: Arc::downgrade(endpoint), handle, owner, rref: tuple(rref) }
    }

    fn endpoint(&self) -> PyResult<Arc<Endpoint>> {
        self.endpoint.upgrade().ok_or_else(|| PyRuntimeError::new_err("RPC is not running on this worker"))
    }
}

impl Drop for RRefHandle {
    fn drop(&mut self) {
        if let Some(endpoint) = self.endpoint.upgrade() {
            endpoint.release(self.handle);
        }
    }
}

#[pymethods]
impl RRefHandle {
    fn is_owner(&self) -> bool {
        matches!(self.handle, Handle::Owner(_))
    }

    /// The owner's rank.
    fn owner(&self) -> u32 {
        self.owner
    }

    fn rref_id(&self) -> GidTuple {
        self.rref
    }

    /// This fork's id (for an OwnerRRef, its RRef id).
    fn fork_id(&self) -> GidTuple {
        match self.handle {
            Handle::Owner(rref) | Handle::User(rref) => tuple(rref),
        }
    }

    fn confirmed(&self) -> PyResult<bool> {
        Ok(self.endpoint()?.is_confirmed(self.handle))
    }

    /// A new fork to send: (owner, rref id, fork id).
    fn fork_out(&self) -> PyResult<(u32, GidTuple, GidTuple)> {
        let data = self.endpoint()?.fork_out(self.handle).map_err(|err| PyRuntimeError::new_err(err.to_string()))?;
        Ok((data.owner, tuple(data.rref), tuple(data.fork)))
    }
}
