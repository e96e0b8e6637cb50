//! One client connection: read bytes, decode every whole request they hold (requests may be
//! split across reads or several to a read), execute them in order, write the replies, and
//! deliver STOP_WAITING when a pending wait completes.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, BytesMut};
use tokio::time::Sleep;

use super::shutdown::Shutdown;
use super::Shared;
use crate::address_log::AddressLog;
use crate::store::execute::ExecError;
use crate::store::protocol::{Opcode, STOP_WAITING, VALIDATION_MAGIC};
use crate::store::request::{Decoded, FrameError, Request};
use crate::store::transport::Transport;
use crate::store::waiters::{WaiterId, Waker};

/// Bounds of the adaptive read size. Most requests are tens of bytes and a storm leaves
/// thousands of connections idle in WAIT, so a connection starts small; reads that fill what
/// was offered double it, reads that use under a quarter halve it.
const MIN_READ: usize = 64;
const MAX_READ: usize = 64 * 1024;
/// A reply buffer grown past this (a large GET) is released once written.
const KEPT_WRITE: usize = 4 * 1024;
/// Replies queued past this stop the execution of a client's requests until they are written:
/// a client that asks and does not read holds this much of the server, not what it asked for.
pub(super) const MOST_QUEUED: usize = 1 << 20;
/// What a client blocked in WAIT is offered to read: it may only cancel, ping or close, and
/// thousands of them sit like that through a rendezvous.
const WAITING_READ: usize = 64;

