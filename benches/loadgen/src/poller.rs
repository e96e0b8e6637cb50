//! A minimal level-triggered epoll wrapper: every connection is registered once for
//! readability, so a request costs one write, one read and a share of one epoll_wait.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

pub struct Poller {
    epoll: OwnedFd,
}

pub type Event = libc::epoll_event;

pub fn empty_events(n: usize) -> Vec<Event> {
    vec![libc::epoll_event { events: 0, u64: 0 }; n.max(1)]
}

/// The token an event was registered with. (epoll_event is packed; copy the field out.)
pub fn token(event: &Event) -> usize {
    let token = event.u64;
    token as usize
}

impl Poller {
    pub fn new() -> io::Result<Poller> {
        // SAFETY: plain syscall; the returned descriptor is owned from here on.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor nobody else owns.
        Ok(Poller { epoll: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    pub fn add(&self, fd: RawFd, token: usize) -> io::Result<()> {
        let mut event = libc::epoll_event { events: libc::EPOLLIN as u32, u64: token as u64 };
        // SAFETY: both descriptors are open and `event` outlives the call.
        let rc = unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits up to `timeout_ms` and returns how many entries of `events` were filled.
    pub fn wait(&self, events: &mut [Event], timeout_ms: i32) -> io::Result<usize> {
        loop {
            // SAFETY: the buffer is valid for `events.len()` entries.
            let n = unsafe {
                libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), events.len() as i32, timeout_ms)
            };
            if n >= 0 {
                return Ok(n as usize);
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
    }
}

/// Blocks until `fd` can take more bytes (only after a short write, which small requests on
/// an otherwise idle socket practically never see).
pub fn wait_writable(fd: RawFd) -> io::Result<()> {
    let mut pfd = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
    // SAFETY: one valid pollfd.
    let rc = unsafe { libc::poll(&mut pfd, 1, 1000) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    Ok(())
}

/// CPU seconds (user + system) the calling thread has used.
pub fn thread_cpu_seconds() -> f64 {
    // SAFETY: rusage is plain old data, for which all-zero bytes are a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes only into the struct it is given, which outlives the call.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
    let secs = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}
