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
use super::{lock, Endpoint, Peer};
use crate::auth::pair::{self, HandshakeError, RPC};
use crate::auth::session::{Mode, SealedRead, Session};
use crate::rpc::frame::{Frame, FrameError, Kind};
use crate::rpc::ids::WorkerId;

pub(super) type ConnTx = Arc<Outbox>;

/// How long this side tries to connect and prove itself to a peer: an attempt the peer closed
/// (it sheds connections waiting to authenticate when strangers flood it) is tried again.
const CONNECT_LIMIT: Duration = Duration::from_secs(10);
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
        let binding = [self.me.to_le_bytes(), to.to_le_bytes()].concat();
        let attempt = || async {
            let mut stream = TcpStream::connect(slot.info.addr.as_str()).await?;
            stream.set_nodelay(true)?;
            let session = pair::connect(&mut stream, &self.key, &RPC, &binding, Mode::wanted()).await?;
            Ok::<_, HandshakeError>((stream, session))
        };
        let trying = async {
            let mut pause = Duration::from_millis(10);
            loop {
                match attempt().await {
                    Err(err) if !err.is_final() => {
                        tracing::debug!("rpc: connecting to {} failed ({err}); trying again", self.describe(to));
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_millis(500));
                    }
                    done => return done.map_err(std::io::Error::other),
                }
            }
        };
        let result = match tokio::time::timeout(CONNECT_LIMIT, trying).await {
            Ok(result) => result,
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no authenticated connection within {CONNECT_LIMIT:?}"),
            )),
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
            Ok((stream, session)) => {
                let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
                let tx = self.spawn_conn(stream, session, Side::Ours { peer: to, serial });
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

    /// Runs a proven connection: both ways in its session.
    fn spawn_conn(self: &Arc<Self>, stream: TcpStream, session: Session, side: Side) -> ConnTx {
        let (reader, writer) = stream.into_split();
        let (sealer, opener) = session.split();
        let reader = SealedRead::new(reader, opener);
        let tx = Outbox::new(writer, sealer);
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
                    // out of descriptors: strangers waiting to authenticate go first
                    if matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) && self.door.shed_oldest() {
                        tokio::task::yield_now().await;
                        continue;
                    }
                    match self.accept_failures.note() {
                        Some(unsaid) => tracing::warn!(
                            "rpc: accept failed: {err} ({unsaid} more failed since this was last said; said at most \
                             once a minute)"
                        ),
                        None => tracing::debug!("rpc: accept failed again: {err}"),
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let endpoint = self.clone();
            let task = self.runtime.spawn(async move {
                let _ = stream.set_nodelay(true);
                let (me, world) = (endpoint.me, endpoint.world());
                let check = |binding: &[u8]| {
                    let (connector, acceptor) = ranks(binding);
                    match () {
                        () if acceptor != me => Err(format!("it means to reach rank {acceptor}, not this rank {me}")),
                        () if connector >= world => {
                            Err(format!("it claims rank {connector}, which is not in this RPC group"))
                        }
                        () => Ok(()),
                    }
                };
                let proved = pair::accept(&mut stream, &endpoint.key, &RPC, Mode::wanted(), check);
                match endpoint.door.hold(addr.ip(), proved).await {
                    Ok(Ok((binding, session))) => {
                        endpoint.spawn_conn(stream, session, Side::Theirs { peer: ranks(&binding).0 });
                    }
                    Ok(Err(err)) => {
                        endpoint.say_refused(addr, &err.to_string());
                        let _ = stream.shutdown().await;
                    }
                    Err(turned) => endpoint.say_refused(addr, &turned.to_string()),
                }
            });
            self.track(task.abort_handle());
        }
    }
}

/// (connector, acceptor) from an RPC handshake's binding.
fn ranks(binding: &[u8]) -> (WorkerId, WorkerId) {
    let rank =
        |at: usize| WorkerId::from_le_bytes(binding[at..at + 4].try_into().expect("an RPC binding holds two ranks"));
    (rank(0), rank(4))
}
