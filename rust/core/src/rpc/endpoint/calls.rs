//! Calls waiting for their answer: each is answered once, by its response, its timeout, the
//! loss of its peer, or the endpoint's close, whichever comes first.

use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::{lock, Completion, Endpoint, Message};
use crate::interrupt::Interrupt;
use crate::rpc::frame::{op, Frame, Kind};
use crate::rpc::ids::{Gid, WorkerId};
use crate::rpc::queue::{wait_on, Waited};

#[derive(Clone, Debug, thiserror::Error)]
pub enum CallError {
    #[error("{0}")]
    Timeout(String),
    /// The callee died, or cannot be reached: the call may or may not have run.
    #[error("{0}")]
    PeerGone(String),
    #[error("{0}")]
    Shutdown(String),
    /// Bad input from this worker's code (an unknown rank, a closed endpoint).
    #[error("{0}")]
    Refused(String),
    /// A signal handler raised while the caller waited.
    #[error("interrupted")]
    Interrupted,
}

pub(super) enum Deliver {
    Sync(SyncSender<Result<Message, CallError>>),
    Async(u64),
}

pub(super) struct PendingCall {
    pub peer: WorkerId,
    pub op: u8,
    pub fork: Gid,
    deliver: Deliver,
}

/// What a call sends.
pub struct Request {
    pub to: WorkerId,
    pub op: u8,
    pub rref: Gid,
    pub fork: Gid,
    pub payload: Bytes,
    pub buffers: Vec<Bytes>,
}

impl Endpoint {
    fn check_target(&self, to: WorkerId) -> Result<(), CallError> {
        if self.is_closed() {
            return Err(CallError::Refused("RPC is not running on this worker (shut down)".into()));
        }
        if to as usize >= self.peers().len() {
            return Err(CallError::Refused(format!("rank {to} is not in this RPC group of {}", self.world())));
        }
        Ok(())
    }

    fn register(self: &Arc<Self>, request: Request, deliver: Deliver) -> u64 {
        let id = self.next_id();
        let pending = PendingCall { peer: request.to, op: request.op, fork: request.fork, deliver };
        lock(&self.calls).insert(id, pending);
        let frame = Frame {
            kind: Kind::Request,
            op: request.op,
            status: 0,
            id,
            rref: request.rref,
            fork: request.fork,
            payload: request.payload,
            buffers: request.buffers,
        };
        self.send(request.to, frame);
        id
    }

    /// Sends `request` and waits for its answer, up to `timeout`; `interrupt` is asked now
    /// and then whether to give up (Ctrl-C).
    pub fn call_sync(
        self: &Arc<Self>,
        request: Request,
        timeout: Option<Duration>,
        interrupt: &Interrupt,
    ) -> Result<Message, CallError> {
        self.check_target(request.to)?;
        let to = request.to;
        let (tx, rx) = sync_channel(1);
        let id = self.register(request, Deliver::Sync(tx));
        let gave_up = match wait_on(&rx, timeout, interrupt) {
            Waited::Got(result) => return result,
            Waited::Gone => return Err(CallError::Shutdown("RPC was shut down on this worker".into())),
            Waited::TimedOut => self.timeout_error(to, timeout.unwrap_or_default()),
            Waited::Interrupted => CallError::Interrupted,
        };
        if lock(&self.calls).remove(&id).is_none() {
            // answered meanwhile
            if let Ok(result) = rx.try_recv() {
                return result;
            }
        }
        Err(gave_up)
    }

    /// Sends `request`; its answer comes out of `next_completion` with `token`.
    pub fn call_async(
        self: &Arc<Self>,
        request: Request,
        token: u64,
        timeout: Option<Duration>,
    ) -> Result<(), CallError> {
        self.check_target(request.to)?;
        let to = request.to;
        let id = self.register(request, Deliver::Async(token));
        if let Some(timeout) = timeout {
            let endpoint = Arc::downgrade(self);
            let timer = self.runtime.spawn(async move {
                tokio::time::sleep(timeout).await;
                if let Some(endpoint) = endpoint.upgrade() {
                    let error = endpoint.timeout_error(to, timeout);
                    endpoint.finish_call(id, Err(error));
                }
            });
            drop(timer);
        }
        Ok(())
    }

    fn timeout_error(&self, to: WorkerId, timeout: Duration) -> CallError {
        CallError::Timeout(format!(
            "RPC to {} timed out after {:.3}s: no answer (the call may still run there)",
            self.describe(to),
            timeout.as_secs_f64()
        ))
    }

    /// Answers call `id`, if it still waits. A REMOTE's answer confirms the caller's fork.
    pub(super) fn finish_call(self: &Arc<Self>, id: u64, result: Result<Message, CallError>) {
        let Some(pending) = lock(&self.calls).remove(&id) else { return };
        if pending.op == op::REMOTE {
            let released = match &result {
                Ok(_) => lock(&self.refs).remote_confirmed(pending.fork),
                Err(CallError::PeerGone(_) | CallError::Shutdown(_)) => lock(&self.refs).owner_lost(pending.fork),
                Err(_) => Default::default(),
            };
            self.post(released);
        }
        match pending.deliver {
            Deliver::Sync(tx) => {
                let _ = tx.try_send(result);
            }
            Deliver::Async(token) => {
                self.completions.push(Completion { token, result });
            }
        }
    }

    /// Fails every call waiting on `peer` (or on anyone, with `None`).
    pub(super) fn fail_calls_to(self: &Arc<Self>, peer: Option<WorkerId>, error: impl Fn() -> CallError) {
        let ids: Vec<u64> = lock(&self.calls)
            .iter()
            .filter(|(_, pending)| peer.map_or(true, |peer| pending.peer == peer))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.finish_call(id, Err(error()));
        }
    }

    pub(super) fn fail_all_calls(self: &Arc<Self>, error: impl Fn() -> CallError) {
        self.fail_calls_to(None, error);
    }
}
