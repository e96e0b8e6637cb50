//! `TcpStoreCore`: one TCPStore connection (and, for a master, its in-process server), driven
//! by a current-thread tokio runtime of its own on the calling thread, with the GIL released.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use elastix_core::store::error::Result as StoreResult;
use elastix_core::store::server::listener::duplicate_socket_fd;
use elastix_core::store::{TcpStore, TcpStoreOptions};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokio::runtime::Runtime;

use crate::errors::to_py;
use crate::exit_gate::drop_without_gil;
use crate::interrupt::PendingSignal;
use crate::runtimes;
use crate::timeout::{from_seconds, to_seconds};

struct Connection {
    runtime: Runtime,
    store: TcpStore,
}

/// Operations on one object are serialized, as torch's client does; use `duplicate()` for
/// concurrency.
#[pyclass(module = "elastix._core", frozen)]
pub struct TcpStoreCore {
    /// None only once dropped.
    connection: Mutex<Option<Connection>>,
    pending: PendingSignal,
    host: String,
    port: u16,
    is_server: bool,
    local_addr: String,
    remote_addr: String,
}

/// The connection, locked (it is present until the object is dropped).
struct Locked<'a>(MutexGuard<'a, Option<Connection>>);

impl Deref for Locked<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        self.0.as_ref().expect("present until dropped")
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Connection {
        self.0.as_mut().expect("present until dropped")
    }
}

impl Drop for TcpStoreCore {
    fn drop(&mut self) {
        // a master's server stops its threads here; they may be waiting for the GIL
        let connection = self.connection.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        drop_without_gil(connection);
    }
}

impl TcpStoreCore {
    fn lock(&self) -> Locked<'_> {
        Locked(self.connection.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn wrap(runtime: Runtime, mut store: TcpStore, pending: PendingSignal) -> Self {
        store.set_interrupt(pending.interrupt());
        let client = store.client();
        TcpStoreCore {
            host: store.host().to_owned(),
            port: store.port(),
            is_server: store.is_server(),
            local_addr: client.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            remote_addr: client.remote_addr().to_string(),
            connection: Mutex::new(Some(Connection { runtime, store })),
            pending,
        }
    }

    /// Runs `op` on this object's connection with the GIL released.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        op: impl AsyncFnOnce(&mut TcpStore) -> StoreResult<T> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let mut connection = self.lock();
            let Connection { runtime, store } = &mut *connection;
            runtime.block_on(op(store))
        })
        .map_err(|err| to_py(err, &self.pending))
    }
}

fn new_runtime() -> PyResult<Runtime> {
    Ok(runtimes::calling_thread()?)
}

fn bytes_list<'py>(py: Python<'py>, values: Vec<bytes::Bytes>) -> Vec<Bound<'py, PyBytes>> {
    values.iter().map(|value| PyBytes::new(py, value)).collect()
}

fn as_slices(keys: &[Vec<u8>]) -> Vec<&[u8]> {
    keys.iter().map(Vec::as_slice).collect()
}

