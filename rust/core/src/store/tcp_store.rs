//! torch's `TCPStore` semantics on top of [`Client`]: user keys get a `/` prefix on the wire,
//! a store built with `world_size` counts itself into `init/`, and a master hosts the server
//! in-process and waits for its workers.

use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::Duration;

use bytes::Bytes;

use super::client::{Client, ConnectOptions};
use super::error::{Result, StoreError};
use super::protocol::INIT_KEY;
use super::server::uring::UringServer;
use super::server::{BackgroundServer, Io, ServerConfig};
use crate::auth::{PlainClients, Secret};
use crate::interrupt::Interrupt;

/// Threads of an in-process epoll server: one. Every request takes the data's one lock and most of
/// its cost is the kernel's TCP path, so a second thread served less and later: on two, 0.81x
/// the requests/s of the one-threaded elastix-store at 16 connections and 3x its p99 at 256;
/// on one, 0.90x and the same p99 (store_bench.py, two cores shared with the clients).
const IN_PROCESS_SERVER_THREADS: usize = 1;

/// How often a master on io_uring reads how many workers joined (torch's master: 10 ms).
const COUNTER_POLL: Duration = Duration::from_millis(10);

/// The arguments of torch's `TCPStore(...)` constructor.
#[derive(Clone, Debug)]
pub struct TcpStoreOptions {
    pub host: String,
    pub port: u16,
    pub world_size: Option<u32>,
    pub is_master: bool,
    /// Connect deadline, default wait/get deadline, and the master's wait for workers.
    /// `None` waits forever.
    pub timeout: Option<Duration>,
    pub wait_for_workers: bool,
    /// A second master on the same port in this process shares the first one's server.
    pub multi_tenant: bool,
    /// Serve on this already bound socket instead of binding one.
    pub listen_fd: Option<Arc<OwnedFd>>,
    /// If the port is taken, connect as a client instead of failing (torch does this for a
    /// worker whose agent already hosts the store on `MASTER_PORT`).
    pub client_if_port_taken: bool,
    /// Server settings (limits, connection cap) for a master.
    pub server: ServerConfig,
    /// The job secret this store's connections prove, and a master's server requires (it
    /// then serves plain clients from loopback and from where a client authenticated).
    /// Default: none.
    pub secret: Option<Secret>,
    /// Connect failures at DEBUG only, for a background task's connection whose outage is
    /// reported elsewhere (see [`ConnectOptions::quiet`]). Default: false.
    pub quiet: bool,
}

impl TcpStoreOptions {
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        TcpStoreOptions {
            host: host.into(),
            port,
            world_size: None,
            is_master: false,
            timeout: Some(Duration::from_secs(300)),
            wait_for_workers: true,
            multi_tenant: false,
            listen_fd: None,
            client_if_port_taken: false,
            server: ServerConfig::default(),
            secret: None,
            quiet: false,
        }
    }
}

pub struct TcpStore {
    client: Client,
    /// The in-process server, for a master (and its clones, which keep it alive).
    server: Option<Arc<HostedServer>>,
    host: String,
    port: u16,
    timeout: Option<Duration>,
    secret: Option<Secret>,
    quiet: bool,
}

impl TcpStore {
    pub async fn open(options: TcpStoreOptions) -> Result<TcpStore> {
        let server = if options.is_master { start_or_share_server(&options)? } else { None };
        let port = server.as_ref().map_or(options.port, |server| server.port());
        let mut store =
            TcpStore::connect(&options.host, port, options.timeout, server, options.secret.clone(), options.quiet)
                .await?;
        if let (Some(world_size), true) = (options.world_size, options.wait_for_workers) {
            store.client.add(INIT_KEY, 1).await?;
            if let (Some(server), true) = (store.server.clone(), options.is_master) {
                let target = i64::from(world_size);
                let joined = match server.as_ref() {
                    HostedServer::Epoll(server) => {
                        server.server().wait_for_counter(INIT_KEY, target, options.timeout).await
                    }
                    HostedServer::Uring(_) => store.poll_counter(INIT_KEY, target, options.timeout).await?,
                };
                joined.map_err(|joined| StoreError::WorkersTimeout {
                    timeout: options.timeout.unwrap_or_default(),
                    joined,
                    world_size,
                })?;
            }
        }
        Ok(store)
    }

    async fn connect(
        host: &str,
        port: u16,
        timeout: Option<Duration>,
        server: Option<Arc<HostedServer>>,
        secret: Option<Secret>,
        quiet: bool,
    ) -> Result<TcpStore> {
        let options = ConnectOptions { secret: secret.clone(), quiet, ..ConnectOptions::new(host, port, timeout) };
        let mut client = Client::connect(&options).await?;
        client.set_reply_timeout(timeout);
        Ok(TcpStore { client, server, host: host.to_owned(), port, timeout, secret, quiet })
    }

