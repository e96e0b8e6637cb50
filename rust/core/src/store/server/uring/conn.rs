//! One client connection of the io_uring server: what it has sent that is not yet a whole
//! request, its replies, and where its operations stand. Requests execute here, on the data
//! the loop owns; the loop does the I/O.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;

use bytes::{BufMut, BytesMut};

use super::super::admission::Admitted;
use super::super::connection::{count_request, offers_secret, validate, CloseReason, MOST_QUEUED};
use crate::store::execute::Db;
use crate::store::limits::Limits;
use crate::store::protocol::STOP_WAITING;
use crate::store::request::{Decoded, Request};
use crate::store::waiters::{WaiterId, Waker};

/// A reply buffer grown past this (a large GET) is released once sent.
const KEPT_REPLIES: usize = 4 * 1024;

pub(super) struct Conn {
    pub fd: OwnedFd,
    pub peer: SocketAddr,
    /// Its slot and the slot's generation: unique among the loop's connections, ever.
    pub id: WaiterId,
    /// The start of a request that a receive split (most requests arrive whole, and are
    /// executed straight from the pool's buffer).
    unparsed: Vec<u8>,
    /// Do not decode `unparsed` again until it holds this many bytes.
    needed: usize,
    /// Replies not yet handed to the kernel.
    pub replies: BytesMut,
    /// What the send in flight sends, and how much of it the kernel took so far.
    pub sending: BytesMut,
    pub sent: usize,
    pub send_in_flight: bool,
    /// A multishot receive is armed.
    pub receiving: bool,
    /// Receiving stopped until its queued replies are sent (see [`MOST_QUEUED`]).
    pub paused: bool,
    /// Listed among the connections to send to at the end of the loop's turn.
    pub send_queued: bool,
    /// Being closed: no more requests are read; the slot is freed once no operation of its
    /// own is in flight.
    pub closing: bool,
    validated: bool,
    /// It has a WAIT pending.
    pub waiting: bool,
    /// The loop's tick at its last received bytes (for the idle timeout).
    pub heard_at: u32,
    _admitted: Admitted,
}

/// What a connection's requests need from the loop.
pub(super) struct Serving<'a> {
    pub db: &'a mut Db,
    pub limits: &'a Limits,
    pub waker: &'a Waker,
    /// The waits that requests completed on other connections, to answer there.
    pub completed: &'a mut Vec<WaiterId>,
}

impl Conn {
    pub fn new(fd: OwnedFd, peer: SocketAddr, id: WaiterId, heard_at: u32, admitted: Admitted) -> Conn {
        Conn {
            fd,
            peer,
            id,
            unparsed: Vec::new(),
            needed: 1,
            replies: BytesMut::new(),
            sending: BytesMut::new(),
            sent: 0,
            send_in_flight: false,
            receiving: false,
            paused: false,
            send_queued: false,
            closing: false,
            validated: false,
            waiting: false,
            heard_at,
            _admitted: admitted,
        }
    }

    /// Executes every whole request that `bytes`, after what was buffered, completes; keeps
    /// the rest for the next receive.
    pub fn received(&mut self, bytes: &[u8], serving: &mut Serving<'_>) -> Result<(), CloseReason> {
        if self.unparsed.is_empty() {
            let used = self.execute_whole(bytes, serving)?;
            self.unparsed.extend_from_slice(&bytes[used..]);
            return Ok(());
        }
        self.unparsed.extend_from_slice(bytes);
        let unparsed = std::mem::take(&mut self.unparsed);
        let used = self.execute_whole(&unparsed, serving);
        self.unparsed = unparsed;
        self.unparsed.drain(..used?);
        if self.unparsed.is_empty() && self.unparsed.capacity() > KEPT_REPLIES {
            self.unparsed = Vec::new(); // a large request's room
        }
        Ok(())
    }

    /// Bytes received but not yet executed.
    pub fn unparsed(&self) -> usize {
        self.unparsed.len()
    }

    /// Its queued replies are many enough that its requests wait until they are sent.
    pub fn backed_up(&self) -> bool {
        self.replies.len() >= MOST_QUEUED
    }

    /// Executes the whole requests at the start of `bytes`; returns how many bytes they took.
    fn execute_whole(&mut self, bytes: &[u8], serving: &mut Serving<'_>) -> Result<usize, CloseReason> {
        if !self.validated && offers_secret(bytes) {
            return Err(CloseReason::SecretOffered);
        }
        let mut used = 0;
        while bytes.len() - used >= self.needed && !self.backed_up() {
            match Request::decode(&bytes[used..], serving.limits)? {
                Decoded::Incomplete { needed } => {
                    self.needed = needed;
                    break;
                }
                Decoded::Request(request, len) => {
                    self.execute(&request, serving)?;
                    used += len;
                    self.needed = 1;
                }
            }
        }
        Ok(used)
    }

    fn execute(&mut self, request: &Request<'_>, serving: &mut Serving<'_>) -> Result<(), CloseReason> {
        if !self.validated {
            validate(request)?;
            self.validated = true;
            return Ok(());
        }
        let started = crate::metrics::enabled().then(std::time::Instant::now);
        serving.db.execute(self.id, serving.waker, request, &mut self.replies)?;
        // A wait this request completed is answered now: its own (a WAIT, then the write it
        // waited for) in order with its replies, any other's by the loop before that
        // connection's next request.
        let before = serving.completed.len();
        serving.db.take_completed(serving.completed);
        if let Some(own) = serving.completed[before..].iter().position(|id| *id == self.id) {
            serving.completed.remove(before + own);
            self.replies.put_u8(STOP_WAITING);
        }
        self.waiting = serving.db.is_waiting(self.id);
        count_request(request, started);
        Ok(())
    }

    /// Its wait completed (another connection's request wrote what it waited for).
    pub fn wait_completed(&mut self) {
        self.waiting = false;
        self.replies.put_u8(STOP_WAITING);
    }

    /// The send in flight is over: its buffer is kept for the next, unless a large reply
    /// grew it or the client now waits (thousands sit in WAIT through a rendezvous; their
    /// next reply, STOP_WAITING, is one byte).
    pub fn sent_all(&mut self) {
        self.send_in_flight = false;
        self.sent = 0;
        if self.sending.capacity() > KEPT_REPLIES || self.waiting {
            self.sending = BytesMut::new();
        } else {
            self.sending.clear();
        }
        if self.waiting && self.replies.is_empty() {
            self.replies = BytesMut::new();
        }
    }

    /// Nothing of it is in flight any more: its slot may be freed.
    pub fn finished(&self) -> bool {
        self.closing && !self.receiving && !self.send_in_flight
    }
}
