//! `StoreCore`: one handle on a store of any kind (a TCPStore connection, torch's HashStore or
//! FileStore), each a core [`BlockingStore`] driven on the calling thread with the GIL
//! released. The handle keeps the timeout its waits default to; a TCPStore has a few extras
//! (its address, a barrier, a ping).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use elastix_core::interrupt::Interrupt;
use elastix_core::store::error::Result as StoreResult;
use elastix_core::store::server::listener::duplicate_socket_fd;
use elastix_core::store::{BlockingStore, BlockingTcpStore, FileStore, LocalStore, StoreError, TcpStoreOptions};
use pyo3::exceptions::{PyPermissionError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::to_py;
use crate::exit_gate::drop_without_gil;
use crate::interrupt::PendingSignal;
use crate::timeout::{from_seconds, to_seconds};

/// Operations on one handle are serialized for a TCPStore, as torch's client does; use
/// `duplicate()` for concurrency.
#[pyclass(module = "elastix._core", frozen)]
pub struct StoreCore {
    /// `None` only once dropped.
    store: Option<Arc<dyn BlockingStore>>,
    /// The same store, when it is a TCPStore connection.
    tcp: Option<Arc<BlockingTcpStore>>,
    timeout: Mutex<Option<Duration>>,
    pending: PendingSignal,
}

impl Drop for StoreCore {
    fn drop(&mut self) {
        // a master's server stops its threads here; they may be waiting for the GIL
        drop_without_gil((self.store.take(), self.tcp.take()));
    }
}

impl StoreCore {
    fn new(store: Arc<dyn BlockingStore>, tcp: Option<Arc<BlockingTcpStore>>, timeout: Option<Duration>) -> Self {
        StoreCore { store: Some(store), tcp, timeout: Mutex::new(timeout), pending: PendingSignal::default() }
    }

    fn from_tcp(store: BlockingTcpStore, timeout: Option<Duration>) -> Self {
        let store = Arc::new(store);
        StoreCore::new(store.clone(), Some(store), timeout)
    }

    fn current_timeout(&self) -> Option<Duration> {
        *self.timeout.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `op` with the GIL released; `op` gets the interrupt that lets Ctrl-C end a wait.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        op: impl FnOnce(&dyn BlockingStore, &Interrupt) -> StoreResult<T> + Send,
    ) -> PyResult<T> {
        let store = self.store.as_deref().expect("present until dropped");
        let interrupt = self.pending.interrupt();
        py.detach(|| op(store, &interrupt)).map_err(|err| to_py(err, &self.pending))
    }

    fn tcp(&self, what: &str) -> PyResult<&BlockingTcpStore> {
        self.tcp.as_deref().ok_or_else(|| PyTypeError::new_err(format!("{what}: only a TCPStore has one")))
    }
}

fn as_slices(keys: &[Vec<u8>]) -> Vec<&[u8]> {
    keys.iter().map(Vec::as_slice).collect()
}

fn bytes_list<'py>(py: Python<'py>, values: &[bytes::Bytes]) -> Vec<Bound<'py, PyBytes>> {
    values.iter().map(|value| PyBytes::new(py, value)).collect()
}

