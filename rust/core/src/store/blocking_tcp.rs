//! A TCPStore used from plain threads (Python's, with the GIL released), as a
//! [`BlockingStore`] like the in-process and file stores: the connection and a current-thread
//! runtime of its own (the socket belongs to its I/O driver), driven on the calling thread,
//! one call at a time as torch's client does. Its waits are the server's (WAIT, a blocking
//! GET or pop), not polls.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::runtime::{Builder, Runtime};

use super::blocking::BlockingStore;
use super::error::{Result, StoreError};
use super::tcp_store::{TcpStore, TcpStoreOptions};
use crate::interrupt::Interrupt;

struct Connection {
    runtime: Runtime,
    store: TcpStore,
}

pub struct BlockingTcpStore {
    connection: Mutex<Connection>,
    host: String,
    port: u16,
    is_server: bool,
    local_addr: String,
    remote_addr: String,
}

impl BlockingTcpStore {
    /// Connects (and, for a master, starts the server first), as torch's constructor does.
    pub fn open(options: TcpStoreOptions) -> Result<BlockingTcpStore> {
        let runtime = calling_thread_runtime()?;
        let store = runtime.block_on(TcpStore::open(options))?;
        Ok(BlockingTcpStore::wrap(runtime, store))
    }

    /// A new connection to the same server, with the same timeout (never counted into
    /// `init/`).
    pub fn duplicate(&self) -> Result<BlockingTcpStore> {
        // the copy's socket must belong to the copy's own runtime
        let runtime = calling_thread_runtime()?;
        let store = runtime.block_on(self.lock().store.duplicate())?;
        Ok(BlockingTcpStore::wrap(runtime, store))
    }

    fn wrap(runtime: Runtime, store: TcpStore) -> BlockingTcpStore {
        let client = store.client();
        BlockingTcpStore {
            host: store.host().to_owned(),
            port: store.port(),
            is_server: store.is_server(),
            local_addr: client.local_addr().map(|addr| addr.to_string()).unwrap_or_default(),
            remote_addr: client.remote_addr().to_string(),
            connection: Mutex::new(Connection { runtime, store }),
        }
    }

