//! Peer authentication for Python: the job secret (loaded and checked by the core's one loader),
//! the keys derived from it, the pair handshake's two sides without I/O (the collectives' TCP
//! listener drives them from its own event loop), the session each handshake leaves, and the
//! lobby of unproven connections.

use std::net::IpAddr;
use std::sync::Mutex;

use bytes::BytesMut;
use elastix_core::auth::pair::{self, Acceptor, Connector, Purpose, CHALLENGE_LEN, PROOF_LEN, VERDICT_LEN};
use elastix_core::auth::session::{Mode, OpenError, Opener, Sealer, Session, OVERHEAD};
use elastix_core::auth::{DoorLimits, HandshakeError, Key, Lobby, Secret};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyConnectionResetError, PyPermissionError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

pyo3::create_exception!(
    _core,
    AuthRefused,
    pyo3::exceptions::PyException,
    "The peer and this process verifiably hold different keys: no retry can help."
);

/// The job secret. Never shown: its repr names where it came from.
#[pyclass(module = "elastix._core", frozen)]
pub struct JobSecret(pub Secret);

#[pymethods]
impl JobSecret {
    fn __repr__(&self) -> String {
        format!("JobSecret(from {:?})", self.0.source())
    }
}

/// A key peers prove they hold. Never shown.
#[pyclass(module = "elastix._core", frozen)]
pub struct PeerKey(pub Key);

#[pymethods]
impl PeerKey {
    fn __repr__(&self) -> String {
        format!("{:?}", self.0)
    }
}

/// The secret the environment names (ELASTIX_AUTH_TOKEN_FILE, else ELASTIX_AUTH_TOKEN), checked;
/// None without one. An unusable or weak secret raises PermissionError with the reason.
#[pyfunction]
fn load_job_secret() -> PyResult<Option<JobSecret>> {
    Secret::from_env().map(|secret| secret.map(JobSecret)).map_err(|err| PyPermissionError::new_err(err.to_string()))
}

/// Writes a new strong job secret to `path` (which must not exist), readable by its owner only.
#[pyfunction]
fn write_job_secret(path: std::path::PathBuf) -> PyResult<()> {
    elastix_core::auth::secret::write_new(&path).map_err(|err| PyValueError::new_err(err.to_string()))
}

/// A group's key for one round (see the core's `Key::group`).
#[pyfunction]
#[pyo3(signature = (secret, label, nonce))]
fn group_key(secret: Option<&JobSecret>, label: &[u8], nonce: &[u8]) -> PeerKey {
    PeerKey(Key::group(secret.map(|secret| &secret.0), label, nonce))
}

fn purpose(name: &str) -> PyResult<&'static Purpose> {
    match name {
        "store" => Ok(&pair::STORE),
        "rpc" => Ok(&pair::RPC),
        "collectives" => Ok(&pair::COLLECTIVES),
        other => Err(PyValueError::new_err(format!("no handshake purpose {other:?}"))),
    }
}

/// (hello, challenge, proof, verdict) sizes of a purpose's handshake, in bytes.
#[pyfunction]
fn pair_sizes(name: &str) -> PyResult<(usize, usize, usize, usize)> {
    Ok((purpose(name)?.hello_len(), CHALLENGE_LEN, PROOF_LEN, VERDICT_LEN))
}

fn handshake_error(err: HandshakeError) -> PyErr {
    if err.is_final() {
        AuthRefused::new_err(err.to_string())
    } else {
        PyConnectionResetError::new_err(err.to_string())
    }
}

fn exact<const N: usize>(bytes: &[u8], what: &str) -> PyResult<[u8; N]> {
    bytes.try_into().map_err(|_| PyValueError::new_err(format!("a handshake {what} is {N} bytes, not {}", bytes.len())))
}

/// The connecting side: send `hello`, answer the challenge with `on_challenge`'s proof, then
/// check the verdict (`on_verdict`). AuthRefused: the peer verifiably holds another key;
/// ConnectionResetError: anything else (worth another try).
#[pyclass(module = "elastix._core")]
pub struct PairConnector {
    inner: Connector,
    hello: Vec<u8>,
}

