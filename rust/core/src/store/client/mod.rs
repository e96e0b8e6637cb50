//! The store client: one connection, one request at a time (as torch's client), every
//! operation of the protocol, and timeouts enforced on the client side with CANCEL_WAIT.
//!
//! Keys here are wire keys. torch's `/` prefix and `init/` accounting belong to
//! [`crate::store::tcp_store`], which builds on this.
//!
//! A dropped operation future leaves the connection in an unknown state; the client notices
//! and refuses further use with a clear error instead of reading someone else's reply. Waits
//! are different: they end cleanly on timeout or interrupt (CANCEL_WAIT, then the connection
//! is usable again).

mod backoff;
mod connect;

use std::future::pending;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};

pub use self::backoff::Backoff;
pub use self::connect::ConnectOptions;
use super::error::{Result, StoreError};
use super::linger::OwnClient;
use super::protocol::{CHECK_NOT_READY, CHECK_READY, STOP_WAITING, WAIT_CANCELED};
use super::request::{Keys, Request};
use super::transport::Transport;
use crate::interrupt::Interrupt;

/// Replies longer than this are taken as a broken server rather than allocated.
const MAX_REPLY_LEN: u64 = 1 << 30;

/// Default bound on waiting for an ordinary (non-wait) reply: torch's default store timeout.
pub const DEFAULT_REPLY_TIMEOUT: Duration = Duration::from_secs(300);

enum State {
    Ready,
    /// A request was sent and its reply is not fully read yet.
    Busy,
    Broken(String),
}

/// How a wait ended.
enum WaitEnd {
    Released,
    TimedOut,
    Interrupted,
}

pub struct Client {
    stream: Transport,
    peer: String,
    remote: SocketAddr,
    encode_buf: BytesMut,
    read_buf: BytesMut,
    state: State,
    reply_timeout: Option<Duration>,
    /// Asked while a wait blocks: stopping ends it with [`StoreError::Interrupted`] (after
    /// cancelling it on the server).
    interrupt: Interrupt,
    /// Tells this process's exit that this connection is its own (see [`crate::store::linger`]).
    _own: OwnClient,
}

impl Client {
    /// Connects (with retries until `options.timeout`) and completes the handshake.
    pub async fn connect(options: &ConnectOptions) -> Result<Client> {
        let (stream, remote) = connect::connect(options).await?;
        let own = OwnClient::register(stream.tcp().local_addr().ok());
        Ok(Client {
            stream,
            peer: format!("{}:{}", options.host, options.port),
            remote,
            encode_buf: BytesMut::with_capacity(256),
            read_buf: BytesMut::with_capacity(4096),
            state: State::Ready,
            reply_timeout: Some(DEFAULT_REPLY_TIMEOUT),
            interrupt: Interrupt::never(),
            _own: own,
        })
    }

    /// The address the connection went to.
    pub fn remote_addr(&self) -> SocketAddr {
        self.remote
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.stream.tcp().local_addr()
    }

    /// Whether TCP keepalive is on for this connection (it is on every store socket).
    pub fn keepalive(&self) -> io::Result<bool> {
        socket2::SockRef::from(self.stream.tcp()).keepalive()
    }

    /// The session mode of a connection that proved the job secret (`None`: a plain one).
    pub fn session_mode(&self) -> Option<crate::auth::session::Mode> {
        self.stream.mode()
    }

    /// Bound on waiting for the reply of a non-blocking request (`None`: no bound).
    pub fn set_reply_timeout(&mut self, timeout: Option<Duration>) {
        self.reply_timeout = timeout;
    }

    /// What lets a caller (Python's Ctrl-C) end this connection's waits early.
    pub fn set_interrupt(&mut self, interrupt: Interrupt) {
        self.interrupt = interrupt;
    }

    /// False once the connection broke or an operation on it was abandoned midway.
    pub fn is_usable(&self) -> bool {
        matches!(self.state, State::Ready)
    }

    pub async fn set(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        self.begin()?;
        self.send(&Request::Set { key, value }).await?;
        self.finish(())
    }

