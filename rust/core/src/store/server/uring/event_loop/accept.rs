//! New connections: accepted (multishot), admitted under the cap, given a slot and a receive.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use io_uring::{cqueue, opcode, types};

use super::super::conn::Conn;
use super::super::ring::Op;
use super::{EventLoop, ACCEPT_RETRY};

impl EventLoop {
    pub(super) fn arm_accept(&mut self) {
        if self.stopping {
            return;
        }
        self.accepting = true;
        let accept = opcode::AcceptMulti::new(types::Fd(self.listener.as_raw_fd())).flags(libc::SOCK_CLOEXEC);
        self.push(&accept.build().user_data(Op::Accept.token()));
    }

    pub(super) fn accepted(&mut self, result: i32, flags: u32) {
        let armed = cqueue::more(flags);
        if result >= 0 {
            // SAFETY: a successful accept's result is a new descriptor, owned by nobody else.
            let fd = unsafe { OwnedFd::from_raw_fd(result) };
            if !self.stopping {
                self.admit(fd);
            }
        } else if -result != libc::ECANCELED {
            self.accept_failed(std::io::Error::from_raw_os_error(-result), armed);
            return;
        }
        if !armed {
            self.accepting = false;
            self.arm_accept();
        }
    }

    pub(super) fn accept_failed(&mut self, err: std::io::Error, armed: bool) {
        match self.accept_failures.note() {
            Some(unsaid) => tracing::warn!(
                "accept failed: {err}; existing clients are still served, accepting again in {ACCEPT_RETRY:?} \
                 ({unsaid} more failed since this was last said; said at most once a minute)"
            ),
            None => tracing::debug!("accept failed again: {err}"),
        }
        if !armed {
            self.accepting = false;
            if !self.stopping {
                self.arm_timer(Op::AcceptRetry);
            }
        }
    }

    /// Serves a new connection, or closes it at once (the client sees EOF) past the cap.
    pub(super) fn admit(&mut self, fd: OwnedFd) {
        let peer = match socket2::SockRef::from(&fd).peer_addr().map(|addr| addr.as_socket()) {
            Ok(Some(peer)) => peer,
            // it left before we looked: nothing to serve
            Ok(None) | Err(_) => return,
        };
        let Some(admitted) = self.stats.admission.admit(peer) else { return };
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.conns.push(None);
                u32::try_from(self.conns.len() - 1).expect("fewer than 2^32 connections")
            }
        };
        self.opened = self.opened.wrapping_add(1);
        let id = (u64::from(self.opened) << 32) | u64::from(slot);
        self.conns[slot as usize] = Some(Conn::new(fd, peer, id, self.ticks, admitted));
        self.arm_receive(slot);
        tracing::debug!(%peer, "connection accepted");
    }
}