    /// A new connection to the same server with the same timeout; it does not count itself
    /// into `init/`. It keeps an in-process server alive as long as it lives.
    pub async fn duplicate(&self) -> Result<TcpStore> {
        let (server, secret) = (self.server.clone(), self.secret.clone());
        TcpStore::connect(&self.host, self.port, self.timeout, server, secret, self.quiet).await
    }

    pub fn host(&self) -> &str {
        &self.host
    }

    /// The server's port (for a master started on port 0, the port it got).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Reads the counter under `key` (ADD 0) until it reaches `target`, every 10 ms as torch's
    /// master does: `Ok` with its value once reached, `Err` with the last value at `timeout`.
    /// (The io_uring server's data belongs to its loop, so its master asks as a client would.)
    async fn poll_counter(
        &mut self,
        key: &[u8],
        target: i64,
        timeout: Option<Duration>,
    ) -> Result<std::result::Result<i64, i64>> {
        let deadline = timeout.map(|timeout| tokio::time::Instant::now() + timeout);
        tracing::debug!(target, ?timeout, "waiting for the workers to count themselves into init/");
        loop {
            let current = self.client.add(key, 0).await?;
            if current >= target {
                return Ok(Ok(current));
            }
            let next = tokio::time::Instant::now() + COUNTER_POLL;
            match deadline {
                Some(deadline) if deadline <= tokio::time::Instant::now() => return Ok(Err(current)),
                Some(deadline) => tokio::time::sleep_until(next.min(deadline)).await,
                None => tokio::time::sleep_until(next).await,
            }
        }
    }

    /// Whether this store hosts the server.
    pub fn is_server(&self) -> bool {
        self.server.is_some()
    }

    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
        self.client.set_reply_timeout(timeout);
    }

    /// What lets a caller (Python's Ctrl-C) end this store's waits early.
    pub fn set_interrupt(&mut self, interrupt: Interrupt) {
        self.client.set_interrupt(interrupt);
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// A PING round trip: proves the server is alive and the connection in sync.
    pub async fn ping(&mut self) -> Result<()> {
        self.client.ping().await
    }

    pub async fn set(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        self.client.set(&wire_key(key), value).await
    }

    pub async fn get(&mut self, key: &[u8]) -> Result<Bytes> {
        self.get_within(key, self.timeout).await
    }

    /// [`Self::get`], waiting for the key up to `timeout` (`None`: no limit).
    pub async fn get_within(&mut self, key: &[u8], timeout: Option<Duration>) -> Result<Bytes> {
        self.client.get(&wire_key(key), timeout).await
    }

    pub async fn add(&mut self, key: &[u8], delta: i64) -> Result<i64> {
        self.client.add(&wire_key(key), delta).await
    }

    pub async fn compare_set(&mut self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Bytes> {
        self.client.compare_set(&wire_key(key), expected, desired).await
    }

    pub async fn check(&mut self, keys: &[&[u8]]) -> Result<bool> {
        let keys = wire_keys(keys);
        self.client.check(&as_slices(&keys)).await
    }

    /// Waits for `keys` up to `timeout` (`None`: no limit; pass [`TcpStore::timeout`] for
    /// the store's default).
    pub async fn wait(&mut self, keys: &[&[u8]], timeout: Option<Duration>) -> Result<()> {
        let keys = wire_keys(keys);
        self.client.wait(&as_slices(&keys), timeout).await
    }

    pub async fn delete_key(&mut self, key: &[u8]) -> Result<bool> {
        self.client.delete_key(&wire_key(key)).await
    }

    /// Keys in the whole store, `init/` included (as torch counts).
    pub async fn num_keys(&mut self) -> Result<i64> {
        self.client.num_keys().await
    }

    pub async fn append(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        self.client.append(&wire_key(key), value).await
    }

    pub async fn multi_get(&mut self, keys: &[&[u8]]) -> Result<Vec<Bytes>> {
        self.multi_get_within(keys, self.timeout).await
    }

    /// [`Self::multi_get`], waiting for the keys up to `timeout` (`None`: no limit).
    pub async fn multi_get_within(&mut self, keys: &[&[u8]], timeout: Option<Duration>) -> Result<Vec<Bytes>> {
        let keys = wire_keys(keys);
        self.client.multi_get(&as_slices(&keys), timeout).await
    }

    pub async fn multi_set(&mut self, keys: &[&[u8]], values: &[&[u8]]) -> Result<()> {
        if keys.len() != values.len() {
            return Err(StoreError::InvalidArgument(format!(
                "multi_set got {} keys but {} values; they must be of the same length",
                keys.len(),
                values.len()
            )));
        }
        let keys = wire_keys(keys);
        let pairs: Vec<(&[u8], &[u8])> = keys.iter().map(Vec::as_slice).zip(values.iter().copied()).collect();
        self.client.multi_set(&pairs).await
    }

    pub async fn queue_push(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        self.client.queue_push(&wire_key(key), value).await
    }

    pub async fn queue_pop(&mut self, key: &[u8], block: bool) -> Result<Bytes> {
        self.queue_pop_within(key, block, self.timeout).await
    }

    /// [`Self::queue_pop`], a blocking pop waiting up to `timeout` (`None`: no limit).
    pub async fn queue_pop_within(&mut self, key: &[u8], block: bool, timeout: Option<Duration>) -> Result<Bytes> {
        self.client.queue_pop(&wire_key(key), block, timeout).await
    }

    pub async fn queue_len(&mut self, key: &[u8]) -> Result<i64> {
        self.client.queue_len(&wire_key(key)).await
    }

    /// User keys: those with the `/` prefix, without it (so `init/` is hidden).
    pub async fn list_keys(&mut self) -> Result<Vec<Bytes>> {
        let keys = self.client.list_keys().await?;
        Ok(keys.into_iter().filter(|key| key.starts_with(b"/")).map(|key| key.slice(1..)).collect())
    }

    /// Blocks until `world_size` parties reached the barrier `key`, up to `timeout` (`None`:
    /// no limit).
    pub async fn barrier(&mut self, key: &[u8], world_size: i64, timeout: Option<Duration>) -> Result<()> {
        match self.client.barrier(&wire_key(key), world_size, timeout).await {
            Err(StoreError::BarrierTimeout { timeout, .. }) => Err(StoreError::BarrierTimeout {
                timeout,
                key: String::from_utf8_lossy(key).into_owned(), // torch names the user's key
            }),
            other => other,
        }
    }
}

fn wire_key(key: &[u8]) -> Vec<u8> {
    let mut wire = Vec::with_capacity(key.len() + 1);
    wire.push(b'/');
    wire.extend_from_slice(key);
    wire
}

fn wire_keys(keys: &[&[u8]]) -> Vec<Vec<u8>> {
    keys.iter().map(|key| wire_key(key)).collect()
}

fn as_slices(keys: &[Vec<u8>]) -> Vec<&[u8]> {
    keys.iter().map(Vec::as_slice).collect()
}

/// Masters of one process that ask for `multi_tenant` share one server per port.
fn tenants() -> &'static Mutex<HashMap<u16, Weak<HostedServer>>> {
    static TENANTS: OnceLock<Mutex<HashMap<u16, Weak<HostedServer>>>> = OnceLock::new();
    TENANTS.get_or_init(Default::default)
}

