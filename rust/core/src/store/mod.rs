//! A key-value store that speaks torch's TCPStore wire protocol byte for byte.
//!
//! * [`protocol`], [`request`]: the wire format (opcodes, encoding, incremental decoding).
//! * [`data`], [`counter`]: what each operation means, shared by every store flavour.
//! * [`waiters`], [`execute`]: blocking waits and the execution of requests on a server.
//! * [`server`]: the tokio server; [`client`]: the tokio client; [`tcp_store`]: torch's
//!   TCPStore semantics over them.
//! * [`blocking`], [`local`], [`file`], [`blocking_tcp`]: stores for plain threads
//!   (in-process, file-backed, and a TCPStore connection driven on the calling thread).
//! * [`linger`]: a process that serves a store lets the others finish before it exits.

pub mod blocking;
pub mod blocking_tcp;
pub mod client;
pub mod counter;
pub mod data;
pub mod error;
pub mod execute;
pub mod file;
pub mod limits;
pub mod linger;
pub mod local;
pub mod protocol;
pub mod request;
pub mod server;
pub mod tcp_store;
pub mod transport;
pub mod waiters;

pub use blocking::BlockingStore;
pub use blocking_tcp::BlockingTcpStore;
pub use client::{Client, ConnectOptions};
pub use error::StoreError;
pub use file::FileStore;
pub use limits::Limits;
pub use local::LocalStore;
pub use server::{AnyServer, BackgroundServer, ServerConfig, StoreServer};
pub use tcp_store::{TcpStore, TcpStoreOptions};
