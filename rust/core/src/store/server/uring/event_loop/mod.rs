//! The io_uring server's loop. Each turn: hand the kernel what was queued and wait for a
//! completion, then handle every completion there is (new connections, bytes received,
//! replies sent), then queue one send per connection that has replies. Requests execute as
//! their bytes are handled, so the kernel's completion order is the store's order.

mod accept;
mod close;
mod receive;
mod send;

use std::net::TcpListener;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use io_uring::{opcode, types};

use super::conn::Conn;
use super::pool::Pool;
use super::ring::{Completion, Op, Ring};
use super::Stats;
use crate::address_log::Throttled;
use crate::store::execute::Db;
use crate::store::limits::Limits;
use crate::store::server::connection::CloseReason;
use crate::store::waiters::{WaiterId, Waker};

/// How long a stopped server waits for its connections' operations to end.
pub(super) const STOP_GRACE: Duration = Duration::from_secs(2);
/// Submission queue entries (completions: four times as many).
const RING_ENTRIES: u32 = 4096;
/// The receive pool: enough buffers for a turn of hundreds of busy clients; a receive that
/// finds none is rearmed once buffers come back.
const POOL_BUFFERS: u16 = 512;
const POOL_BUFFER_BYTES: usize = 4096;
/// How long a failed accept (out of descriptors) waits before accepting again.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

pub(super) struct Settings {
    pub limits: Limits,
    pub idle_timeout: Option<Duration>,
    /// The eventfd [`super::UringServer`] writes to stop the loop.
    pub stop: OwnedFd,
}

pub(super) struct EventLoop {
    // the ring first: dropped first, it ends every operation that points into what follows
    ring: Ring,
    listener: TcpListener,
    settings: Settings,
    stats: Arc<Stats>,
    conns: Vec<Option<Conn>>,
    free: Vec<u32>,
    /// Counts connections ever opened: the high half of each one's [`WaiterId`].
    opened: u32,
    db: Db,
    /// The one waker every wait registers; the loop answers waits by id instead.
    waker: Waker,
    pool: Pool,
    completions: Vec<Completion>,
    completed: Vec<WaiterId>,
    to_send: Vec<u32>,
    accepting: bool,
    accept_failures: Throttled,
    stopping: bool,
    /// Idle timer periods so far, and how many make the idle timeout.
    ticks: u32,
    idle_ticks: u32,
    tick: types::Timespec,
    retry: types::Timespec,
    grace: types::Timespec,
}

impl EventLoop {
    pub fn new(listener: TcpListener, settings: Settings, stats: Arc<Stats>) -> std::io::Result<EventLoop> {
        let ring = Ring::new(RING_ENTRIES)?;
        let pool = Pool::new(&ring, POOL_BUFFERS, POOL_BUFFER_BYTES)?;
        // the period checks idle connections often enough to close them within 1/8 late
        let (tick, idle_ticks) = match settings.idle_timeout {
            Some(timeout) => {
                let period = (timeout / 8).clamp(Duration::from_millis(10), Duration::from_secs(1));
                let ticks = (timeout.as_nanos() / period.as_nanos()).max(1);
                (period, u32::try_from(ticks).unwrap_or(u32::MAX))
            }
            None => (Duration::ZERO, 0),
        };
        Ok(EventLoop {
            ring,
            listener,
            settings,
            stats,
            conns: Vec::new(),
            free: Vec::new(),
            opened: 0,
            db: Db::listing_completed(),
            waker: Waker::default(),
            pool,
            completions: Vec::new(),
            completed: Vec::new(),
            to_send: Vec::new(),
            accepting: false,
            accept_failures: Throttled::new(),
            stopping: false,
            ticks: 0,
            idle_ticks,
            tick: tick.into(),
            retry: ACCEPT_RETRY.into(),
            grace: STOP_GRACE.into(),
        })
    }

