//! The store server: connections accepted on a thread of their own ([`acceptor`]) and admitted
//! by a tokio task with a connection limit, one task per connection,
//! all of them sharing one [`Db`] behind a mutex (every operation is short, and one lock makes
//! the store linearizable like torch's single-threaded servers), and a graceful shutdown.

mod acceptor;
mod admission;
pub mod any;
mod connection;
pub mod listener;
pub mod port_holder;
mod shutdown;
pub mod uring;

use std::io;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::runtime::Runtime;
use tokio::sync::mpsc;

use self::acceptor::{Accepted, Acceptor};
use self::admission::Admission;
pub use self::any::{AnyServer, Io};
use self::connection::Connection;
use self::shutdown::{Shutdown, Stop};
use super::counter::parse_counter;
use super::execute::Db;
use super::limits::Limits;
use crate::address_log::{AddressLog, Throttled};
use crate::auth::{Admitted, Gate, PlainClients, Secret};
use crate::store::transport::Transport;
use crate::store::waiters::Waker;

/// How to run a server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to listen on; `None` means every address, IPv6 and IPv4.
    pub host: Option<String>,
    /// Port to listen on; 0 lets the kernel pick a free one (read it back with `port()`).
    pub port: u16,
    /// An already bound socket to listen on instead (torch's `master_listen_fd`); see
    /// [`listener::duplicate_socket_fd`]. Shared, because configurations are cloned.
    pub listen_fd: Option<Arc<OwnedFd>>,
    pub limits: Limits,
    /// Connections served at once; further clients are refused (closed at once).
    pub max_connections: usize,
    /// Closes a connection that sent nothing for this long while holding no wait. `None`
    /// (the default): never, as torch's clients stay connected and idle for hours.
    pub idle_timeout: Option<Duration>,
    /// With a job secret, clients must prove it (plain clients only as the policy allows).
    /// Default: none (a server without a secret serves every client).
    pub auth: Option<(Secret, PlainClients)>,
}

impl ServerConfig {
    /// The defaults, for a server its clients reach at `addr`: one reached at a loopback
    /// address listens there alone (nobody off this machine can connect).
    pub fn for_address(addr: &str) -> ServerConfig {
        let loopback = listener::is_loopback_name(addr);
        ServerConfig { host: loopback.then(|| addr.to_owned()), ..ServerConfig::default() }
    }

    /// Requires `secret` (if given) of clients, admitting plain ones as `plain` allows.
    pub fn requiring(self, secret: Option<&Secret>, plain: PlainClients) -> ServerConfig {
        ServerConfig { auth: secret.map(|secret| (secret.clone(), plain)), ..self }
    }

    /// Most connections served by default, however many descriptors the process may open.
    pub const MOST_CONNECTIONS: usize = 65_536;
    /// Descriptors kept for everything else the process opens (files, its own clients).
    const OTHER_DESCRIPTORS: u64 = 64;

    /// The default cap: what the open-file limit allows, less room for everything else, so
    /// that the cap refuses clients before the kernel (EMFILE) does.
    pub fn default_max_connections() -> usize {
        let limit = listener::open_file_limit().unwrap_or(1024);
        let room = limit.saturating_sub(Self::OTHER_DESCRIPTORS).max(1);
        usize::try_from(room).unwrap_or(usize::MAX).min(Self::MOST_CONNECTIONS)
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: None,
            port: 0,
            listen_fd: None,
            limits: Limits::default(),
            max_connections: Self::default_max_connections(),
            idle_timeout: None,
            auth: None,
        }
    }
}

/// Lets plain clients from given addresses in, for as long as the server lives (see
/// [`Gate::trust`]); does nothing on a server without a secret.
#[derive(Clone)]
pub struct Trusts(std::sync::Weak<Shared>);

impl Trusts {
    pub fn trust(&self, ip: std::net::IpAddr) {
        if let Some(gate) = self.0.upgrade().as_ref().and_then(|shared| shared.gate.as_ref()) {
            gate.trust(ip);
        }
    }
}

/// State shared by the accept loop and every connection.
pub(crate) struct Shared {
    db: Mutex<Db>,
    limits: Limits,
    next_id: AtomicU64,
    /// Who is served (the connection cap) and how many are.
    admission: Admission,
    idle_timeout: Option<Duration>,
    /// Present when clients must prove the job secret.
    gate: Option<Gate>,
    /// Connections closed on an error (garbage, cut mid-request, idle): counted, and said
    /// once a minute per address.
    closed_on_error: AddressLog,
}