    pub fn host(&self) -> &str {
        &self.host
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether this object serves the store too (a master).
    pub fn is_server(&self) -> bool {
        self.is_server
    }

    pub fn local_addr(&self) -> &str {
        &self.local_addr
    }

    pub fn remote_addr(&self) -> &str {
        &self.remote_addr
    }

    /// The bound on every reply (a wait's default too); `None`: no bound.
    pub fn set_timeout(&self, timeout: Option<Duration>) {
        self.lock().store.set_timeout(timeout);
    }

    /// Blocks until `world_size` parties reached the barrier `key`, up to `timeout`.
    pub fn barrier(&self, key: &[u8], world_size: i64, timeout: Option<Duration>, interrupt: &Interrupt) -> Result<()> {
        self.run(interrupt, async |store| store.barrier(key, world_size, timeout).await)
    }

    /// A PING round trip: proves the server is alive and the connection in sync.
    pub fn ping(&self) -> Result<()> {
        self.run(&Interrupt::never(), async |store| store.ping().await)
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        self.connection.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `op` on the connection, its waits ended early by `interrupt`.
    fn run<T>(&self, interrupt: &Interrupt, op: impl AsyncFnOnce(&mut TcpStore) -> Result<T>) -> Result<T> {
        let mut connection = self.lock();
        let Connection { runtime, store } = &mut *connection;
        store.set_interrupt(interrupt.clone());
        runtime.block_on(op(store))
    }

    fn now<T>(&self, op: impl AsyncFnOnce(&mut TcpStore) -> Result<T>) -> Result<T> {
        self.run(&Interrupt::never(), op)
    }
}

fn calling_thread_runtime() -> Result<Runtime> {
    Builder::new_current_thread().enable_all().build().map_err(StoreError::Runtime)
}

impl BlockingStore for BlockingTcpStore {
    fn set(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.now(async |store| store.set(key, value).await)
    }

    fn get_now(&self, key: &[u8]) -> Result<Option<Bytes>> {
        self.now(async |store| {
            if !store.check(&[key]).await? {
                return Ok(None);
            }
            match store.get_within(key, Some(Duration::ZERO)).await {
                Err(StoreError::WaitTimeout { .. }) => Ok(None), // deleted since the check
                other => other.map(Some),
            }
        })
    }

    fn add(&self, key: &[u8], delta: i64) -> Result<i64> {
        self.now(async |store| store.add(key, delta).await)
    }

    fn compare_set(&self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Bytes> {
        self.now(async |store| store.compare_set(key, expected, desired).await)
    }

    fn check(&self, keys: &[&[u8]]) -> Result<bool> {
        self.now(async |store| store.check(keys).await)
    }

    fn delete_key(&self, key: &[u8]) -> Result<bool> {
        self.now(async |store| store.delete_key(key).await)
    }

    fn num_keys(&self) -> Result<i64> {
        self.now(async |store| store.num_keys().await)
    }

    fn append(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.now(async |store| store.append(key, value).await)
    }

    fn multi_set(&self, pairs: &[(&[u8], &[u8])]) -> Result<()> {
        let (keys, values): (Vec<&[u8]>, Vec<&[u8]>) = pairs.iter().copied().unzip();
        self.now(async |store| store.multi_set(&keys, &values).await)
    }

    fn list_keys(&self) -> Result<Vec<Bytes>> {
        self.now(async |store| store.list_keys().await)
    }

    fn queue_push(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.now(async |store| store.queue_push(key, value).await)
    }

    fn queue_pop_now(&self, key: &[u8]) -> Result<Option<Bytes>> {
        match self.now(async |store| store.queue_pop(key, false).await) {
            Ok(item) => Ok(Some(item)),
            Err(StoreError::QueueEmpty) => Ok(None),
            Err(err) => Err(err),
        }
    }

    fn queue_len(&self, key: &[u8]) -> Result<i64> {
        self.now(async |store| store.queue_len(key).await)
    }

    /// The server's WAIT, bounded by `slice`: it returns once the keys exist or the slice
    /// ran out, whichever comes first.
    fn wait_for_change(&self, keys: &[&[u8]], slice: Duration) -> Result<()> {
        match self.now(async |store| store.wait(keys, Some(slice)).await) {
            Err(StoreError::WaitTimeout { .. }) => Ok(()),
            other => other,
        }
    }

    fn wait(&self, keys: &[&[u8]], timeout: Option<Duration>, interrupt: &Interrupt) -> Result<()> {
        self.run(interrupt, async |store| store.wait(keys, timeout).await)
    }

    fn get(&self, key: &[u8], timeout: Option<Duration>, interrupt: &Interrupt) -> Result<Bytes> {
        self.run(interrupt, async |store| store.get_within(key, timeout).await)
    }

    fn multi_get(&self, keys: &[&[u8]], timeout: Option<Duration>, interrupt: &Interrupt) -> Result<Vec<Bytes>> {
        self.run(interrupt, async |store| store.multi_get_within(keys, timeout).await)
    }

    fn queue_pop(&self, key: &[u8], block: bool, timeout: Option<Duration>, interrupt: &Interrupt) -> Result<Bytes> {
        self.run(interrupt, async |store| store.queue_pop_within(key, block, timeout).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn master() -> BlockingTcpStore {
        let options = TcpStoreOptions {
            is_master: true,
            timeout: Some(Duration::from_secs(10)),
            ..TcpStoreOptions::new("127.0.0.1", 0)
        };
        BlockingTcpStore::open(options).expect("a master store")
    }

    #[test]
    fn the_polling_primitives_answer_at_once() {
        let store = master();
        assert_eq!(store.get_now(b"missing").unwrap(), None);
        store.set(b"k", b"v").unwrap();
        assert_eq!(store.get_now(b"k").unwrap().as_deref(), Some(&b"v"[..]));
        assert_eq!(store.queue_pop_now(b"q").unwrap(), None);
        store.queue_push(b"q", b"item").unwrap();
        assert_eq!(store.queue_pop_now(b"q").unwrap().as_deref(), Some(&b"item"[..]));
        // a slice that runs out is no error: the caller checks again
        store.wait_for_change(&[b"never"], Duration::from_millis(20)).unwrap();
        store.multi_set(&[(b"a", b"1"), (b"b", b"2")]).unwrap();
        assert_eq!(store.list_keys().unwrap().len(), 3);
    }

    #[test]
    fn waits_are_the_servers_and_end_on_timeout_or_interrupt() {
        let store = master();
        let other = store.duplicate().unwrap();
        other.set(b"late", b"here").unwrap();
        assert_eq!(store.get(b"late", None, &Interrupt::never()).unwrap(), "here");
        let err = store.wait(&[b"never"], Some(Duration::from_millis(50)), &Interrupt::never()).unwrap_err();
        assert!(matches!(err, StoreError::WaitTimeout { .. }), "{err}");
        let err = store.get(b"never", None, &Interrupt::new(|| true)).unwrap_err();
        assert!(matches!(err, StoreError::Interrupted), "{err}");
        // the connection stays usable after an interrupted wait
        store.set(b"after", b"ok").unwrap();
        assert_eq!(store.multi_get(&[b"late", b"after"], None, &Interrupt::never()).unwrap(), ["here", "ok"]);
    }
}
