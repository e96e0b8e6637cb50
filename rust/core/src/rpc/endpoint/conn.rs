//! Connections: the listener, the connection to each peer (made by the first message to it,
//! remade after a loss), and the two tasks of every connection: a writer that drains its
//! queue (flushing once the queue is empty, so bursts share syscalls) and a reader that hands
//! each frame to [`Endpoint::dispatch`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use super::outbox::Outbox;
use super::{handshake, lock, Endpoint, Peer};
use crate::rpc::frame::{Frame, FrameError, Kind};
use crate::rpc::ids::WorkerId;

pub(super) type ConnTx = Arc<Outbox>;

/// A connection that has not proved itself in this time is closed.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);
const IO_BUFFER: usize = 256 << 10;

static SERIAL: AtomicU64 = AtomicU64::new(1);

enum PeerConn {
    Down,
    /// Frames sent while the connection is being made.
    Connecting(Vec<Frame>),
    Up {
        tx: ConnTx,
        serial: u64,
    },
}

pub(super) struct PeerSlot {
    pub info: Peer,
    conn: Mutex<PeerConn>,
}

impl PeerSlot {
    pub fn new(info: Peer) -> PeerSlot {
        PeerSlot { info, conn: Mutex::new(PeerConn::Down) }
    }

    pub fn disconnect(&self) {
        *lock(&self.conn) = PeerConn::Down;
    }
}

/// Which side made a connection: the peer's answers to our requests come back on ours.
#[derive(Clone, Copy)]
enum Side {
    Ours { peer: WorkerId, serial: u64 },
    Theirs { peer: WorkerId },
}

impl Endpoint {
    /// Queues `frame` for `to`, connecting first if needed. Never waits.
    pub(super) fn send(self: &Arc<Self>, to: WorkerId, frame: Frame) {
        let Some(slot) = self.peers().get(to as usize) else { return };
        let mut conn = lock(&slot.conn);
        let frame = match &mut *conn {
            PeerConn::Up { tx, .. } => match tx.send(frame) {
                Ok(()) => return,
                Err(frame) => frame, // the connection is gone: connect again
            },
            PeerConn::Connecting(queued) => return queued.push(frame),
            PeerConn::Down => frame,
        };
        if self.is_closed() {
            return;
        }
        *conn = PeerConn::Connecting(vec![frame]);
        drop(conn);
        let task = self.runtime.spawn(self.clone().connect(to));
        self.track(task.abort_handle());
    }

    async fn connect(self: Arc<Self>, to: WorkerId) {
        let slot = &self.peers()[to as usize];
        let attempt = async {
            let mut stream = TcpStream::connect(slot.info.addr.as_str()).await?;
            stream.set_nodelay(true)?;
            handshake::connect(&mut stream, &self.key, self.me, to).await.map_err(std::io::Error::other)?;
            Ok::<_, std::io::Error>(stream)
        };
        let result = match tokio::time::timeout(HANDSHAKE_LIMIT, attempt).await {
            Ok(result) => result,
            Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no handshake within 10 s")),
        };
        let mut conn = lock(&slot.conn);
        let queued = match std::mem::replace(&mut *conn, PeerConn::Down) {
            PeerConn::Connecting(queued) => queued,
            other => {
                *conn = other; // closed meanwhile
                return;
            }
        };
        match result {
            Ok(stream) => {
                let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
                let tx = self.spawn_conn(stream, Side::Ours { peer: to, serial });
                for frame in queued {
                    let _ = tx.send(frame);
                }
                *conn = PeerConn::Up { tx, serial };
            }
            Err(err) => {
                drop(conn);
                let why = format!("cannot reach {}: {err}", self.describe(to));
                tracing::debug!("rpc: {why}");
                self.undeliverable(queued, &why);
            }
        }
    }

    /// Frames that could not be sent: their calls fail, control messages are tried again.
    fn undeliverable(self: &Arc<Self>, frames: Vec<Frame>, why: &str) {
        for frame in frames {
            match frame.kind {
                Kind::Request => self.finish_call(frame.id, Err(super::CallError::PeerGone(why.to_string()))),
                Kind::Control => self.retry_control(frame.id),
                Kind::Response | Kind::ControlAck => {}
            }
        }
    }

    fn spawn_conn(self: &Arc<Self>, stream: TcpStream, side: Side) -> ConnTx {
        let (reader, writer) = stream.into_split();
        let tx = Outbox::new(writer);
        let writing = self.runtime.spawn(tx.clone().run());
        self.track(writing.abort_handle());
        let endpoint = self.clone();
        let answers = tx.clone();
        let reading = self.runtime.spawn(async move {
            let mut reader = BufReader::with_capacity(IO_BUFFER, reader);
            let (Side::Ours { peer, .. } | Side::Theirs { peer }) = side;
            let end = loop {
                match Frame::read_from(&mut reader).await {
                    Ok(Some(frame)) => endpoint.dispatch(frame, peer, &answers),
                    Ok(None) => break "the connection was closed".to_string(),
                    Err(FrameError::Io(err)) => break format!("the connection failed: {err}"),
                    Err(err @ FrameError::Garbage(_)) => {
                        tracing::warn!("rpc: closing a connection that sent garbage: {err}");
                        break err.to_string();
                    }
                }
            };
            answers.close();
            if let Side::Ours { peer, serial } = side {
                endpoint.connection_lost(peer, serial, &end);
            }
        });
        self.track(reading.abort_handle());
        tx
    }

    /// Our connection to `peer` ended: the calls waiting on it fail now, naming the peer, and
    /// control messages go again on a new connection.
    fn connection_lost(self: &Arc<Self>, peer: WorkerId, serial: u64, why: &str) {
        let slot = &self.peers()[peer as usize];
        {
            let mut conn = lock(&slot.conn);
            if matches!(&*conn, PeerConn::Up { serial: current, .. } if *current == serial) {
                *conn = PeerConn::Down;
            }
        }
        if self.is_closed() {
            return;
        }
        let who = self.describe(peer);
        self.fail_calls_to(Some(peer), || {
            super::CallError::PeerGone(format!("{who} is gone: {why} while a call to it was waiting for its answer"))
        });
        self.retry_controls_to(peer);
    }

    fn say_refused(&self, addr: SocketAddr, why: &str) {
        match self.refused.note(addr.ip()) {
            Some(count) => tracing::warn!(
                "rpc: refused a connection from {addr}: {why} ({count} refused so far; said at most once a minute per \
                 address)"
            ),
            None => tracing::debug!("rpc: refused a connection from {addr}: {why}"),
        }
    }

    pub(super) async fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        loop {
            let (mut stream, addr) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(err) => {
                    tracing::warn!("rpc: accept failed: {err}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let endpoint = self.clone();
            let task = self.runtime.spawn(async move {
                let _ = stream.set_nodelay(true);
                let proved = handshake::accept(&mut stream, &endpoint.key, endpoint.me, endpoint.world());
                match tokio::time::timeout(HANDSHAKE_LIMIT, proved).await {
                    Ok(Ok(peer)) => {
                        endpoint.spawn_conn(stream, Side::Theirs { peer });
                    }
                    Ok(Err(err)) => {
                        endpoint.say_refused(addr, &err.to_string());
                        let _ = stream.shutdown().await;
                    }
                    Err(_) => endpoint.say_refused(addr, &format!("no handshake within {HANDSHAKE_LIMIT:?}")),
                }
            });
            self.track(task.abort_handle());
        }
    }
}