#[pymethods]
impl TcpStoreCore {
    /// Connects (and, for a master, starts the server first). `timeout` is in seconds; `None`
    /// or negative means no limit.
    #[new]
    #[pyo3(signature = (host, port, world_size=None, is_master=false, timeout=Some(300.0),
        wait_for_workers=true, multi_tenant=false, listen_fd=None, client_if_port_taken=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        host: String,
        port: u16,
        world_size: Option<u32>,
        is_master: bool,
        timeout: Option<f64>,
        wait_for_workers: bool,
        multi_tenant: bool,
        listen_fd: Option<i32>,
        client_if_port_taken: bool,
    ) -> PyResult<Self> {
        // the environment as it is now (ELASTIX_AUTH_TOKEN_FILE): an unusable secret file is
        // this call's error, not a silent connection without it
        let secret = elastix_core::auth::Secret::from_env()
            .map_err(|err| pyo3::exceptions::PyPermissionError::new_err(err.to_string()))?;
        // A descriptor of our own: the caller's stays theirs to close.
        let listen_fd = listen_fd
            .map(duplicate_socket_fd)
            .transpose()
            .map_err(|err| pyo3::exceptions::PyValueError::new_err(format!("master_listen_fd: {err}")))?
            .map(Arc::new);
        let options = TcpStoreOptions {
            world_size,
            is_master,
            timeout: from_seconds(timeout)?,
            wait_for_workers,
            multi_tenant,
            listen_fd,
            client_if_port_taken,
            secret,
            ..TcpStoreOptions::new(host, port)
        };
        let runtime = new_runtime()?;
        let pending = PendingSignal::default();
        let store = py.detach(|| runtime.block_on(TcpStore::open(options))).map_err(|err| to_py(err, &pending))?;
        Ok(TcpStoreCore::wrap(runtime, store, pending))
    }

    /// A new connection to the same server (never counted into `init/`).
    fn duplicate(&self, py: Python<'_>) -> PyResult<Self> {
        // The copy's socket must belong to the copy's own runtime.
        let runtime = new_runtime()?;
        let pending = PendingSignal::default();
        let store = py
            .detach(|| {
                let connection = self.lock();
                runtime.block_on(connection.store.duplicate())
            })
            .map_err(|err| to_py(err, &pending))?;
        Ok(TcpStoreCore::wrap(runtime, store, pending))
    }

    #[getter]
    fn host(&self) -> &str {
        &self.host
    }

    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    #[getter]
    fn is_server(&self) -> bool {
        self.is_server
    }

    #[getter]
    fn local_addr(&self) -> &str {
        &self.local_addr
    }

    #[getter]
    fn remote_addr(&self) -> &str {
        &self.remote_addr
    }

    /// The store timeout in seconds (`None`: no limit).
    #[getter]
    fn timeout(&self) -> Option<f64> {
        let connection = self.lock();
        to_seconds(connection.store.timeout())
    }

    #[pyo3(signature = (timeout))]
    fn set_timeout(&self, timeout: Option<f64>) -> PyResult<()> {
        let timeout = from_seconds(timeout)?;
        self.lock().store.set_timeout(timeout);
        Ok(())
    }

    fn set(&self, py: Python<'_>, key: &[u8], value: &[u8]) -> PyResult<()> {
        self.call(py, async |store| store.set(key, value).await)
    }

    fn get<'py>(&self, py: Python<'py>, key: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let value = self.call(py, async |store| store.get(key).await)?;
        Ok(PyBytes::new(py, &value))
    }

    fn add(&self, py: Python<'_>, key: &[u8], amount: i64) -> PyResult<i64> {
        self.call(py, async |store| store.add(key, amount).await)
    }

    fn compare_set<'py>(
        &self,
        py: Python<'py>,
        key: &[u8],
        expected: &[u8],
        desired: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let value = self.call(py, async |store| store.compare_set(key, expected, desired).await)?;
        Ok(PyBytes::new(py, &value))
    }

    fn check(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<bool> {
        self.call(py, async |store| store.check(&as_slices(&keys)).await)
    }

    /// Waits for every key, up to `timeout` seconds (`None`/negative: no limit).
    #[pyo3(signature = (keys, timeout))]
    fn wait(&self, py: Python<'_>, keys: Vec<Vec<u8>>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = from_seconds(timeout)?;
        self.call(py, async |store| store.wait(&as_slices(&keys), timeout).await)
    }

    fn delete_key(&self, py: Python<'_>, key: &[u8]) -> PyResult<bool> {
        self.call(py, async |store| store.delete_key(key).await)
    }

    fn num_keys(&self, py: Python<'_>) -> PyResult<i64> {
        self.call(py, async |store| store.num_keys().await)
    }

    fn append(&self, py: Python<'_>, key: &[u8], value: &[u8]) -> PyResult<()> {
        self.call(py, async |store| store.append(key, value).await)
    }

    fn multi_get<'py>(&self, py: Python<'py>, keys: Vec<Vec<u8>>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let values = self.call(py, async |store| store.multi_get(&as_slices(&keys)).await)?;
        Ok(bytes_list(py, values))
    }

    fn multi_set(&self, py: Python<'_>, keys: Vec<Vec<u8>>, values: Vec<Vec<u8>>) -> PyResult<()> {
        self.call(py, async |store| store.multi_set(&as_slices(&keys), &as_slices(&values)).await)
    }

    fn queue_push(&self, py: Python<'_>, key: &[u8], value: &[u8]) -> PyResult<()> {
        self.call(py, async |store| store.queue_push(key, value).await)
    }

    fn queue_pop<'py>(&self, py: Python<'py>, key: &[u8], block: bool) -> PyResult<Bound<'py, PyBytes>> {
        let value = self.call(py, async |store| store.queue_pop(key, block).await)?;
        Ok(PyBytes::new(py, &value))
    }

    fn queue_len(&self, py: Python<'_>, key: &[u8]) -> PyResult<i64> {
        self.call(py, async |store| store.queue_len(key).await)
    }

    /// User keys (without the `/` prefix; `init/` hidden).
    fn list_keys<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let keys = self.call(py, async |store| store.list_keys().await)?;
        Ok(bytes_list(py, keys))
    }

    #[pyo3(signature = (key, world_size, timeout))]
    fn barrier(&self, py: Python<'_>, key: &[u8], world_size: i64, timeout: Option<f64>) -> PyResult<()> {
        let timeout = from_seconds(timeout)?;
        self.call(py, async |store| store.barrier(key, world_size, timeout).await)
    }

    /// A PING round trip (a liveness check).
    fn ping(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, async |store| store.ping().await)
    }
}
