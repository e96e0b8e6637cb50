//! The RRef table as this worker's code uses it: every change that lets go of something
//! sends the control messages it asks for, and drops values outside the table's lock.

use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::time::Duration;

use super::{drop_slots, lock, Endpoint, Responder, Value, Waiter};
use crate::interrupt::Interrupt;
use crate::rpc::ids::{ForkId, RRefId, WorkerId};
use crate::rpc::queue::{wait_on, Waited};
use crate::rpc::refs::{ForkData, Handle, RefError, Stats};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ValueError {
    #[error("the OwnerRRef has no value after {0:.3}s (the function that makes it has not finished)")]
    TimedOut(f64),
    #[error("the OwnerRRef was deleted (RPC shut down)")]
    Deleted,
    #[error("interrupted")]
    Interrupted,
}

impl Endpoint {
    pub fn new_owner(&self, value: Value) -> Handle {
        lock(&self.refs).new_owner(value)
    }

    pub fn start_remote(&self, owner: WorkerId) -> (RRefId, ForkId, Handle) {
        lock(&self.refs).start_remote(owner)
    }

    pub fn fork_out(&self, handle: Handle) -> Result<ForkData, RefError> {
        lock(&self.refs).fork_out(handle)
    }

    /// A message carrying `data` could not be sent: undo its fork.
    pub fn fork_not_delivered(self: &Arc<Self>, data: ForkData) {
        let released = lock(&self.refs).fork_not_delivered(data);
        self.post(released);
    }

    pub fn fork_in(self: &Arc<Self>, data: ForkData, parent: WorkerId) -> Handle {
        let (handle, released) = lock(&self.refs).fork_in(data, parent);
        self.post(released);
        handle
    }

    /// This worker's code let go of `handle` (its Python object was collected).
    pub fn release(self: &Arc<Self>, handle: Handle) {
        if self.is_closed() {
            return;
        }
        let released = lock(&self.refs).release(handle);
        self.post(released);
    }

    pub fn is_confirmed(&self, handle: Handle) -> bool {
        lock(&self.refs).is_confirmed(handle)
    }

    /// The owner's value is in: local waiters wake, and the TO_HEREs that waited for it are
    /// returned for the caller to answer.
    pub fn set_value(&self, rref: RRefId, value: Value) -> Vec<Responder> {
        let waiters = match lock(&self.refs).set_value(rref, value) {
            Ok(waiters) => waiters,
            Err(value) => {
                drop(value); // deleted meanwhile: nobody can ask for it
                return Vec::new();
            }
        };
        let mut remote = Vec::new();
        for waiter in waiters {
            match waiter {
                Waiter::Remote(responder) => remote.push(responder),
                Waiter::Local(tx) => {
                    let _ = tx.try_send(());
                }
            }
        }
        remote
    }

    /// Waits until the OwnerRRef `rref` has its value.
    pub fn wait_value(&self, rref: RRefId, timeout: Option<Duration>, interrupt: &Interrupt) -> Result<(), ValueError> {
        let (tx, rx) = sync_channel(1);
        {
            let mut refs = lock(&self.refs);
            if refs.value(rref).is_some() {
                return Ok(());
            }
            if refs.value_or_wait(rref, Waiter::Local(tx)).is_some() {
                return Ok(());
            }
        }
        match wait_on(&rx, timeout, interrupt) {
            Waited::Got(()) => Ok(()),
            Waited::Gone => Err(ValueError::Deleted),
            Waited::TimedOut => Err(ValueError::TimedOut(timeout.unwrap_or_default().as_secs_f64())),
            Waited::Interrupted => Err(ValueError::Interrupted),
        }
    }

    /// Runs `read` on the value of the OwnerRRef `rref`, if it has one.
    pub fn with_value<R>(&self, rref: RRefId, read: impl FnOnce(&Value) -> R) -> Option<R> {
        lock(&self.refs).value(rref).map(read)
    }

    pub fn describe_refs(&self) -> Vec<String> {
        lock(&self.refs).describe()
    }

    pub fn ref_stats(&self) -> Stats {
        lock(&self.refs).stats()
    }

    /// Shutdown: lets go of every fork this worker holds, whatever its code still holds.
    pub fn release_all_users(self: &Arc<Self>) {
        let released = lock(&self.refs).release_all_users();
        self.post(released);
    }

    /// Shutdown, once no worker holds a fork: the OwnerRRefs still held here go.
    pub fn clear_owners(&self) -> usize {
        let dropped = lock(&self.refs).clear_owners();
        let count = dropped.len();
        drop_slots(dropped);
        count
    }
}