    pub async fn compare_set(&mut self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Bytes> {
        self.begin()?;
        self.send(&Request::CompareSet { key, expected, desired }).await?;
        let value = self.recv_bytes().await?;
        self.finish(value)
    }

    /// GET without waiting: a missing key reads as empty (the server's answer).
    pub async fn get_now(&mut self, key: &[u8]) -> Result<Bytes> {
        self.begin()?;
        self.send(&Request::Get { key }).await?;
        let value = self.recv_bytes().await?;
        self.finish(value)
    }

    /// Waits up to `timeout` for `key`, then reads it (torch's `get`).
    pub async fn get(&mut self, key: &[u8], timeout: Option<Duration>) -> Result<Bytes> {
        self.wait(&[key], timeout).await?;
        self.get_now(key).await
    }

    pub async fn add(&mut self, key: &[u8], delta: i64) -> Result<i64> {
        self.begin()?;
        self.send(&Request::Add { key, delta }).await?;
        let total = self.recv_i64().await?;
        self.finish(total)
    }

    pub async fn check(&mut self, keys: &[&[u8]]) -> Result<bool> {
        self.begin()?;
        self.send(&Request::Check { keys: Keys::from_slice(keys) }).await?;
        let ready = match self.recv_u8().await? {
            CHECK_READY => true,
            CHECK_NOT_READY => false,
            other => return Err(self.protocol_error(format!("CHECK answered {other:#04x}"))),
        };
        self.finish(ready)
    }

    /// Blocks until every key exists (or, for a queue name, holds an item). On timeout the
    /// wait is cancelled on the server and [`StoreError::WaitTimeout`] returned.
    pub async fn wait(&mut self, keys: &[&[u8]], timeout: Option<Duration>) -> Result<()> {
        self.begin()?;
        self.send(&Request::Wait { keys: Keys::from_slice(keys) }).await?;
        match self.await_release(timeout).await? {
            WaitEnd::Released => self.finish(()),
            WaitEnd::TimedOut => Err(StoreError::WaitTimeout {
                timeout: timeout.unwrap_or_default(),
                keys: keys.iter().map(|k| String::from_utf8_lossy(k).into_owned()).collect(),
            }),
            WaitEnd::Interrupted => Err(StoreError::Interrupted),
        }
    }

    pub async fn num_keys(&mut self) -> Result<i64> {
        self.begin()?;
        self.send(&Request::GetNumKeys).await?;
        let count = self.recv_i64().await?;
        self.finish(count)
    }

    pub async fn delete_key(&mut self, key: &[u8]) -> Result<bool> {
        self.begin()?;
        self.send(&Request::DeleteKey { key }).await?;
        let removed = self.recv_i64().await?;
        self.finish(removed == 1)
    }

    pub async fn append(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        self.begin()?;
        self.send(&Request::Append { key, value }).await?;
        self.finish(())
    }

    /// MULTI_GET without waiting: missing keys read as empty.
    pub async fn multi_get_now(&mut self, keys: &[&[u8]]) -> Result<Vec<Bytes>> {
        self.begin()?;
        self.send(&Request::MultiGet { keys: Keys::from_slice(keys) }).await?;
        let mut values = Vec::with_capacity(keys.len());
        for _ in keys {
            values.push(self.recv_bytes().await?);
        }
        self.finish(values)
    }

    /// Waits up to `timeout` for every key, then reads them all (torch's `multi_get`).
    pub async fn multi_get(&mut self, keys: &[&[u8]], timeout: Option<Duration>) -> Result<Vec<Bytes>> {
        self.wait(keys, timeout).await?;
        self.multi_get_now(keys).await
    }

    pub async fn multi_set(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<()> {
        self.begin()?;
        self.send(&Request::MultiSet { pairs: pairs.to_vec() }).await?;
        self.finish(())
    }

    pub async fn queue_push(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        self.begin()?;
        self.send(&Request::QueuePush { key, value }).await?;
        self.finish(())
    }

    /// Pops the oldest item. Blocking pops first wait (up to `timeout`) for an item; a
    /// non-blocking pop of an empty queue is [`StoreError::QueueEmpty`].
    pub async fn queue_pop(&mut self, key: &[u8], block: bool, timeout: Option<Duration>) -> Result<Bytes> {
        if block {
            self.wait(&[key], timeout).await?;
        }
        self.begin()?;
        self.send(&Request::QueuePop { key }).await?;
        let item = match self.recv_i64().await? {
            0 => None,
            _ => Some(self.recv_bytes().await?),
        };
        self.finish(())?;
        item.ok_or(StoreError::QueueEmpty)
    }

    pub async fn queue_len(&mut self, key: &[u8]) -> Result<i64> {
        self.begin()?;
        self.send(&Request::QueueLen { key }).await?;
        let len = self.recv_i64().await?;
        self.finish(len)
    }

    /// Every key the server holds, raw (torch's `/` prefixes and `init/` included).
    pub async fn list_keys(&mut self) -> Result<Vec<Bytes>> {
        self.begin()?;
        self.send(&Request::ListKeys).await?;
        let count = self.recv_i64().await?;
        let count = usize::try_from(count)
            .map_err(|_| self.protocol_error(format!("LIST_KEYS answered a count of {count}")))?;
        let mut keys = Vec::with_capacity(count.min(4096));
        for _ in 0..count {
            keys.push(self.recv_bytes().await?);
        }
        self.finish(keys)
    }

    /// Arrives at the barrier `key` and blocks until `world_size` parties have arrived.
    pub async fn barrier(&mut self, key: &[u8], world_size: i64, timeout: Option<Duration>) -> Result<()> {
        self.begin()?;
        self.send(&Request::Barrier { key, world_size }).await?;
        match self.await_release(timeout).await? {
            WaitEnd::Released => self.finish(()),
            WaitEnd::TimedOut => Err(StoreError::BarrierTimeout {
                timeout: timeout.unwrap_or_default(),
                key: String::from_utf8_lossy(key).into_owned(),
            }),
            WaitEnd::Interrupted => Err(StoreError::Interrupted),
        }
    }

    /// Round trip with a nonce the server echoes.
    pub async fn ping(&mut self) -> Result<()> {
        let nonce = fastrand::u32(..);
        self.begin()?;
        self.send(&Request::Ping { nonce }).await?;
        let echoed = self.recv_u32().await?;
        if echoed != nonce {
            return Err(self.protocol_error(format!("PING echoed {echoed} instead of {nonce}")));
        }
        self.finish(())
    }

    fn begin(&mut self) -> Result<()> {
        match &self.state {
            State::Ready => {
                self.state = State::Busy;
                Ok(())
            }
            State::Busy => {
                Err(self.lost("an earlier operation was abandoned before its reply arrived; open a new connection"))
            }
            State::Broken(reason) => {
                Err(StoreError::ConnectionLost { peer: self.peer.clone(), reason: reason.clone() })
            }
        }
    }

    fn finish<T>(&mut self, value: T) -> Result<T> {
        self.state = State::Ready;
        Ok(value)
    }

    /// Marks the connection unusable and describes why.
    fn lost(&mut self, reason: impl Into<String>) -> StoreError {
        let reason = reason.into();
        self.state = State::Broken(reason.clone());
        StoreError::ConnectionLost { peer: self.peer.clone(), reason }
    }

    fn protocol_error(&mut self, detail: String) -> StoreError {
        self.state = State::Broken(format!("protocol error: {detail}"));
        StoreError::Protocol { peer: self.peer.clone(), detail }
    }

    fn io_error(&mut self, err: io::Error) -> StoreError {
        match err.kind() {
            io::ErrorKind::UnexpectedEof => self.lost("the server closed the connection"),
            _ => self.lost(err.to_string()),
        }
    }

    async fn send(&mut self, request: &Request<'_>) -> Result<()> {
        self.encode_buf.clear();
        request.encode(&mut self.encode_buf);
        match self.stream.write_all(&self.encode_buf).await {
            Ok(()) => Ok(()),
            Err(err) => Err(self.io_error(err)),
        }
    }

    /// Reads until `n` bytes are buffered, bounded by the reply timeout.
    async fn fill(&mut self, n: usize) -> Result<()> {
        if self.read_buf.len() >= n {
            return Ok(());
        }
        let filled = fill_buffer(&mut self.stream, &mut self.read_buf, n);
        let result = match self.reply_timeout {
            None => filled.await,
            Some(timeout) => match tokio::time::timeout(timeout, filled).await {
                Ok(result) => result,
                Err(_) => {
                    self.state = State::Broken(format!("no reply within {timeout:?}"));
                    return Err(StoreError::ReplyTimeout { peer: self.peer.clone(), timeout });
                }
            },
        };
        result.map_err(|err| self.io_error(err))
    }

    async fn recv_u8(&mut self) -> Result<u8> {
        self.fill(1).await?;
        Ok(self.read_buf.get_u8())
    }

    async fn recv_u32(&mut self) -> Result<u32> {
        self.fill(4).await?;
        Ok(self.read_buf.get_u32_le())
    }

    async fn recv_i64(&mut self) -> Result<i64> {
        self.fill(8).await?;
        Ok(self.read_buf.get_i64_le())
    }

    async fn recv_bytes(&mut self) -> Result<Bytes> {
        self.fill(8).await?;
        let len = self.read_buf.get_u64_le();
        if len > MAX_REPLY_LEN {
            return Err(self.protocol_error(format!("reply of {len} bytes announced")));
        }
        self.fill(len as usize).await?;
        Ok(self.read_buf.split_to(len as usize).freeze())
    }

    /// Waits for the STOP_WAITING owed to a WAIT or BARRIER, up to `timeout`, letting the
    /// interrupt check end it early. A wait that ends early is cancelled on the server; if
    /// the release raced the cancel (`00 01`), the wait counts as released.
    async fn await_release(&mut self, timeout: Option<Duration>) -> Result<WaitEnd> {
        let end = {
            let reply = fill_buffer(&mut self.stream, &mut self.read_buf, 1);
            let expiry = async {
                match timeout {
                    Some(timeout) => tokio::time::sleep(timeout).await,
                    None => pending().await,
                }
            };
            let interrupted = self.interrupt.wait();
            tokio::select! {
                biased;
                reply = reply => reply.map(|()| None),
                _ = expiry => Ok(Some(WaitEnd::TimedOut)),
                _ = interrupted => Ok(Some(WaitEnd::Interrupted)),
            }
        };
        match end.map_err(|err| self.io_error(err))? {
            None => match self.read_buf.get_u8() {
                STOP_WAITING => Ok(WaitEnd::Released),
                other => Err(self.protocol_error(format!("expected STOP_WAITING, got {other:#04x}"))),
            },
            Some(end) => {
                let released = self.cancel_wait().await?;
                self.state = State::Ready;
                Ok(if released { WaitEnd::Released } else { end })
            }
        }
    }

    /// Sends CANCEL_WAIT and reads its acknowledgement; true if a STOP_WAITING arrived first.
    async fn cancel_wait(&mut self) -> Result<bool> {
        self.send(&Request::CancelWait).await?;
        match self.recv_u8().await? {
            WAIT_CANCELED => Ok(false),
            STOP_WAITING => match self.recv_u8().await? {
                WAIT_CANCELED => Ok(true),
                other => Err(self.protocol_error(format!("expected WAIT_CANCELED, got {other:#04x}"))),
            },
            other => Err(self.protocol_error(format!("expected WAIT_CANCELED, got {other:#04x}"))),
        }
    }
}

/// Reads from `stream` until `buf` holds `n` bytes. Cancel-safe: bytes read before a
/// cancellation stay in `buf`.
async fn fill_buffer(stream: &mut Transport, buf: &mut BytesMut, n: usize) -> io::Result<()> {
    if buf.capacity() < n {
        buf.reserve(n - buf.len());
    }
    while buf.len() < n {
        if stream.read_buf(buf).await? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(())
}
