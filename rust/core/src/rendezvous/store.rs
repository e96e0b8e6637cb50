//! The store operations the rendezvous is built from, as a backend trait: implemented here over
//! the TCPStore protocol (elastix's server or torch's), and open to other engines (etcd) later.
//!
//! Every key is relative to the run's prefix. Reads of keys that may be missing go through
//! `wait`/`check` first: torch's legacy server drops a connection that GETs a missing key.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

use super::error::Result;
use crate::store::{Client, ConnectOptions, StoreError};

/// A place to open connections to.
pub trait RendezvousStore: Clone + Send + Sync + 'static {
    type Conn: StoreConn;

    /// A new connection (each background task of a handler has its own, since one
    /// connection carries one request at a time).
    fn connect(&self) -> impl Future<Output = Result<Self::Conn>> + Send;

    /// Where the store is, for messages.
    fn describe(&self) -> String;
}

/// One connection's operations.
pub trait StoreConn: Send + 'static {
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
    /// False once the connection cannot be used any more (broken, or an operation on it was
    /// abandoned midway); the caller should open a new one.
    fn is_usable(&self) -> bool;

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

/// A TCPStore server (elastix's or torch's) holding the rendezvous under a key prefix.
#[derive(Clone, Debug)]
pub struct TcpRendezvousStore {
    options: ConnectOptions,
    prefix: String,
    /// Bound on each ordinary request (torch's `read_timeout`).
    read_timeout: Duration,
}

impl TcpRendezvousStore {
    pub fn new(options: ConnectOptions, prefix: impl Into<String>, read_timeout: Duration) -> Self {
        TcpRendezvousStore { options, prefix: prefix.into(), read_timeout }
    }

    pub fn host(&self) -> &str {
        &self.options.host
    }

    pub fn port(&self) -> u16 {
        self.options.port
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }
}

impl RendezvousStore for TcpRendezvousStore {
    type Conn = TcpConn;

    async fn connect(&self) -> Result<TcpConn> {
        let mut client = Client::connect(&self.options).await?;
        client.set_reply_timeout(Some(self.read_timeout));
        Ok(TcpConn { client, prefix: self.prefix.clone() })
    }

    fn describe(&self) -> String {
        format!("{}:{}", self.options.host, self.options.port)
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

fn slices(keys: &[Vec<u8>]) -> Vec<&[u8]> {
    keys.iter().map(Vec::as_slice).collect()
}

impl StoreConn for TcpConn {
    async fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let key = self.key(key);
        Ok(self.client.add(&key, delta).await?)
    }

    async fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let key = self.key(key);
        Ok(self.client.set(&key, value).await?)
    }

    async fn multi_set(&mut self, pairs: &[(String, Vec<u8>)]) -> Result<()> {
        let keys: Vec<Vec<u8>> = pairs.iter().map(|(key, _)| self.key(key)).collect();
        let pairs: Vec<(&[u8], &[u8])> =
            keys.iter().zip(pairs).map(|(key, (_, value))| (key.as_slice(), value.as_slice())).collect();
        Ok(self.client.multi_set(&pairs).await?)
    }

    async fn compare_set(&mut self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Bytes> {
        let key = self.key(key);
        Ok(self.client.compare_set(&key, expected, desired).await?)
    }

    async fn wait(&mut self, keys: &[String], timeout: Option<Duration>) -> Result<bool> {
        let keys = self.keys(keys);
        match self.client.wait(&slices(&keys), timeout).await {
            Ok(()) => Ok(true),
            Err(StoreError::WaitTimeout { .. }) => Ok(false),
            Err(err) => Err(err.into()),
        }
    }

    async fn check(&mut self, keys: &[String]) -> Result<bool> {
        let keys = self.keys(keys);
        Ok(self.client.check(&slices(&keys)).await?)
    }

    async fn multi_get(&mut self, keys: &[String]) -> Result<Vec<Bytes>> {
        let keys = self.keys(keys);
        // Callers waited for or checked these keys, so a plain MULTI_GET is safe on every server.
        Ok(self.client.multi_get_now(&slices(&keys)).await?)
    }

    async fn delete(&mut self, key: &str) -> Result<bool> {
        let key = self.key(key);
        Ok(self.client.delete_key(&key).await?)
    }

    fn is_usable(&self) -> bool {
        self.client.is_usable()
    }
}
