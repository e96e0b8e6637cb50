//! Bytes received: executed as requests, the waits they completed answered, the receive
//! rearmed, or paused while the client's replies back up.

use std::os::fd::AsRawFd;

use io_uring::{cqueue, opcode, types};

use super::super::conn::Serving;
use super::super::pool::GROUP;
use super::super::ring::Op;
use super::EventLoop;
use crate::store::server::connection::{gone, CloseReason};

impl EventLoop {
    pub(super) fn arm_receive(&mut self, slot: u32) {
        let Some(conn) = self.conns[slot as usize].as_mut() else { return };
        conn.receiving = true;
        let recv = opcode::RecvMulti::new(types::Fd(conn.fd.as_raw_fd()), GROUP).build();
        self.push(&recv.user_data(Op::Recv(slot).token()));
    }

    pub(super) fn received(&mut self, slot: u32, result: i32, flags: u32) {
        let Some(conn) = self.conns[slot as usize].as_mut() else { return };
        let armed = cqueue::more(flags);
        conn.receiving = armed;
        let closing = conn.closing;
        let outcome = if result > 0 {
            let buffer = cqueue::buffer_select(flags).expect("received bytes come in a pool buffer");
            let served = if closing { Ok(()) } else { self.serve(slot, buffer, result as usize) };
            self.pool.give_back(buffer);
            served.map_err(Some)
        } else if result == 0 {
            Err(None)
        } else if closing || matches!(-result, libc::ECANCELED | libc::ENOBUFS) {
            // cancelled by the loop (to close, or to pause: resumed since, perhaps), or the
            // pool ran dry: rearmed below where it should read on (after this turn gave
            // buffers back)
            Ok(())
        } else {
            let err = std::io::Error::from_raw_os_error(-result);
            // a peer that went away between requests (reset) left as any other does
            if gone(&err) {
                Err(None)
            } else {
                Err(Some(err.into()))
            }
        };
        self.answer_completed_waits();
        match outcome {
            Ok(()) => self.receive_more(slot),
            Err(Some(reason)) => self.close(slot, Err(reason)),
            Err(None) => self.peer_closed(slot),
        }
        self.queue_send(slot);
        self.free_if_finished(slot);
    }

    /// Rearms a receive that ended, or pauses one whose client has too many replies queued.
    pub(super) fn receive_more(&mut self, slot: u32) {
        let Some(conn) = self.conns[slot as usize].as_mut() else { return };
        if conn.closing {
            return;
        }
        if conn.backed_up() && !conn.paused {
            conn.paused = true;
            if conn.receiving {
                let cancel = opcode::AsyncCancel::new(Op::Recv(slot).token()).build();
                self.push(&cancel.user_data(Op::Cancel.token()));
            }
        } else if !conn.receiving && !conn.paused {
            self.arm_receive(slot);
        }
    }

    /// Its queued replies went out: what it sent meanwhile is executed, then it is read again.
    pub(super) fn resume(&mut self, slot: u32) {
        let Some(conn) = self.conns[slot as usize].as_mut() else { return };
        if !conn.paused || conn.closing || conn.backed_up() {
            return;
        }
        conn.paused = false;
        let EventLoop { db, settings, waker, completed, .. } = self;
        let served = conn.received(&[], &mut Serving { db, limits: &settings.limits, waker, completed });
        self.answer_completed_waits();
        match served {
            Ok(()) => self.receive_more(slot),
            Err(reason) => self.close(slot, Err(reason)),
        }
        self.queue_send(slot);
    }

    /// Executes the requests that `len` bytes in pool buffer `buffer` complete.
    pub(super) fn serve(&mut self, slot: u32, buffer: u16, len: usize) -> Result<(), CloseReason> {
        let EventLoop { conns, pool, db, settings, waker, completed, ticks, .. } = self;
        let Some(conn) = conns[slot as usize].as_mut() else { return Ok(()) };
        conn.heard_at = *ticks;
        // SAFETY: this receive's completion handed `buffer` back holding `len` bytes; the
        // caller gives it back to the kernel only after this returns.
        let bytes = unsafe { pool.received(buffer, len) };
        conn.received(bytes, &mut Serving { db, limits: &settings.limits, waker, completed })
    }

    /// Puts STOP_WAITING in the replies of each connection whose wait a request completed.
    pub(super) fn answer_completed_waits(&mut self) {
        let mut completed = std::mem::take(&mut self.completed);
        for id in completed.drain(..) {
            let slot = id as u32; // the low half of an id is its slot
            match self.conns[slot as usize].as_mut() {
                Some(conn) if conn.id == id && !conn.closing => conn.wait_completed(),
                _ => continue,
            }
            self.queue_send(slot);
        }
        self.completed = completed;
    }

    /// The client closed its end: between requests is no error, within one is.
    pub(super) fn peer_closed(&mut self, slot: u32) {
        let Some(conn) = self.conns[slot as usize].as_ref() else { return };
        let result = match conn.unparsed() {
            0 => Ok(()),
            unread => Err(CloseReason::Truncated(unread)),
        };
        self.close(slot, result);
    }
}