    pub fn run(mut self) {
        self.arm_accept();
        let poll = opcode::PollAdd::new(types::Fd(self.settings.stop.as_raw_fd()), libc::POLLIN as u32);
        self.push(&poll.build().user_data(Op::Stop.token()));
        if self.idle_ticks > 0 {
            self.arm_timer(Op::Tick);
        }
        let mut completions = std::mem::take(&mut self.completions);
        loop {
            if let Err(err) = self.ring.submit_and_wait() {
                self.give_up(&format!("the io_uring store server stops: {err}"));
                return;
            }
            self.ring.reap(&mut completions);
            let mut grace_over = false;
            for completion in completions.drain(..) {
                grace_over |= self.complete(completion);
            }
            self.send_replies();
            self.stats.waiting.store(self.db.waiting(), Ordering::Relaxed);
            if grace_over {
                let busy = self.conns.iter().flatten().count();
                self.give_up(&format!("{busy} store connections still busy {STOP_GRACE:?} after the stop"));
                return;
            }
            if self.stopping && !self.accepting && self.conns.iter().all(Option::is_none) {
                break;
            }
        }
    }

    /// Handles one completion; true when the stop's grace is over.
    fn complete(&mut self, Completion { op, result, flags }: Completion) -> bool {
        match op {
            Op::Accept => self.accepted(result, flags),
            Op::AcceptRetry => self.arm_accept(),
            Op::Stop => self.stop(),
            Op::Tick => self.tick(),
            Op::Grace => return true,
            Op::Cancel => {}
            Op::Recv(slot) => self.received(slot, result, flags),
            Op::Send(slot) => self.sent(slot, result),
        }
        false
    }

    fn arm_timer(&mut self, op: Op) {
        let at = match op {
            Op::Tick => &self.tick,
            Op::AcceptRetry => &self.retry,
            _ => &self.grace,
        };
        let timer = opcode::Timeout::new(at).build().user_data(op.token());
        self.push(&timer);
    }

    /// Closes the connections idle for the idle timeout (those blocked in a wait may rightly
    /// be silent for hours).
    fn tick(&mut self) {
        self.ticks = self.ticks.wrapping_add(1);
        let timeout = self.settings.idle_timeout.unwrap_or_default();
        for slot in 0..self.conns.len() as u32 {
            let idle = self.conns[slot as usize].as_ref().is_some_and(|conn| {
                !conn.closing && !conn.waiting && self.ticks.wrapping_sub(conn.heard_at) >= self.idle_ticks
            });
            if idle {
                self.close(slot, Err(CloseReason::Idle(timeout)));
            }
        }
        if !self.stopping {
            self.arm_timer(Op::Tick);
        }
    }

    fn stop(&mut self) {
        self.stopping = true;
        if self.accepting {
            self.push(&opcode::AsyncCancel::new(Op::Accept.token()).build().user_data(Op::Cancel.token()));
        }
        for slot in 0..self.conns.len() as u32 {
            self.close(slot, Ok(()));
        }
        self.arm_timer(Op::Grace);
    }

    /// Ends the loop with operations possibly in flight (the grace after a stop ran out, or
    /// the ring failed): the connections are closed, and the memory those operations may
    /// still touch is left allocated.
    fn give_up(self, why: &str) {
        tracing::error!("{why}; closing every connection");
        let EventLoop { ring, conns, pool, .. } = self;
        drop(ring);
        for mut conn in conns.into_iter().flatten() {
            std::mem::forget(std::mem::take(&mut conn.sending));
        }
        std::mem::forget(pool);
    }

    fn push(&mut self, entry: &io_uring::squeue::Entry) {
        // SAFETY: the loop's entries point into its pool, into a connection's `sending` (left
        // alone while its send is in flight, and its slot kept until that completes) or into
        // the loop's timespecs (fields of the loop, which stays where it is while it runs);
        // `give_up` leaks whatever could still be in use when the loop ends early.
        unsafe { self.ring.push(entry) };
    }
}
