//! The sending side of a connection. A frame is sealed into the connection's session
//! ([`crate::auth::session`]) and written by the thread that sends it, at once (a non-blocking
//! vectored write: no task wakes up, no queue hop), unless earlier frames are still waiting;
//! what the socket does not take is left to the connection's writer task, which waits until
//! the socket is writable. One lock keeps frames whole, sealed and written in order.

use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice};
use std::sync::{Arc, Mutex};

use bytes::{Buf, Bytes, BytesMut};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::Notify;

use super::lock;
use crate::auth::session::Sealer;
use crate::rpc::frame::Frame;

/// Parts handed to one write call.
const MAX_SLICES: usize = 64;

struct Queue {
    sealer: Sealer,
    parts: VecDeque<Bytes>,
    /// The connection failed or was closed: nothing more is taken.
    closed: bool,
}

pub(super) struct Outbox {
    half: OwnedWriteHalf,
    queue: Mutex<Queue>,
    more: Notify,
}

impl Outbox {
    pub fn new(half: OwnedWriteHalf, sealer: Sealer) -> Arc<Outbox> {
        Arc::new(Outbox {
            half,
            queue: Mutex::new(Queue { sealer, parts: VecDeque::new(), closed: false }),
            more: Notify::new(),
        })
    }

    /// Sends `frame`, or hands it back if the connection is closed.
    pub fn send(&self, frame: Frame) -> Result<(), Frame> {
        let mut queue = lock(&self.queue);
        if queue.closed {
            return Err(frame);
        }
        let idle = queue.parts.is_empty();
        let mut sealed = BytesMut::new();
        for part in [&Bytes::from(frame.head()), &frame.payload].into_iter().chain(&frame.buffers) {
            queue.sealer.seal(part, &mut sealed);
        }
        queue.parts.push_back(sealed.freeze());
        if idle {
            self.write_some(&mut queue);
            if !queue.parts.is_empty() {
                self.more.notify_one();
            }
        }
        Ok(())
    }

    /// Writes until the queue is empty or the socket is full.
    fn write_some(&self, queue: &mut Queue) {
        while !queue.parts.is_empty() && !queue.closed {
            let slices: Vec<IoSlice<'_>> =
                queue.parts.iter().filter(|part| !part.is_empty()).take(MAX_SLICES).map(|p| IoSlice::new(p)).collect();
            if slices.is_empty() {
                queue.parts.clear();
                return;
            }
            match self.half.try_write_vectored(&slices) {
                Ok(mut written) => {
                    while written > 0 {
                        let front = queue.parts.front_mut().expect("written bytes were queued");
                        let step = written.min(front.len());
                        front.advance(step);
                        written -= step;
                        if front.is_empty() {
                            queue.parts.pop_front();
                        }
                    }
                    while queue.parts.front().is_some_and(Bytes::is_empty) {
                        queue.parts.pop_front();
                    }
                }
                Err(err) if err.kind() == ErrorKind::WouldBlock => return,
                Err(err) if err.kind() == ErrorKind::Interrupted => {}
                Err(_) => self.close_locked(queue), // the reader sees the loss too, and reports it
            }
        }
    }

    fn close_locked(&self, queue: &mut Queue) {
        queue.closed = true;
        queue.parts.clear();
    }

    pub fn close(&self) {
        self.close_locked(&mut lock(&self.queue));
        self.more.notify_one();
    }

    /// The writer task: writes what senders left behind, as the socket takes it.
    pub async fn run(self: Arc<Self>) {
        loop {
            self.more.notified().await;
            loop {
                {
                    let mut queue = lock(&self.queue);
                    if queue.closed {
                        return;
                    }
                    self.write_some(&mut queue);
                    if queue.parts.is_empty() {
                        break;
                    }
                }
                if self.half.writable().await.is_err() {
                    self.close();
                    return;
                }
            }
        }
    }
}