impl Shared {
    fn db(&self) -> MutexGuard<'_, Db> {
        // No code path panics while holding the lock; if one ever did, the data is still
        // consistent at operation granularity, so keep serving.
        self.db.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn next_waiter_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// A running server. Dropping it stops the server (its `Stop` does); [`StoreServer::shutdown`]
/// also waits for every connection to close.
pub struct StoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Stop,
    /// Every task holds a sender; `recv` returns `None` once all of them have ended.
    finished: mpsc::Receiver<()>,
}

impl StoreServer {
    /// Binds (or adopts `listen_fd`) and starts serving on the current tokio runtime.
    pub fn start(config: &ServerConfig) -> io::Result<StoreServer> {
        StoreServer::serve(StoreServer::listen(config)?, config)
    }

    /// The listening socket `config` asks for.
    pub fn listen(config: &ServerConfig) -> io::Result<std::net::TcpListener> {
        match &config.listen_fd {
            Some(fd) => listener::adopt(fd.try_clone()?, config.port),
            None => listener::bind(config.host.as_deref(), config.port),
        }
    }

    /// Starts serving on an already listening socket, on the current tokio runtime.
    pub fn serve(std_listener: std::net::TcpListener, config: &ServerConfig) -> io::Result<StoreServer> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(io::Error::other("StoreServer::start must run inside a tokio runtime"));
        }
        let local_addr = std_listener.local_addr()?;
        let (acceptor, accepted) = Acceptor::start(std_listener)?;
        let shared = Arc::new(Shared {
            db: Mutex::new(Db::new()),
            limits: config.limits,
            next_id: AtomicU64::new(1),
            admission: Admission::new(config.max_connections),
            idle_timeout: config.idle_timeout,
            gate: config.auth.clone().map(|(secret, plain)| Gate::new(secret, plain)),
            closed_on_error: AddressLog::new(),
        });
        let (stop, stop_signal) = Stop::new();
        let (task_done, finished) = mpsc::channel(1);
        crate::store::linger::register_server(local_addr, &shared.admission.peers);
        tokio::spawn(accept_loop(acceptor, accepted, shared.clone(), stop_signal, task_done));
        tracing::info!(%local_addr, "store server listening");
        Ok(StoreServer { local_addr, shared, stop, finished })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn port(&self) -> u16 {
        self.local_addr.port()
    }

    /// Connections being served right now.
    pub fn connections(&self) -> usize {
        self.shared.admission.served()
    }

    /// Connections refused so far because `max_connections` were being served.
    pub fn refused(&self) -> u64 {
        self.shared.admission.refused()
    }

    /// A handle that lets plain clients from given addresses in (a round's members).
    pub fn trusts(&self) -> Trusts {
        Trusts(Arc::downgrade(&self.shared))
    }

    /// Connections the server closed on an error (a bad request, a broken connection): not
    /// the ones their clients left, however they left.
    pub fn closed_on_errors(&self) -> u64 {
        self.shared.closed_on_error.count()
    }

    /// Connections refused so far because they did not prove the job secret.
    pub fn refused_unauthenticated(&self) -> u64 {
        self.shared.gate.as_ref().map_or(0, Gate::refused)
    }

    /// Clients blocked in WAIT or BARRIER right now.
    pub fn waiting(&self) -> usize {
        self.shared.db().waiting()
    }

    /// Waits, in-process and without polling, until the counter under `key` reaches `target`.
    /// Returns the counter's value: `Ok` when reached, `Err` with the last value on timeout.
    /// (A torch master uses this to wait for its workers' `init/` increments.)
    pub async fn wait_for_counter(&self, key: &[u8], target: i64, timeout: Option<Duration>) -> Result<i64, i64> {
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        let waker = Waker::default();
        let id = self.shared.next_waiter_id();
        loop {
            let current = {
                let mut db = self.shared.db();
                let current = db.state().get(key).and_then(|v| parse_counter(v).ok()).unwrap_or(0);
                if current >= target {
                    return Ok(current);
                }
                db.watch_key(id, key, &waker);
                current
            };
            let woke = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, waker.woken()).await.is_ok(),
                None => {
                    waker.woken().await;
                    true
                }
            };
            if !woke {
                self.shared.db().forget(id);
                return Err(current);
            }
        }
    }

    /// Stops accepting, closes every connection (clients blocked in a wait see EOF at once)
    /// and waits for all connection tasks to end.
    pub async fn shutdown(mut self) {
        self.stop.stop();
        let _ = self.finished.recv().await;
    }
}

