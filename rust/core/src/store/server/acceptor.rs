//! Taking connections off the listen backlog on a thread of its own. In a storm of thousands
//! of clients the runtime is busy serving the ones it accepted already (their handshakes, ADDs
//! and WAITs); an accept loop on it falls behind, the kernel's backlog (`somaxconn`) overflows,
//! and each client whose SYN was dropped waits a second or more to send it again. This thread
//! does nothing but accept and hand each connection to the runtime's accept loop, which
//! admits and serves it as before.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

/// What the thread hands over: a connection (non-blocking already), or why accept failed.
pub(super) type Accepted = io::Result<(TcpStream, SocketAddr)>;

/// The accepting thread; stopped (and the listening socket closed) when dropped.
pub(super) struct Acceptor {
    listener: Arc<TcpListener>,
    stop: Arc<AtomicBool>,
}

impl Acceptor {
    pub(super) fn start(listener: TcpListener) -> io::Result<(Acceptor, mpsc::UnboundedReceiver<Accepted>)> {
        listener.set_nonblocking(false)?;
        let listener = Arc::new(listener);
        let stop = Arc::new(AtomicBool::new(false));
        let (handover, accepted) = mpsc::unbounded_channel();
        let (thread_listener, thread_stop) = (listener.clone(), stop.clone());
        std::thread::Builder::new()
            .name("elastix-store-accept".into())
            .spawn(move || accept_until_stopped(&thread_listener, &thread_stop, &handover))?;
        Ok((Acceptor { listener, stop }, accepted))
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // SAFETY: shutdown(2) on a descriptor the Arc keeps open; it only wakes the thread's
        // blocked accept (Linux makes it fail with EINVAL), and touches no memory.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

fn accept_until_stopped(listener: &TcpListener, stop: &AtomicBool, handover: &mpsc::UnboundedSender<Accepted>) {
    let mut backoff = Duration::from_millis(5);
    while !stop.load(Ordering::Acquire) {
        let accepted = listener.accept().and_then(|(stream, peer)| {
            stream.set_nonblocking(true)?;
            Ok((stream, peer))
        });
        match accepted {
            Ok(connection) => {
                backoff = Duration::from_millis(5);
                if handover.send(Ok(connection)).is_err() {
                    return; // the server is gone
                }
            }
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(_) if stop.load(Ordering::Acquire) => return,
            Err(err) => {
                // out of descriptors: the accept loop sheds a connection still proving itself,
                // so try again soon; anything else backs off, not to spin
                let out_of_descriptors = matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                if handover.send(Err(err)).is_err() {
                    return;
                }
                std::thread::sleep(if out_of_descriptors { Duration::from_millis(1) } else { backoff });
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}
