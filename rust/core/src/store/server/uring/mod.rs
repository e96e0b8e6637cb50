//! The store server on io_uring: one thread, one ring, every connection's receives, sends
//! and accepts batched into one system call per turn of the loop.
//!
//! Where the epoll server ([`super::StoreServer`]) pays one wake-up, one read and one write
//! per ready connection and a task with its buffers per client, this one arms a multishot
//! receive per connection that draws from one shared pool of buffers, hands every reply of a
//! turn to the kernel together, and owns the data outright (no lock: one thread executes every
//! request, in the order the kernel completed them, which keeps the store linearizable). An
//! idle client costs a connection record and nothing else.
//!
//! It serves plain clients: the job secret's handshake and sealed records are the epoll
//! server's (`elastix-store --io auto` picks that one for a job with a secret).
//! [`UringServer::start`] fails cleanly where the kernel lacks io_uring or forbids it
//! (`kernel.io_uring_disabled`, a seccomp filter), so a caller can fall back to epoll.

mod conn;
mod event_loop;
mod pool;
mod ring;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use super::admission::Admission;
use super::ServerConfig;
use crate::address_log::AddressLog;

/// What the loop tells the handle, as it goes.
pub(super) struct Stats {
    admission: Admission,
    closed_on_error: AddressLog,
    /// Clients blocked in WAIT or BARRIER, as of the loop's last turn.
    waiting: AtomicUsize,
}

/// A store server running on a thread of its own. Dropping it stops the server, closes
/// every connection and waits for the thread.
pub struct UringServer {
    local_addr: SocketAddr,
    stats: Arc<Stats>,
    /// Written to stop the loop (it polls this eventfd).
    stop: OwnedFd,
    thread: Option<JoinHandle<()>>,
}

impl UringServer {
    /// Binds (or adopts `listen_fd`) and serves. Fails with `Unsupported` where the kernel
    /// offers no usable io_uring, and with `InvalidInput` for a configuration with a secret.
    pub fn start(config: &ServerConfig) -> io::Result<UringServer> {
        UringServer::serve(super::StoreServer::listen(config)?, config)
    }

    /// Serves on an already listening socket.
    pub fn serve(listener: TcpListener, config: &ServerConfig) -> io::Result<UringServer> {
        if config.auth.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the io_uring store server serves no job secret (its handshake runs on the epoll server)",
            ));
        }
        let local_addr = listener.local_addr()?;
        let stats = Arc::new(Stats {
            admission: Admission::new(config.max_connections),
            closed_on_error: AddressLog::new(),
            waiting: AtomicUsize::new(0),
        });
        let stop = eventfd()?;
        let (started, ready) = mpsc::sync_channel(1);
        let settings =
            event_loop::Settings { limits: config.limits, idle_timeout: config.idle_timeout, stop: stop.try_clone()? };
        let loop_stats = stats.clone();
        // The ring is made on the thread that submits to it (a single issuer's ring refuses
        // any other), which reports whether it could be made before serving.
        let thread = std::thread::Builder::new().name("elastix-store-uring".into()).spawn(move || {
            match event_loop::EventLoop::new(listener, settings, loop_stats) {
                Ok(event_loop) => {
                    let _ = started.send(Ok(()));
                    event_loop.run();
                }
                Err(err) => {
                    let _ = started.send(Err(err));
                }
            }
        })?;
        match ready.recv() {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                let _ = thread.join();
                return Err(err);
            }
            Err(_) => return Err(io::Error::other("the io_uring server's thread ended before it started")),
        }
        crate::store::linger::register_server(local_addr, &stats.admission.peers);
        tracing::info!(%local_addr, "store server listening (io_uring)");
        Ok(UringServer { local_addr, stats, stop, thread: Some(thread) })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn port(&self) -> u16 {
        self.local_addr.port()
    }

    /// Connections being served right now.
    pub fn connections(&self) -> usize {
        self.stats.admission.served()
    }

    /// Connections refused so far because `max_connections` were being served.
    pub fn refused(&self) -> u64 {
        self.stats.admission.refused()
    }

    /// Connections the server closed on an error (a bad request, a broken connection).
    pub fn closed_on_errors(&self) -> u64 {
        self.stats.closed_on_error.count()
    }

    /// Clients blocked in WAIT or BARRIER (as of the loop's last turn).
    pub fn waiting(&self) -> usize {
        self.stats.waiting.load(Ordering::Relaxed)
    }

    /// Stops accepting, closes every connection (clients blocked in a wait see EOF at once)
    /// and waits for the loop to end: at most [`event_loop::STOP_GRACE`].
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        let Some(thread) = self.thread.take() else { return };
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live array to an eventfd this handle owns.
        let written = unsafe { libc::write(self.stop.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        if written != 8 {
            tracing::warn!("could not tell the io_uring server to stop: {}", io::Error::last_os_error());
            return; // its thread is left running rather than waited for forever
        }
        let _ = thread.join();
    }
}

impl Drop for UringServer {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// Whether this kernel lets this process serve on io_uring (a ring can be made, with the
/// operations the server uses); the reason where not.
pub fn available() -> Result<(), io::Error> {
    ring::Ring::new(8).map(drop)
}

fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes no pointers; a non-negative result is a descriptor we now own.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by eventfd and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