/// Admits what the [`Acceptor`] thread accepts, until shutdown (which stops the thread too).
async fn accept_loop(
    acceptor: Acceptor,
    mut accepted: mpsc::UnboundedReceiver<Accepted>,
    shared: Arc<Shared>,
    mut shutdown: Shutdown,
    task_done: mpsc::Sender<()>,
) {
    let _acceptor = acceptor;
    let accept_failures = Throttled::new();
    loop {
        let next = tokio::select! {
            _ = shutdown.recv() => return,
            next = accepted.recv() => next,
        };
        match next {
            None => return, // the thread ended
            Some(Ok((stream, peer))) => match TcpStream::from_std(stream) {
                // TCP_NODELAY and keepalive come from the listener (listener::bind)
                Ok(stream) => serve(stream, peer, &shared, &shutdown, &task_done),
                Err(err) => tracing::debug!(%peer, "could not register an accepted connection: {err}"),
            },
            Some(Err(err)) => accept_failed(&err, &shared, &accept_failures),
        }
    }
}

/// Out of descriptors: connections still waiting to authenticate go first (a flood of
/// strangers must not keep a member out); the thread backs off from other errors, and
/// existing clients are served meanwhile; said once a minute at most, however the burst goes.
fn accept_failed(err: &io::Error, shared: &Shared, accept_failures: &Throttled) {
    let out_of_descriptors = matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
    let shed = out_of_descriptors && shared.gate.as_ref().is_some_and(Gate::shed_oldest);
    match accept_failures.note() {
        Some(unsaid) => tracing::warn!(
            "accept failed: {err}{}; existing clients are still served ({unsaid} more failed since this was last \
             said; said at most once a minute)",
            if shed { "; shed the oldest connection waiting to authenticate" } else { "; retrying with backoff" }
        ),
        None => tracing::debug!("accept failed again: {err}"),
    }
}

/// Serves one accepted connection in a task of its own, once admitted: at once without a
/// secret; with one, after the handshake, which runs in that task (a slow client holds up
/// nobody). A refused client sees EOF now, not a hang in the backlog.
fn serve(stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>, shutdown: &Shutdown, task_done: &mpsc::Sender<()>) {
    let (shared, mut shutdown, task_done) = (shared.clone(), shutdown.clone(), task_done.clone());
    if shared.gate.is_none() {
        let Some(admitted) = shared.admission.admit(peer) else { return };
        let mut connection = Connection::new(Transport::Plain(stream), peer, shared);
        tokio::spawn(async move {
            connection.run(&mut shutdown).await;
            drop((admitted, task_done));
        });
        return;
    }
    tokio::spawn(async move {
        let mut stream = stream;
        let Some(gate) = shared.gate.as_ref() else { return };
        let admitted = tokio::select! {
            admitted = gate.admit(&mut stream, peer) => admitted,
            _ = shutdown.recv() => None,
        };
        let (admitted, transport) = match admitted {
            // a member's connection goes on in the session its handshake made
            Some(Admitted::Member(session)) => {
                (Some(shared.admission.admit_member(peer)), Transport::sealed(stream, *session))
            }
            Some(Admitted::Plain) => (shared.admission.admit(peer), Transport::Plain(stream)),
            None => (None, Transport::Plain(stream)),
        };
        if let Some(admitted) = admitted {
            Connection::new(transport, peer, shared).run(&mut shutdown).await;
            drop(admitted);
        }
        drop(task_done);
    });
}

/// A server on a runtime of its own, for programs that are not async themselves (Python's
/// `TCPStore(is_master=True)`, tests). Dropping it stops the server and its threads.
pub struct BackgroundServer {
    server: Option<StoreServer>,
    runtime: Option<Runtime>,
}

impl BackgroundServer {
    pub fn start(config: &ServerConfig, worker_threads: usize) -> io::Result<BackgroundServer> {
        // Bind before making threads: a taken port is the common failure.
        let listener = StoreServer::listen(config)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(worker_threads.max(1))
            .thread_name("elastix-store")
            .enable_all()
            .build()?;
        let started = {
            let _entered = runtime.enter();
            StoreServer::serve(listener, config)
        };
        match started {
            Ok(server) => Ok(BackgroundServer { server: Some(server), runtime: Some(runtime) }),
            Err(err) => {
                dispose(runtime);
                Err(err)
            }
        }
    }

    pub fn server(&self) -> &StoreServer {
        self.server.as_ref().expect("present until drop")
    }

    pub fn port(&self) -> u16 {
        self.server().port()
    }
}

impl Drop for BackgroundServer {
    fn drop(&mut self) {
        drop(self.server.take()); // sends the stop signal
        if let Some(runtime) = self.runtime.take() {
            dispose(runtime);
        }
    }
}

/// Stops a runtime's threads: waiting briefly for tasks to wind down where blocking is
/// allowed, without waiting inside an async context (where blocking would panic).
fn dispose(runtime: Runtime) {
    if tokio::runtime::Handle::try_current().is_ok() {
        runtime.shutdown_background();
    } else {
        runtime.shutdown_timeout(Duration::from_secs(2));
    }
}
