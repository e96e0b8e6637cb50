//! Closing a connection: what it has in flight is cancelled, its slot freed once that ended.

use io_uring::opcode;

use super::super::conn::Conn;
use super::super::ring::Op;
use super::EventLoop;
use crate::store::server::connection::{say_closed, CloseReason};

impl EventLoop {
    /// Closes a connection: says why, forgets its wait, and cancels what it has in flight;
    /// its slot is freed once that has ended.
    pub(super) fn close(&mut self, slot: u32, result: Result<(), CloseReason>) {
        let Some(conn) = self.conns[slot as usize].as_mut() else { return };
        if conn.closing {
            return;
        }
        conn.closing = true;
        say_closed(conn.peer, &result, &self.stats.closed_on_error);
        if matches!(result, Err(CloseReason::SecretOffered)) {
            // it learns that no retry will help (33 bytes fit the socket's empty buffer)
            let challenge = crate::auth::pair::no_secret_challenge();
            let _ =
                socket2::SockRef::from(&conn.fd).send_with_flags(&challenge, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL);
        }
        self.db.forget(conn.id);
        let (receiving, sending) = (conn.receiving, conn.send_in_flight);
        if receiving {
            self.push(&opcode::AsyncCancel::new(Op::Recv(slot).token()).build().user_data(Op::Cancel.token()));
        }
        if sending {
            self.push(&opcode::AsyncCancel::new(Op::Send(slot).token()).build().user_data(Op::Cancel.token()));
        }
        self.free_if_finished(slot);
    }

    pub(super) fn free_if_finished(&mut self, slot: u32) {
        if self.conns[slot as usize].as_ref().is_some_and(Conn::finished) {
            self.conns[slot as usize] = None; // closes it, and gives back its place
            self.free.push(slot);
        }
    }
}
