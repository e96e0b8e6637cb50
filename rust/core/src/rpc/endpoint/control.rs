//! Reference-counting messages: each waits for its ack and is sent again, on a new
//! connection, if its connection is lost first. They are idempotent, so a repeat is harmless;
//! a message whose peer stays unreachable is dropped after [`GIVE_UP`] (the peer is gone, and
//! with it what the message was about).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::conn::ConnTx;
use super::{drop_slots, lock, Endpoint};
use crate::rpc::frame::{op, Frame};
use crate::rpc::ids::{Gid, WorkerId};
use crate::rpc::refs::{Control, Released, Send};

const GIVE_UP: Duration = Duration::from_secs(60);
const FIRST_RETRY: Duration = Duration::from_millis(20);
const MAX_RETRY: Duration = Duration::from_secs(2);

pub(super) struct PendingControl {
    peer: WorkerId,
    frame: Frame,
    attempts: u32,
    since: Instant,
}

impl Endpoint {
    /// Sends what the RRef table asked for, and drops what it let go of.
    pub(super) fn post(self: &Arc<Self>, released: Released<super::Value, super::Waiter>) {
        for Send { to, msg } in released.sends {
            let (code, rref, fork) = match msg {
                Control::ForkRequest { rref, fork } => (op::FORK_REQUEST, rref, fork),
                Control::ChildAccept { fork } => (op::CHILD_ACCEPT, Gid::default(), fork),
                Control::UserDelete { rref, fork } => (op::USER_DELETE, rref, fork),
            };
            let id = self.next_id();
            let frame = Frame::control(code, id, rref, fork);
            let pending = PendingControl { peer: to, frame: frame.clone(), attempts: 0, since: Instant::now() };
            lock(&self.control).insert(id, pending);
            match self.test_delay() {
                None => self.send(to, frame),
                Some(delay) => {
                    let endpoint = self.clone();
                    let task = self.runtime.spawn(async move {
                        tokio::time::sleep(delay).await;
                        endpoint.send(to, frame);
                    });
                    self.track(task.abort_handle());
                }
            }
        }
        drop_slots(released.dropped);
    }

    /// The test hook's delay for the next control message or ack, if any.
    fn test_delay(&self) -> Option<Duration> {
        let (low, high) = self.control_delay?;
        let span = high.saturating_sub(low).as_micros() as u64;
        Some(low + Duration::from_micros(fastrand::u64(0..=span)))
    }

    /// Sends an ack on the connection its message came on, after the test hook's delay.
    pub(super) fn delayed(self: &Arc<Self>, answers: ConnTx, frame: Frame) {
        match self.test_delay() {
            None => {
                let _ = answers.send(frame);
            }
            Some(delay) => {
                let task = self.runtime.spawn(async move {
                    tokio::time::sleep(delay).await;
                    let _ = answers.send(frame);
                });
                self.track(task.abort_handle());
            }
        }
    }

    pub(super) fn control_acked(self: &Arc<Self>, id: u64) {
        let Some(pending) = lock(&self.control).remove(&id) else { return }; // a repeat's ack
        if pending.frame.op == op::FORK_REQUEST {
            let released = lock(&self.refs).fork_confirmed(pending.frame.fork);
            self.post(released);
        }
    }

    /// Sends control message `id` again after a backoff, unless it is acked by then.
    pub(super) fn retry_control(self: &Arc<Self>, id: u64) {
        let (peer, frame, wait) = {
            let mut control = lock(&self.control);
            let Some(pending) = control.get_mut(&id) else { return };
            if pending.since.elapsed() > GIVE_UP {
                let pending = control.remove(&id).expect("present");
                tracing::warn!(
                    "rpc: giving up on a reference-counting message to {}: unreachable for {}s",
                    self.describe(pending.peer),
                    GIVE_UP.as_secs()
                );
                return;
            }
            pending.attempts += 1;
            let wait = FIRST_RETRY.saturating_mul(1 << pending.attempts.min(10)).min(MAX_RETRY);
            (pending.peer, pending.frame.clone(), wait)
        };
        let endpoint = self.clone();
        let task = self.runtime.spawn(async move {
            tokio::time::sleep(wait).await;
            if lock(&endpoint.control).contains_key(&id) {
                endpoint.send(peer, frame);
            }
        });
        self.track(task.abort_handle());
    }

    pub(super) fn retry_controls_to(self: &Arc<Self>, peer: WorkerId) {
        let ids: Vec<u64> =
            lock(&self.control).iter().filter(|(_, pending)| pending.peer == peer).map(|(id, _)| *id).collect();
        for id in ids {
            self.retry_control(id);
        }
    }
}