/// Why a connection was closed by the server.
#[derive(Debug, thiserror::Error)]
pub enum CloseReason {
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
    #[error("invalid request: {0}")]
    Frame(#[from] FrameError),
    #[error("request failed: {0}")]
    Exec(#[from] ExecError),
    #[error("first request was {0} instead of VALIDATE")]
    NotValidated(&'static str),
    #[error("VALIDATE carried magic {0:#010x} instead of {VALIDATION_MAGIC:#010x}")]
    BadMagic(u32),
    #[error("connection closed in the middle of a request ({0} bytes unread)")]
    Truncated(usize),
    #[error("it offered the job secret, but this server runs without one (told it so)")]
    SecretOffered,
    #[error("idle for {0:?} with no pending wait (idle timeout)")]
    Idle(Duration),
}

pub(super) struct Connection {
    stream: Transport,
    peer: SocketAddr,
    read_buf: BytesMut,
    /// How much room the next read is offered (between MIN_READ and MAX_READ).
    read_size: usize,
    /// Do not decode again until this many bytes are buffered.
    needed: usize,
    /// Whole requests wait in `read_buf` until the replies queued before them are written
    /// (see [`MOST_QUEUED`]).
    held_back: bool,
    session: Session,
}

/// What a connection knows between requests, apart from its unparsed bytes.
struct Session {
    id: WaiterId,
    shared: Arc<Shared>,
    write_buf: BytesMut,
    validated: bool,
    waker: Waker,
    /// It has a WAIT pending (as of its last request; a completion clears it).
    waiting: bool,
}

impl Connection {
    pub(super) fn new(stream: Transport, peer: SocketAddr, shared: Arc<Shared>) -> Self {
        Connection {
            stream,
            peer,
            read_buf: BytesMut::new(),
            read_size: MIN_READ,
            needed: 1,
            held_back: false,
            session: Session {
                id: shared.next_waiter_id(),
                shared,
                write_buf: BytesMut::new(),
                validated: false,
                waker: Waker::default(),
                waiting: false,
            },
        }
    }

    /// Serves the connection until the client leaves, misbehaves, or the server shuts down;
    /// then drops whatever it was waiting for. By reference: a task that moved the connection
    /// into this future would hold it twice (rustc keeps an async fn's argument beside what
    /// it is moved into), and every idle client pays for its task's size.
    pub(super) async fn run(&mut self, shutdown: &mut Shutdown) {
        let result = self.serve(shutdown).await;
        self.session.shared.db().forget(self.session.id);
        say_closed(self.peer, &result, &self.session.shared.closed_on_error);
    }

    async fn serve(&mut self, shutdown: &mut Shutdown) -> Result<(), CloseReason> {
        // one stop future for the connection's life, not one per request
        let stop = shutdown.recv();
        tokio::pin!(stop);
        // the idle timer exists only where a timeout is set, and is reset, not remade
        let idle_timeout = self.session.shared.idle_timeout;
        let mut idle_timer = idle_timeout.map(|timeout| Box::pin(tokio::time::sleep(timeout)));
        loop {
            let offered = self.reserve_for_next_read();
            // a client blocked in WAIT may rightly be silent for hours
            let idle = match (idle_timer.as_mut(), idle_timeout) {
                (Some(timer), Some(timeout)) if !self.session.holds_wait() => {
                    timer.as_mut().reset(tokio::time::Instant::now() + timeout);
                    Some(timer)
                }
                _ => None,
            };
            tokio::select! {
                biased;
                _ = &mut stop => return Ok(()),
                () = self.session.waker.notified() => {
                    let completed = self.session.waker.take();
                    if completed > 0 {
                        self.session.waiting = false;
                        answer_waits(&mut self.session.write_buf, completed);
                    }
                }
                () = fires(idle) => return Err(CloseReason::Idle(idle_timeout.unwrap_or_default())),
                // tokio clears the readiness itself after a read that left room unused: the
                // socket is drained, and no read that would return EAGAIN follows
                read = self.stream.read_buf(&mut self.read_buf) => {
                    let read = match read {
                        // a peer that went away between requests (a process that exited with
                        // bytes unread: its kernel resets) left as any other does
                        Err(err) if gone(&err) && self.read_buf.is_empty() => return Ok(()),
                        read => read?,
                    };
                    if read == 0 {
                        return match self.read_buf.len() {
                            0 => Ok(()),
                            unread => Err(CloseReason::Truncated(unread)),
                        };
                    }
                    self.adapt_read_size(read, offered);
                    self.process_buffered()?;
                }
            }
            loop {
                let replies = &mut self.session.write_buf;
                if replies.is_empty() {
                    break;
                }
                // Replies almost always fit the socket buffer: write at once, and wait for
                // room (still watching for shutdown) only when it is full (a sealed stream
                // always writes whole records this way).
                match self.stream.try_write(replies) {
                    Ok(written) => replies.advance(written),
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                    Err(err) => return Err(err.into()),
                }
                if !replies.is_empty() {
                    tokio::select! {
                        biased;
                        _ = &mut stop => return Ok(()),
                        written = self.stream.write_all(replies) => written?,
                    }
                }
                if replies.capacity() > KEPT_WRITE {
                    *replies = BytesMut::new();
                } else {
                    replies.clear();
                }
                // requests held back while their replies queued up run now that those are out
                if !self.held_back {
                    break;
                }
                self.process_buffered()?;
            }
        }
    }

    /// Makes room for the next read; returns how much it offers.
    fn reserve_for_next_read(&mut self) -> usize {
        if self.read_buf.is_empty() && self.session.waiting {
            // blocked in WAIT: a few bytes are room enough (a CANCEL_WAIT, a PING)
            if self.read_buf.capacity() > WAITING_READ {
                self.read_buf = BytesMut::new();
            }
            self.read_buf.reserve(WAITING_READ); // its own room back, or 64 bytes
            return self.read_buf.capacity();
        }
        if self.read_buf.is_empty() && self.read_buf.capacity() > 4 * self.read_size {
            self.read_buf = BytesMut::new(); // release a large request's buffer
        }
        let want = self.needed.saturating_sub(self.read_buf.len()).max(self.read_size);
        if self.read_buf.capacity() - self.read_buf.len() < want {
            self.read_buf.reserve(want);
        }
        self.read_buf.capacity() - self.read_buf.len()
    }

    fn adapt_read_size(&mut self, read: usize, offered: usize) {
        if read >= offered {
            self.read_size = (self.read_size * 2).min(MAX_READ);
        } else if read < offered / 4 {
            self.read_size = (self.read_size / 2).max(MIN_READ);
        }
    }

    /// Executes every whole request in the read buffer.
    fn process_buffered(&mut self) -> Result<(), CloseReason> {
        if !self.session.validated && offers_secret(&self.read_buf) {
            // an elastix client with a secret: it learns that no retry will help (33 bytes fit
            // the empty socket buffer)
            let _ = self.stream.try_write(&crate::auth::pair::no_secret_challenge());
            return Err(CloseReason::SecretOffered);
        }
        self.held_back = false;
        while self.read_buf.len() >= self.needed {
            self.held_back = self.session.write_buf.len() >= MOST_QUEUED;
            if self.held_back {
                return Ok(());
            }
            let limits = &self.session.shared.limits;
            let used = match Request::decode(&self.read_buf, limits)? {
                Decoded::Incomplete { needed } => {
                    self.needed = needed;
                    return Ok(());
                }
                Decoded::Request(request, used) => {
                    self.session.handle(&request)?;
                    used
                }
            };
            self.read_buf.advance(used);
            self.needed = 1;
        }
        Ok(())
    }
}

/// Whether `err` says the peer is gone (its connection reset or closed under a write).
pub(super) fn gone(err: &io::Error) -> bool {
    matches!(err.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionAborted)
}

/// Completes when `timer` fires; never without one.
async fn fires(timer: Option<&mut Pin<Box<Sleep>>>) {
    match timer {
        Some(timer) => timer.await,
        None => std::future::pending().await,
    }
}

impl Session {
    fn holds_wait(&self) -> bool {
        self.waiting
    }

    fn handle(&mut self, request: &Request<'_>) -> Result<(), CloseReason> {
        if self.validated {
            self.execute(request)
        } else {
            self.validate(request)
        }
    }

    fn validate(&mut self, request: &Request<'_>) -> Result<(), CloseReason> {
        validate(request)?;
        self.validated = true;
        Ok(())
    }

    fn execute(&mut self, request: &Request<'_>) -> Result<(), CloseReason> {
        // timed (lock wait included) only with a metrics endpoint on: the clock costs more
        // than the counting
        let started = crate::metrics::enabled().then(std::time::Instant::now);
        let mut db = self.shared.db();
        // Wakes are sent under this lock, so any wait that completed before this request
        // executes is seen here and its STOP_WAITING precedes this reply (a CANCEL_WAIT that
        // races a wake must be answered `00 01`, never `01 00`).
        answer_waits(&mut self.write_buf, self.waker.take());
        db.execute(self.id, &self.waker, request, &mut self.write_buf)?;
        self.waiting = db.is_waiting(self.id);
        drop(db);
        count_request(request, started);
        Ok(())
    }
}

/// Whether a connection's first bytes are an elastix client's offer of the job secret.
pub(super) fn offers_secret(first: &[u8]) -> bool {
    first.first() == Some(&crate::auth::pair::STORE.magic[0])
}

/// A connection's first request must be VALIDATE with torch's magic.
pub(super) fn validate(request: &Request<'_>) -> Result<(), CloseReason> {
    match request {
        Request::Validate { magic } if *magic == VALIDATION_MAGIC => Ok(()),
        Request::Validate { magic } => Err(CloseReason::BadMagic(*magic)),
        other => Err(CloseReason::NotValidated(other.opcode().name())),
    }
}

/// Counts a request in the metrics, timed from `started` (which is `Some` only where metrics
/// are on: the clock costs more than the counting).
pub(super) fn count_request(request: &Request<'_>, started: Option<std::time::Instant>) {
    if let Some(started) = started {
        let opcode = request.opcode();
        // a WAIT lasts as long as its keys take to appear: counted, not timed
        let took = (opcode != Opcode::Wait).then(|| started.elapsed());
        crate::metrics::store::server().request(opcode as usize, opcode.name(), took);
    }
}

/// Says how a connection ended: a clean end at DEBUG; an error at WARN once a minute per
/// address (counted in `closed_on_error`), else at DEBUG.
pub(super) fn say_closed(peer: SocketAddr, result: &Result<(), CloseReason>, closed_on_error: &AddressLog) {
    match result {
        Ok(()) => tracing::debug!(%peer, "connection closed"),
        Err(reason) => match closed_on_error.note(peer.ip()) {
            Some(count) => tracing::warn!(
                "closing the connection from {peer}: {reason} ({count} closed on errors so far; said at most once a \
                 minute per address)"
            ),
            None => tracing::debug!(%peer, "closing connection: {reason}"),
        },
    }
}

/// One STOP_WAITING per completed wait.
pub(super) fn answer_waits(replies: &mut BytesMut, completed: usize) {
    for _ in 0..completed {
        replies.put_u8(STOP_WAITING);
    }
}