fn start_or_share_server(options: &TcpStoreOptions) -> Result<Option<Arc<HostedServer>>> {
    let mut tenants = tenants().lock().unwrap_or_else(PoisonError::into_inner);
    if options.multi_tenant && options.port != 0 {
        if let Some(server) = tenants.get(&options.port).and_then(Weak::upgrade) {
            return Ok(Some(server));
        }
    }
    let auth = options.secret.clone().map(|secret| (secret, PlainClients::LoopbackAndAuthenticated));
    let config =
        ServerConfig { port: options.port, listen_fd: options.listen_fd.clone(), auth, ..options.server.clone() };
    match HostedServer::start(&config) {
        Ok(server) => {
            let server = Arc::new(server);
            if options.multi_tenant {
                tenants.retain(|_, server| server.strong_count() > 0);
                tenants.insert(server.port(), Arc::downgrade(&server));
            }
            Ok(Some(server))
        }
        Err(err) if options.client_if_port_taken && err.kind() == io::ErrorKind::AddrInUse => {
            tracing::info!(port = options.port, "store port already served; connecting as a client");
            Ok(None)
        }
        Err(err) => Err(StoreError::Listen(err)),
    }
}

/// A master's in-process server: io_uring's on a thread of its own, or epoll's on a runtime of
/// its own (a master with a secret, or where the kernel offers no io_uring), as [`Io`] picks.
enum HostedServer {
    Epoll(BackgroundServer),
    Uring(UringServer),
}

impl HostedServer {
    fn start(config: &ServerConfig) -> io::Result<HostedServer> {
        Ok(match Io::from_env()?.resolve(config)? {
            Io::Uring => HostedServer::Uring(UringServer::start(config)?),
            _ => HostedServer::Epoll(BackgroundServer::start(config, IN_PROCESS_SERVER_THREADS)?),
        })
    }

    fn port(&self) -> u16 {
        match self {
            HostedServer::Epoll(server) => server.port(),
            HostedServer::Uring(server) => server.port(),
        }
    }
}