#[pymethods]
impl PairConnector {
    #[new]
    fn new(key: &PeerKey, purpose_name: &str, binding: &[u8]) -> PyResult<Self> {
        let purpose = purpose(purpose_name)?;
        if binding.len() != purpose.binding_len {
            return Err(PyValueError::new_err(format!(
                "a {purpose_name} handshake binds {} bytes, not {}",
                purpose.binding_len,
                binding.len()
            )));
        }
        let (inner, hello) = Connector::new(&key.0, purpose, binding, Mode::wanted());
        Ok(PairConnector { inner, hello })
    }

    #[getter]
    fn hello<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.hello)
    }

    fn on_challenge<'py>(&mut self, py: Python<'py>, challenge: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let proof = self.inner.on_challenge(&exact(challenge, "challenge")?).map_err(handshake_error)?;
        Ok(PyBytes::new(py, &proof))
    }

    fn on_verdict(&self, verdict: &[u8]) -> PyResult<()> {
        self.inner.on_verdict(&exact(verdict, "verdict")?).map_err(handshake_error)
    }

    /// The session the connection goes on in, once the challenge is answered.
    fn session(&self) -> PyResult<SessionChannel> {
        self.inner.session().map(SessionChannel::new).ok_or_else(|| PyValueError::new_err("no challenge answered yet"))
    }
}

/// The accepting side: `on_hello` gives the claimed binding (for the caller to check) and the
/// challenge to send; `on_proof` gives the verdict to send and, for a wrong proof, why.
#[pyclass(module = "elastix._core")]
pub struct PairAcceptor(Acceptor);

#[pymethods]
impl PairAcceptor {
    #[new]
    fn new(key: &PeerKey, purpose_name: &str) -> PyResult<Self> {
        Ok(PairAcceptor(Acceptor::new(&key.0, purpose(purpose_name)?, Mode::wanted())))
    }

    fn on_hello<'py>(&mut self, py: Python<'py>, hello: &[u8]) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let (binding, challenge) = self.0.on_hello(hello).map_err(handshake_error)?;
        Ok((PyBytes::new(py, &binding), PyBytes::new(py, &challenge)))
    }

    /// The session the connection goes on in, once the connector proved the key.
    fn session(&self) -> PyResult<SessionChannel> {
        self.0.session().map(SessionChannel::new).ok_or_else(|| PyValueError::new_err("the key is not proven yet"))
    }

    fn on_proof<'py>(&mut self, py: Python<'py>, proof: &[u8]) -> PyResult<(Bound<'py, PyBytes>, Option<String>)> {
        Ok(match self.0.on_proof(&exact(proof, "proof")?) {
            Ok(verdict) => (PyBytes::new(py, &verdict), None),
            Err((refusal, why)) => (PyBytes::new(py, &refusal), Some(why.to_string())),
        })
    }
}

/// A connection's session after its handshake: `seal` makes what is sent into records, `open`
/// takes one whole record back (ValueError: it does not verify, and the connection is done).
#[pyclass(module = "elastix._core", frozen)]
pub struct SessionChannel {
    encrypted: bool,
    sealer: Mutex<Sealer>,
    opener: Mutex<Opener>,
}

/// Payloads this large are sealed or opened without the GIL.
const DETACH_BYTES: usize = 64 * 1024;

impl SessionChannel {
    fn new(session: Session) -> SessionChannel {
        let encrypted = session.mode == Mode::Encrypted;
        let (sealer, opener) = session.split();
        SessionChannel { encrypted, sealer: Mutex::new(sealer), opener: Mutex::new(opener) }
    }
}

fn locked<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[pymethods]
impl SessionChannel {
    /// Whether the records are encrypted (else in the clear, authenticated).
    #[getter]
    fn encrypted(&self) -> bool {
        self.encrypted
    }

