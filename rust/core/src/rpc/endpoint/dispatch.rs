//! What a connection's reader does with each frame. Requests go to Python's queue (a
//! TO_HERE whose value is not there yet waits in the OwnerRRef instead); control messages
//! are applied to the RRef table and acked here; answers complete their calls.

use std::sync::Arc;

use super::conn::ConnTx;
use super::{lock, Endpoint, Incoming, Message, Responder, Waiter};
use crate::rpc::frame::{op, status, Frame, Kind};
use crate::rpc::ids::WorkerId;
use crate::rpc::refs::Released;

impl Endpoint {
    pub(super) fn dispatch(self: &Arc<Self>, frame: Frame, from: WorkerId, answers: &ConnTx) {
        match frame.kind {
            Kind::Request => self.request(frame, from, answers),
            Kind::Response => {
                let message = Message { status: frame.status, payload: frame.payload, buffers: frame.buffers };
                self.finish_call(frame.id, Ok(message));
            }
            Kind::Control => self.control_arrived(frame, from, answers),
            Kind::ControlAck => self.control_acked(frame.id),
        }
    }

    fn request(self: &Arc<Self>, frame: Frame, from: WorkerId, answers: &ConnTx) {
        let responder = Responder { id: frame.id, tx: answers.clone() };
        match frame.op {
            op::CALL => {}
            op::REMOTE => lock(&self.refs).remote_arrived(frame.rref, frame.fork, from),
            op::TO_HERE => {
                let mut refs = lock(&self.refs);
                if refs.value_or_wait(frame.rref, Waiter::Remote(responder.clone())).is_none() {
                    return; // answered by whoever sets the value
                }
            }
            other => {
                let text = format!("unknown RPC request {other}: the caller runs another version of elastix");
                let payload = text.into_bytes().into();
                responder.respond(Message { status: status::REFUSED, payload, buffers: Vec::new() });
                return;
            }
        }
        let message = Message { status: frame.status, payload: frame.payload, buffers: frame.buffers };
        let incoming = Incoming { from, op: frame.op, rref: frame.rref, fork: frame.fork, message, responder };
        self.requests.push(incoming);
    }

    fn control_arrived(self: &Arc<Self>, frame: Frame, from: WorkerId, answers: &ConnTx) {
        let released = {
            let mut refs = lock(&self.refs);
            match frame.op {
                op::FORK_REQUEST => {
                    refs.fork_requested(frame.rref, frame.fork);
                    Released::default()
                }
                op::CHILD_ACCEPT => refs.child_accepted(frame.fork),
                op::USER_DELETE => refs.fork_deleted(frame.rref, frame.fork),
                other => {
                    tracing::warn!("rpc: ignoring unknown control message {other} from {}", self.describe(from));
                    return;
                }
            }
        };
        self.post(released);
        self.delayed(answers.clone(), Frame::ack(frame.id));
    }
}
