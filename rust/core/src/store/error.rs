//! Errors a store user sees. Each message says what happened and where, in terms a user of
//! torch's TCPStore recognises (the wait and barrier timeouts keep torch's wording).

use std::io;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No connection and handshake succeeded before the connect deadline.
    #[error(
        // torch's sentence first: users match on it
        "The client socket has timed out after {}ms while trying to connect to ({host}, {port}). ({attempts} attempts; last error: {last_error}; addresses tried: {tried})",
        elapsed.as_millis()
    )]
    ConnectTimeout { host: String, port: u16, elapsed: Duration, attempts: u32, tried: String, last_error: String },

    /// A WAIT (or a `get` waiting for its key) passed its deadline and was cancelled; the
    /// connection is still usable.
    #[error("wait timeout after {}ms, keys: {}", timeout.as_millis(), keys.join(", "))]
    WaitTimeout { timeout: Duration, keys: Vec<String> },

    /// A BARRIER passed its deadline and was cancelled; the connection is still usable.
    #[error("barrier timeout after {}ms, key: {key}", timeout.as_millis())]
    BarrierTimeout { timeout: Duration, key: String },

    /// A master's wait for `world_size` clients to join passed its deadline.
    #[error("Timed out after {} seconds waiting for clients. {joined}/{world_size} clients joined.", timeout.as_secs())]
    WorkersTimeout { timeout: Duration, joined: i64, world_size: u32 },

    /// The server sent nothing for a request within the reply deadline.
    #[error("the store at {peer} sent no reply within {:.1}s", timeout.as_secs_f64())]
    ReplyTimeout { peer: String, timeout: Duration },

    /// The connection broke or was closed by the server; it cannot be used any more.
    #[error("connection to the store at {peer} lost: {reason}")]
    ConnectionLost { peer: String, reason: String },

    /// This client and the server do not share the job secret (one lacks it, or they hold
    /// different ones); retrying cannot help.
    #[error("the store at {peer} refused this client: {reason}")]
    Auth { peer: String, reason: String },

    /// What answers at the address is not a TCPStore server (a web server, say): its answer
    /// to the opening PING says so, and no retry can change it.
    #[error("{peer} is not a TCPStore server: {detail}; is another service using that port?")]
    NotAStore { peer: String, detail: String },

    /// The server answered something the protocol does not allow.
    #[error("protocol error from the store at {peer}: {detail}")]
    Protocol { peer: String, detail: String },

    /// A blocking wait was interrupted by the caller (Ctrl-C); the wait was cancelled cleanly.
    #[error("interrupted while waiting")]
    Interrupted,

    /// A non-blocking queue pop found the queue empty.
    #[error("queue is empty")]
    QueueEmpty,

    /// The caller passed something unusable; nothing was sent.
    #[error("{0}")]
    InvalidArgument(String),

    /// Starting a server failed (port in use, bad host, bad listen fd).
    #[error("{0}")]
    Listen(io::Error),

    /// The runtime that drives a blocking TCPStore connection could not be started (no
    /// threads or descriptors left).
    #[error("cannot start the runtime of a store connection: {0}")]
    Runtime(io::Error),

    /// A file store's file could not be opened, locked, read or written, or holds something
    /// other than a store.
    #[error("file store {}: {reason}", path.display())]
    File { path: PathBuf, reason: String },
}

impl StoreError {
    /// Whether the server could not be reached or stopped answering (it may come back), as
    /// opposed to an answer.
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            StoreError::ConnectionLost { .. } | StoreError::ReplyTimeout { .. } | StoreError::ConnectTimeout { .. }
        )
    }

    /// True for every error that means a deadline passed.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            StoreError::ConnectTimeout { .. }
                | StoreError::WaitTimeout { .. }
                | StoreError::BarrierTimeout { .. }
                | StoreError::WorkersTimeout { .. }
                | StoreError::ReplyTimeout { .. }
        )
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;
