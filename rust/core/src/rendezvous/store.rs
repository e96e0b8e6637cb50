//! The store operations the c10d rendezvous is built from, as a backend trait: implemented here
//! over the TCPStore protocol (elastix's server or torch's). (etcd has a rendezvous of its own,
//! built on leases and watches: [`crate::rendezvous::etcd`].)
//!
//! Every key is relative to the run's prefix. Reads of keys that may be missing go through
//! `wait`/`check` first: torch's legacy server drops a connection that GETs a missing key.
//!
//! A store may have several sites (`--rdzv-endpoint a:p,b:p,...`): the job's state lives at
//! one of them, the active site, and moves to another when that one is lost (see
//! [`super::locate`]). Clones share the active site.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::auth::Secret;
use crate::rendezvous::error::Result;
use crate::store::client::Backoff;
use crate::store::{Client, ConnectOptions, StoreError};

/// A place to open connections to.
pub trait RendezvousStore: Clone + Send + Sync + 'static {
    type Conn: StoreConn;

    /// A new connection to the active site, retried until the store's own patience runs out
    /// (each background task of a handler has its own, since one connection carries one
    /// request at a time).
    fn connect(&self) -> impl Future<Output = Result<Self::Conn>> + Send;

    /// [`Self::connect`] that gives up after `patience` at the latest: a wait with a deadline of
    /// its own shows that deadline's countdown, not a fresh one per connection.
    /// `quiet`: failures at DEBUG (a question whose caller reports the answer).
    fn connect_within(&self, patience: Duration, quiet: bool) -> impl Future<Output = Result<Self::Conn>> + Send {
        let _ = (patience, quiet);
        self.connect()
    }

    /// A new connection to `site`, retried for at most `patience`, for a background task: its
    /// failures are said at DEBUG (the task's owner reports the outage once).
    fn connect_site(&self, site: usize, patience: Duration) -> impl Future<Output = Result<Self::Conn>> + Send;

    /// A new connection to `site` if it answers at once: one attempt or two, within `patience`.
    fn probe_site(&self, site: usize, patience: Duration) -> impl Future<Output = Result<Self::Conn>> + Send {
        self.connect_site(site, patience)
    }

    /// How many sites the state may live at (1 for a single store).
    fn sites(&self) -> usize {
        1
    }

    /// The site connections go to.
    fn active_site(&self) -> usize {
        0
    }

    /// Moves every clone's connections to `site`.
    fn set_active_site(&self, _site: usize) {}

    /// Host and port of `site`.
    fn address(&self, site: usize) -> (String, u16);

    /// Whether the store speaks the TCPStore protocol, so that a round's agents can use it
    /// for their own keys (the rank exchange); if not, they use the round's workers' store.
    fn serves_rounds(&self) -> bool {
        true
    }

    /// Where the active site is, for messages.
    fn describe(&self) -> String {
        self.describe_site(self.active_site())
    }

    /// Where `site` is, for messages.
    fn describe_site(&self, site: usize) -> String {
        let (host, port) = self.address(site);
        format!("{host}:{port}")
    }
}

/// The key (outside every run's prefix) that lists the runs a c10d store has held, one run ID
/// per line, appended by the node that creates a run's state (`elastix status` without a run
/// ID reads it).
pub const RUNS_KEY: &str = "/elastix/rdzv/runs";