#[pymethods]
impl StoreCore {
    /// A TCPStore connection (a master starts the server first). `timeout` is in seconds;
    /// `None` or negative means no limit.
    #[new]
    #[pyo3(signature = (host, port, world_size=None, is_master=false, timeout=Some(300.0),
        wait_for_workers=true, multi_tenant=false, listen_fd=None, client_if_port_taken=false))]
    #[allow(clippy::too_many_arguments)]
    fn tcp_store(
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
        let secret =
            elastix_core::auth::Secret::from_env().map_err(|err| PyPermissionError::new_err(err.to_string()))?;
        // A descriptor of our own: the caller's stays theirs to close.
        let listen_fd = listen_fd
            .map(duplicate_socket_fd)
            .transpose()
            .map_err(|err| PyValueError::new_err(format!("master_listen_fd: {err}")))?
            .map(Arc::new);
        let timeout = from_seconds(timeout)?;
        let options = TcpStoreOptions {
            world_size,
            is_master,
            timeout,
            wait_for_workers,
            multi_tenant,
            listen_fd,
            client_if_port_taken,
            secret,
            ..TcpStoreOptions::new(host, port)
        };
        let pending = PendingSignal::default();
        let store = py.detach(|| BlockingTcpStore::open(options)).map_err(|err| to_py(err, &pending))?;
        Ok(StoreCore::from_tcp(store, timeout))
    }

    /// A new, empty in-process store (torch's HashStore).
    #[staticmethod]
    #[pyo3(signature = (timeout))]
    fn local(timeout: Option<f64>) -> PyResult<Self> {
        Ok(StoreCore::new(Arc::new(LocalStore::new()), None, from_seconds(timeout)?))
    }

    /// A handle on the store in the file at `path` (created if missing), in torch's FileStore
    /// format. Once `world_size` handles have been dropped and none is open, the file is deleted.
    #[staticmethod]
    #[pyo3(signature = (path, world_size, timeout))]
    fn file(py: Python<'_>, path: PathBuf, world_size: Option<u32>, timeout: Option<f64>) -> PyResult<Self> {
        let timeout = from_seconds(timeout)?;
        let pending = PendingSignal::default();
        let store = py.detach(|| FileStore::open(path, world_size)).map_err(|err| to_py(err, &pending))?;
        Ok(StoreCore::new(Arc::new(store), None, timeout))
    }

    /// Another handle on the same store, with the same timeout: a TCPStore's is a new
    /// connection (never counted into `init/`); the others share the data.
    fn duplicate(&self, py: Python<'_>) -> PyResult<Self> {
        let timeout = self.current_timeout();
        match &self.tcp {
            Some(tcp) => {
                let store = py.detach(|| tcp.duplicate()).map_err(|err| to_py(err, &self.pending))?;
                Ok(StoreCore::from_tcp(store, timeout))
            }
            None => Ok(StoreCore::new(self.store.clone().expect("present until dropped"), None, timeout)),
        }
    }

    /// The bound of this handle's waits (seconds; `None`: no limit), and of every reply of a
    /// TCPStore's.
    #[getter]
    fn timeout(&self) -> Option<f64> {
        to_seconds(self.current_timeout())
    }

    #[pyo3(signature = (timeout))]
    fn set_timeout(&self, timeout: Option<f64>) -> PyResult<()> {
        let timeout = from_seconds(timeout)?;
        *self.timeout.lock().unwrap_or_else(PoisonError::into_inner) = timeout;
        if let Some(tcp) = &self.tcp {
            tcp.set_timeout(timeout);
        }
        Ok(())
    }

    #[getter]
    fn host(&self) -> PyResult<String> {
        Ok(self.tcp("host")?.host().to_owned())
    }

    #[getter]
    fn port(&self) -> PyResult<u16> {
        Ok(self.tcp("port")?.port())
    }

    #[getter]
    fn is_server(&self) -> PyResult<bool> {
        Ok(self.tcp("is_server")?.is_server())
    }

    #[getter]
    fn local_addr(&self) -> PyResult<String> {
        Ok(self.tcp("local_addr")?.local_addr().to_owned())
    }

    #[getter]
    fn remote_addr(&self) -> PyResult<String> {
        Ok(self.tcp("remote_addr")?.remote_addr().to_owned())
    }

    fn set(&self, py: Python<'_>, key: &[u8], value: &[u8]) -> PyResult<()> {
        self.call(py, |store, _| store.set(key, value))
    }

    /// Waits for `key` (up to this handle's timeout), then reads it.
    fn get<'py>(&self, py: Python<'py>, key: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let timeout = self.current_timeout();
        let value = self.call(py, |store, interrupt| store.get(key, timeout, interrupt))?;
        Ok(PyBytes::new(py, &value))
    }

    fn add(&self, py: Python<'_>, key: &[u8], amount: i64) -> PyResult<i64> {
        self.call(py, |store, _| store.add(key, amount))
    }

    fn compare_set<'py>(
        &self,
        py: Python<'py>,
        key: &[u8],
        expected: &[u8],
        desired: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let value = self.call(py, |store, _| store.compare_set(key, expected, desired))?;
        Ok(PyBytes::new(py, &value))
    }

    fn check(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<bool> {
        self.call(py, |store, _| store.check(&as_slices(&keys)))
    }

    /// Waits for every key, up to `timeout` seconds (`None`/negative: no limit).
    #[pyo3(signature = (keys, timeout))]
    fn wait(&self, py: Python<'_>, keys: Vec<Vec<u8>>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = from_seconds(timeout)?;
        self.call(py, |store, interrupt| store.wait(&as_slices(&keys), timeout, interrupt))
    }

    fn delete_key(&self, py: Python<'_>, key: &[u8]) -> PyResult<bool> {
        self.call(py, |store, _| store.delete_key(key))
    }

    fn num_keys(&self, py: Python<'_>) -> PyResult<i64> {
        self.call(py, |store, _| store.num_keys())
    }

    fn append(&self, py: Python<'_>, key: &[u8], value: &[u8]) -> PyResult<()> {
        self.call(py, |store, _| store.append(key, value))
    }

    /// Waits for every key (up to this handle's timeout), then reads them all.
    fn multi_get<'py>(&self, py: Python<'py>, keys: Vec<Vec<u8>>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let timeout = self.current_timeout();
        let values = self.call(py, |store, interrupt| store.multi_get(&as_slices(&keys), timeout, interrupt))?;
        Ok(bytes_list(py, &values))
    }

    fn multi_set(&self, py: Python<'_>, keys: Vec<Vec<u8>>, values: Vec<Vec<u8>>) -> PyResult<()> {
        if keys.len() != values.len() {
            let message = format!(
                "multi_set got {} keys but {} values; they must be of the same length",
                keys.len(),
                values.len()
            );
            return Err(to_py(StoreError::InvalidArgument(message), &self.pending));
        }
        let pairs: Vec<(&[u8], &[u8])> = keys.iter().map(Vec::as_slice).zip(values.iter().map(Vec::as_slice)).collect();
        self.call(py, |store, _| store.multi_set(&pairs))
    }

    fn queue_push(&self, py: Python<'_>, key: &[u8], value: &[u8]) -> PyResult<()> {
        self.call(py, |store, _| store.queue_push(key, value))
    }

    /// Pops the oldest item; a blocking pop waits for one up to this handle's timeout.
    fn queue_pop<'py>(&self, py: Python<'py>, key: &[u8], block: bool) -> PyResult<Bound<'py, PyBytes>> {
        let timeout = self.current_timeout();
        let value = self.call(py, |store, interrupt| store.queue_pop(key, block, timeout, interrupt))?;
        Ok(PyBytes::new(py, &value))
    }

    fn queue_len(&self, py: Python<'_>, key: &[u8]) -> PyResult<i64> {
        self.call(py, |store, _| store.queue_len(key))
    }

    /// User keys (a TCPStore's without their `/` prefix, `init/` hidden).
    fn list_keys<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let keys = self.call(py, |store, _| store.list_keys())?;
        Ok(bytes_list(py, &keys))
    }

    /// A TCPStore's server-side barrier: blocks until `world_size` parties reached `key`.
    #[pyo3(signature = (key, world_size, timeout))]
    fn barrier(&self, py: Python<'_>, key: &[u8], world_size: i64, timeout: Option<f64>) -> PyResult<()> {
        let (tcp, timeout) = (self.tcp("barrier")?, from_seconds(timeout)?);
        let interrupt = self.pending.interrupt();
        py.detach(|| tcp.barrier(key, world_size, timeout, &interrupt)).map_err(|err| to_py(err, &self.pending))
    }

    /// A TCPStore's PING round trip (a liveness check).
    fn ping(&self, py: Python<'_>) -> PyResult<()> {
        let tcp = self.tcp("ping")?;
        py.detach(|| tcp.ping()).map_err(|err| to_py(err, &self.pending))
    }
}
