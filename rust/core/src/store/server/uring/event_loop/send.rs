//! Replies: one send per connection and turn, carrying what its requests queued meanwhile.

use std::os::fd::AsRawFd;

use io_uring::{opcode, types};

use super::super::ring::Op;
use super::EventLoop;
use crate::store::server::connection::gone;

impl EventLoop {
    pub(super) fn queue_send(&mut self, slot: u32) {
        let Some(conn) = self.conns[slot as usize].as_mut() else { return };
        if !conn.send_queued && !conn.replies.is_empty() {
            conn.send_queued = true;
            self.to_send.push(slot);
        }
    }

    /// One send per connection with replies and none in flight: this turn's replies, together.
    pub(super) fn send_replies(&mut self) {
        let mut to_send = std::mem::take(&mut self.to_send);
        for slot in to_send.drain(..) {
            let Some(conn) = self.conns[slot as usize].as_mut() else { continue };
            conn.send_queued = false;
            if conn.closing || conn.send_in_flight || conn.replies.is_empty() {
                continue;
            }
            std::mem::swap(&mut conn.replies, &mut conn.sending);
            conn.send_in_flight = true;
            self.send_rest(slot);
        }
        self.to_send = to_send;
    }

    /// Sends what the kernel has not taken yet of the connection's `sending`.
    pub(super) fn send_rest(&mut self, slot: u32) {
        let Some(conn) = self.conns[slot as usize].as_ref() else { return };
        let rest = &conn.sending[conn.sent..];
        let len = u32::try_from(rest.len()).unwrap_or(u32::MAX);
        let send = opcode::Send::new(types::Fd(conn.fd.as_raw_fd()), rest.as_ptr(), len).flags(libc::MSG_NOSIGNAL);
        self.push(&send.build().user_data(Op::Send(slot).token()));
    }

    pub(super) fn sent(&mut self, slot: u32, result: i32) {
        let Some(conn) = self.conns[slot as usize].as_mut() else { return };
        if result < 0 {
            conn.sent_all();
            if !conn.closing {
                let err = std::io::Error::from_raw_os_error(-result);
                self.close(slot, if gone(&err) { Ok(()) } else { Err(err.into()) });
            }
        } else {
            conn.sent += result as usize;
            if conn.sent < conn.sending.len() && !conn.closing {
                self.send_rest(slot);
            } else {
                conn.sent_all();
                self.queue_send(slot);
                self.resume(slot);
            }
        }
        self.free_if_finished(slot);
    }
}