/// One connection's operations.
pub trait StoreConn: Send + 'static {
    /// Adds `run_id` to the store's list of runs ([`RUNS_KEY`]).
    fn register_run(&mut self, run_id: &str) -> impl Future<Output = Result<()>> + Send;
    fn add(&mut self, key: &str, delta: i64) -> impl Future<Output = Result<i64>> + Send;
    fn set(&mut self, key: &str, value: &[u8]) -> impl Future<Output = Result<()>> + Send;
    /// Sets several keys in one request, in order.
    fn multi_set(&mut self, pairs: &[(String, Vec<u8>)]) -> impl Future<Output = Result<()>> + Send;
    /// torch's COMPARE_SET: returns the value now stored (or `expected` if the key is missing
    /// and `expected` is not empty).
    fn compare_set(&mut self, key: &str, expected: &[u8], desired: &[u8])
        -> impl Future<Output = Result<Bytes>> + Send;
    /// Blocks until every key exists; `Ok(false)` if `timeout` passed first.
    fn wait(&mut self, keys: &[String], timeout: Option<Duration>) -> impl Future<Output = Result<bool>> + Send;
    /// Whether every key exists, without waiting.
    fn check(&mut self, keys: &[String]) -> impl Future<Output = Result<bool>> + Send;
    /// Values of keys known to exist.
    fn multi_get(&mut self, keys: &[String]) -> impl Future<Output = Result<Vec<Bytes>>> + Send;
    fn delete(&mut self, key: &str) -> impl Future<Output = Result<bool>> + Send;

    /// Counts one more under `key` and returns the new count. A tally key is only ever
    /// counted up and read with [`Self::tally`], never set or compared.
    fn count_up(&mut self, key: &str) -> impl Future<Output = Result<i64>> + Send {
        self.add(key, 1)
    }

    /// The count under a tally key (0 before the first).
    fn tally(&mut self, key: &str) -> impl Future<Output = Result<i64>> + Send {
        self.add(key, 0)
    }
    /// False once the connection cannot be used any more (broken, or an operation on it was
    /// abandoned midway); the caller should open a new one.
    fn is_usable(&self) -> bool;

    /// The value of `key`, or `None` if it is missing.
    fn try_get(&mut self, key: &str) -> impl Future<Output = Result<Option<Bytes>>> + Send {
        let keys = [key.to_owned()];
        async move {
            if self.check(&keys).await? {
                Ok(Some(self.multi_get(&keys).await?.remove(0)))
            } else {
                Ok(None)
            }
        }
    }

    /// The value of a key known to exist.
    fn get(&mut self, key: &str) -> impl Future<Output = Result<Bytes>> + Send {
        let keys = [key.to_owned()];
        async move { Ok(self.multi_get(&keys).await?.remove(0)) }
    }

    /// Waits up to `timeout` for `key` and reads it; `None` if it did not appear in time.
    fn wait_get(&mut self, key: &str, timeout: Option<Duration>) -> impl Future<Output = Result<Option<Bytes>>> + Send {
        let keys = [key.to_owned()];
        async move {
            if self.wait(&keys, timeout).await? {
                Ok(Some(self.multi_get(&keys).await?.remove(0)))
            } else {
                Ok(None)
            }
        }
    }
}