    /// `data` (any buffer of bytes) as sealed records (one per 64 KiB), in order.
    fn seal<'py>(&self, py: Python<'py>, data: PyBuffer<u8>) -> PyResult<Bound<'py, PyBytes>> {
        // copied while the GIL is held: nobody changes it while it is sealed without the GIL
        let data = data.to_vec(py)?;
        let mut out = BytesMut::with_capacity(data.len() + OVERHEAD);
        let mut seal = || locked(&self.sealer).seal(&data, &mut out);
        if data.len() >= DETACH_BYTES {
            py.detach(seal);
        } else {
            seal();
        }
        Ok(PyBytes::new(py, &out))
    }

    /// The payloads of `records` (any buffer of bytes), which must be whole records only, one
    /// after another.
    fn open<'py>(&self, py: Python<'py>, records: PyBuffer<u8>) -> PyResult<Bound<'py, PyBytes>> {
        let mut raw = BytesMut::from(&records.to_vec(py)?[..]);
        let mut out = BytesMut::with_capacity(raw.len());
        let large = raw.len() >= DETACH_BYTES;
        let mut open = || {
            let mut opener = locked(&self.opener);
            while !raw.is_empty() {
                if !opener.open(&mut raw, &mut out)? {
                    return Ok(false);
                }
            }
            Ok(true)
        };
        let opened: Result<bool, OpenError> = if large { py.detach(open) } else { open() };
        match opened {
            Ok(true) => Ok(PyBytes::new(py, &out)),
            Ok(false) => Err(PyValueError::new_err("not whole sealed records: one is cut short")),
            Err(err) => Err(PyValueError::new_err(err.to_string())),
        }
    }
}

/// Connections waiting to prove themselves: at most `per_source` per address and `total` in
/// all; `arrive` returns the new one's ticket and the tokens of those shed to make room.
#[pyclass(module = "elastix._core", frozen)]
pub struct ConnectionLobby(Mutex<Lobby<i64>>);

#[pymethods]
impl ConnectionLobby {
    #[new]
    #[pyo3(signature = (per_source=None, total=None))]
    fn new(per_source: Option<usize>, total: Option<usize>) -> Self {
        let defaults = DoorLimits::default();
        let limits = DoorLimits {
            per_source: per_source.unwrap_or(defaults.per_source),
            total: total.unwrap_or(defaults.total),
        };
        ConnectionLobby(Mutex::new(Lobby::new(limits)))
    }

    fn arrive(&self, ip: &str, token: i64) -> PyResult<(u64, Vec<i64>)> {
        let ip: IpAddr = ip.parse().map_err(|_| PyValueError::new_err(format!("not an IP address: {ip:?}")))?;
        Ok(self.lobby().arrive(ip, token))
    }

    fn leave(&self, ticket: u64) -> Option<i64> {
        self.lobby().leave(ticket)
    }

    fn shed_oldest(&self) -> Option<i64> {
        self.lobby().shed_oldest()
    }

    #[getter]
    fn waiting(&self) -> usize {
        self.lobby().waiting()
    }
}

impl ConnectionLobby {
    fn lobby(&self) -> std::sync::MutexGuard<'_, Lobby<i64>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

pub fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add("AuthRefused", module.py().get_type::<AuthRefused>())?;
    module.add("HANDSHAKE_DEADLINE", elastix_core::auth::HANDSHAKE_DEADLINE.as_secs_f64())?;
    module.add_class::<JobSecret>()?;
    module.add_class::<PeerKey>()?;
    module.add_class::<PairConnector>()?;
    module.add_class::<PairAcceptor>()?;
    module.add_class::<SessionChannel>()?;
    module.add("SESSION_OVERHEAD", OVERHEAD)?;
    module.add("SESSION_MAX_RECORD", elastix_core::auth::session::MAX_RECORD)?;
    module.add_class::<ConnectionLobby>()?;
    module.add_function(wrap_pyfunction!(load_job_secret, module)?)?;
    module.add_function(wrap_pyfunction!(write_job_secret, module)?)?;
    module.add_function(wrap_pyfunction!(group_key, module)?)?;
    module.add_function(wrap_pyfunction!(pair_sizes, module)?)?;
    Ok(())
}
