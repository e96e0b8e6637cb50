//! `BlockingStoreCore`: the in-process store (torch's HashStore) and the file-backed store
//! (torch's FileStore) behind one class, since both are a [`BlockingStore`].

use std::path::PathBuf;
use std::sync::Arc;

use elastix_core::interrupt::Interrupt;
use elastix_core::store::error::Result as StoreResult;
use elastix_core::store::{BlockingStore, FileStore, LocalStore};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::to_py;
use crate::interrupt::PendingSignal;
use crate::timeout::from_seconds;

#[pyclass(module = "elastix._core", frozen)]
pub struct BlockingStoreCore {
    store: Arc<dyn BlockingStore>,
    pending: PendingSignal,
}

impl BlockingStoreCore {
    /// Runs `op` with the GIL released; `op` gets the interrupt check that lets Ctrl-C end a
    /// wait.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        op: impl FnOnce(&dyn BlockingStore, &Interrupt) -> StoreResult<T> + Send,
    ) -> PyResult<T> {
        let pending = &self.pending;
        py.detach(|| op(self.store.as_ref(), &pending.interrupt())).map_err(|err| to_py(err, &self.pending))
    }
}

fn as_slices(keys: &[Vec<u8>]) -> Vec<&[u8]> {
    keys.iter().map(Vec::as_slice).collect()
}

#[pymethods]
impl BlockingStoreCore {
    /// A new, empty in-process store.
    #[staticmethod]
    fn local() -> Self {
        BlockingStoreCore { store: Arc::new(LocalStore::new()), pending: PendingSignal::default() }
    }

    /// A handle on the store in the file at `path` (created if missing), in torch's FileStore
    /// format. Once `world_size` handles have been dropped and none is open, the file is deleted.
    #[staticmethod]
    #[pyo3(signature = (path, world_size=None))]
    fn file(py: Python<'_>, path: PathBuf, world_size: Option<u32>) -> PyResult<Self> {
        let pending = PendingSignal::default();
        let store = py.detach(|| FileStore::open(path, world_size)).map_err(|err| to_py(err, &pending))?;
        Ok(BlockingStoreCore { store: Arc::new(store), pending })
    }

    /// Another handle on the same store (it shares the data).
    fn share(&self) -> Self {
        BlockingStoreCore { store: self.store.clone(), pending: PendingSignal::default() }
    }

    fn set(&self, py: Python<'_>, key: &[u8], value: &[u8]) -> PyResult<()> {
        self.call(py, |store, _| store.set(key, value))
    }

    #[pyo3(signature = (key, timeout))]
    fn get<'py>(&self, py: Python<'py>, key: &[u8], timeout: Option<f64>) -> PyResult<Bound<'py, PyBytes>> {
        let timeout = from_seconds(timeout)?;
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

    #[pyo3(signature = (keys, timeout))]
    fn multi_get<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<Vec<u8>>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let timeout = from_seconds(timeout)?;
        let values = self.call(py, |store, interrupt| store.multi_get(&as_slices(&keys), timeout, interrupt))?;
        Ok(values.iter().map(|value| PyBytes::new(py, value)).collect())
    }

    fn multi_set(&self, py: Python<'_>, keys: Vec<Vec<u8>>, values: Vec<Vec<u8>>) -> PyResult<()> {
        let pairs: Vec<(&[u8], &[u8])> = keys.iter().map(Vec::as_slice).zip(values.iter().map(Vec::as_slice)).collect();
        self.call(py, |store, _| store.multi_set(&pairs))
    }

    fn queue_push(&self, py: Python<'_>, key: &[u8], value: &[u8]) -> PyResult<()> {
        self.call(py, |store, _| store.queue_push(key, value))
    }

    #[pyo3(signature = (key, block, timeout))]
    fn queue_pop<'py>(
        &self,
        py: Python<'py>,
        key: &[u8],
        block: bool,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let timeout = from_seconds(timeout)?;
        let value = self.call(py, |store, interrupt| store.queue_pop(key, block, timeout, interrupt))?;
        Ok(PyBytes::new(py, &value))
    }

    fn queue_len(&self, py: Python<'_>, key: &[u8]) -> PyResult<i64> {
        self.call(py, |store, _| store.queue_len(key))
    }

    fn list_keys<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let keys = self.call(py, |store, _| store.list_keys())?;
        Ok(keys.iter().map(|key| PyBytes::new(py, key)).collect())
    }
}