/// torch's store operation timeout for the rendezvous store (`read_timeout`).
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Connection attempts to one of several sites before it counts as down (a refusal is
/// answer enough; the second attempt covers a connection reset while it restarts).
const SITE_ATTEMPTS: u32 = 2;

/// TCPStore servers (elastix's or torch's) holding the rendezvous under a key prefix: one, or
/// an ordered list of sites.
#[derive(Clone, Debug)]
pub struct TcpRendezvousStore {
    sites: Arc<[(String, u16)]>,
    active: Arc<AtomicUsize>,
    /// How long [`RendezvousStore::connect`] keeps trying (`None`: forever).
    patience: Option<Duration>,
    backoff: Backoff,
    prefix: String,
    /// Bound on each ordinary request (torch's `read_timeout`).
    read_timeout: Duration,
    /// The job secret every connection proves.
    secret: Option<Secret>,
    /// What to do about a store that stays away, for the main connection's WARNs.
    hint: Option<String>,
}

impl TcpRendezvousStore {
    /// A single store at `options`' address.
    pub fn new(options: ConnectOptions, prefix: impl Into<String>, read_timeout: Duration) -> Self {
        let sites = vec![(options.host, options.port)];
        let mut store = Self::with_sites(sites, options.timeout, prefix, read_timeout, options.secret);
        store.backoff = options.backoff;
        store
    }

    /// Stores at `sites`, in order of preference; the first is active until the job moves.
    /// Every connection proves `secret`, if given.
    pub fn with_sites(
        sites: Vec<(String, u16)>,
        patience: Option<Duration>,
        prefix: impl Into<String>,
        read_timeout: Duration,
        secret: Option<Secret>,
    ) -> Self {
        assert!(!sites.is_empty(), "a rendezvous store needs at least one site");
        TcpRendezvousStore {
            sites: sites.into(),
            active: Arc::new(AtomicUsize::new(0)),
            patience,
            backoff: Backoff::default(),
            prefix: prefix.into(),
            read_timeout,
            secret,
            hint: None,
        }
    }

    /// Says `hint` with every WARN about a store that stays away (who serves it, what to do).
    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    pub fn host(&self) -> &str {
        &self.sites[self.active_site()].0
    }

    pub fn port(&self) -> u16 {
        self.sites[self.active_site()].1
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    async fn open(
        &self,
        site: usize,
        patience: Option<Duration>,
        max_attempts: Option<u32>,
        quiet: bool,
    ) -> Result<TcpConn> {
        let (host, port) = self.sites[site].clone();
        let options = ConnectOptions {
            backoff: self.backoff.clone(),
            max_attempts,
            secret: self.secret.clone(),
            quiet,
            hint: self.hint.clone(),
            ..ConnectOptions::new(host, port, patience)
        };
        let mut client = Client::connect(&options).await?;
        client.set_reply_timeout(Some(self.read_timeout));
        Ok(TcpConn { client, prefix: self.prefix.clone() })
    }
}

impl RendezvousStore for TcpRendezvousStore {
    type Conn = TcpConn;

    async fn connect(&self) -> Result<TcpConn> {
        // with several sites a refused connection means this site's store is down: the next
        // one is tried at once (a single store is waited for: it may start after its agents)
        let attempts = (self.sites.len() > 1).then_some(SITE_ATTEMPTS);
        self.open(self.active_site(), self.patience, attempts, false).await
    }

    async fn connect_within(&self, patience: Duration, quiet: bool) -> Result<TcpConn> {
        let attempts = (self.sites.len() > 1).then_some(SITE_ATTEMPTS);
        let patience = self.patience.map_or(patience, |own| own.min(patience));
        self.open(self.active_site(), Some(patience), attempts, quiet).await
    }

    async fn connect_site(&self, site: usize, patience: Duration) -> Result<TcpConn> {
        self.open(site, Some(patience), None, true).await
    }

    async fn probe_site(&self, site: usize, patience: Duration) -> Result<TcpConn> {
        self.open(site, Some(patience), Some(SITE_ATTEMPTS), true).await
    }

    fn sites(&self) -> usize {
        self.sites.len()
    }

    fn active_site(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    fn set_active_site(&self, site: usize) {
        assert!(site < self.sites.len(), "site {site} of {}", self.sites.len());
        self.active.store(site, Ordering::Release);
    }

    fn address(&self, site: usize) -> (String, u16) {
        self.sites[site].clone()
    }
}

pub struct TcpConn {
    client: Client,
    prefix: String,
}

impl TcpConn {
    fn key(&self, key: &str) -> Vec<u8> {
        let mut full = Vec::with_capacity(self.prefix.len() + key.len());
        full.extend_from_slice(self.prefix.as_bytes());
        full.extend_from_slice(key.as_bytes());
        full
    }

    fn keys(&self, keys: &[String]) -> Vec<Vec<u8>> {
        keys.iter().map(|key| self.key(key)).collect()
    }
}

/// Counts and times a request for the agent's metrics.
async fn timed<T>(
    op: &'static str,
    request: impl std::future::Future<Output = std::result::Result<T, StoreError>>,
) -> std::result::Result<T, StoreError> {
    let failed = |err: &StoreError| !matches!(err, StoreError::WaitTimeout { .. });
    crate::metrics::store::client().timed(op, request, failed).await
}

fn slices(keys: &[Vec<u8>]) -> Vec<&[u8]> {
    keys.iter().map(Vec::as_slice).collect()
}

impl StoreConn for TcpConn {
    async fn register_run(&mut self, run_id: &str) -> Result<()> {
        let line = format!("{run_id}\n");
        Ok(timed("append", self.client.append(RUNS_KEY.as_bytes(), line.as_bytes())).await?)
    }

    async fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let key = self.key(key);
        Ok(timed("add", self.client.add(&key, delta)).await?)
    }

    async fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let key = self.key(key);
        Ok(timed("set", self.client.set(&key, value)).await?)
    }

    async fn multi_set(&mut self, pairs: &[(String, Vec<u8>)]) -> Result<()> {
        let keys: Vec<Vec<u8>> = pairs.iter().map(|(key, _)| self.key(key)).collect();
        let pairs: Vec<(&[u8], &[u8])> =
            keys.iter().zip(pairs).map(|(key, (_, value))| (key.as_slice(), value.as_slice())).collect();
        Ok(timed("multi_set", self.client.multi_set(&pairs)).await?)
    }

    async fn compare_set(&mut self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Bytes> {
        let key = self.key(key);
        Ok(timed("compare_set", self.client.compare_set(&key, expected, desired)).await?)
    }

    async fn wait(&mut self, keys: &[String], timeout: Option<Duration>) -> Result<bool> {
        let keys = self.keys(keys);
        match timed("wait", self.client.wait(&slices(&keys), timeout)).await {
            Ok(()) => Ok(true),
            Err(StoreError::WaitTimeout { .. }) => Ok(false),
            Err(err) => Err(err.into()),
        }
    }

    async fn check(&mut self, keys: &[String]) -> Result<bool> {
        let keys = self.keys(keys);
        Ok(timed("check", self.client.check(&slices(&keys))).await?)
    }

    async fn multi_get(&mut self, keys: &[String]) -> Result<Vec<Bytes>> {
        let keys = self.keys(keys);
        // Callers waited for or checked these keys, so a plain MULTI_GET is safe on every server.
        Ok(timed("multi_get", self.client.multi_get_now(&slices(&keys))).await?)
    }

    async fn delete(&mut self, key: &str) -> Result<bool> {
        let key = self.key(key);
        Ok(timed("delete", self.client.delete_key(&key)).await?)
    }

    fn is_usable(&self) -> bool {
        self.client.is_usable()
    }
}
