//! torch's `master_listen_fd`: a socket the caller bound, handed over to the store server.
//!
//! The descriptor is checked before anything takes it (an open TCP stream socket bound to an
//! IPv4 or IPv6 address), so a wrong number is a clear error and is left alone; once checked,
//! it is owned by an `OwnedFd` and closed exactly once, by whoever ends up holding it.

use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};

use nix::libc;
use nix::sys::socket::{getsockname, getsockopt, sockopt, AddressFamily, SockType, SockaddrLike, SockaddrStorage};
use pyo3::exceptions::PyValueError;
use pyo3::PyResult;

fn refuse(fd: i32, why: &str) -> pyo3::PyErr {
    PyValueError::new_err(format!("master_listen_fd {fd} {why}"))
}

/// Takes ownership of `fd` once it is known to be a bound TCP socket.
pub fn take(fd: i32) -> PyResult<OwnedFd> {
    if fd < 0 {
        return Err(refuse(fd, "is negative"));
    }
    // SAFETY: F_GETFD only reads the descriptor's flags; a closed one gives EBADF.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(refuse(fd, "is not an open file descriptor"));
    }
    // SAFETY: `fd` is open (checked just above) and only borrowed for the checks below, which
    // run while the caller holds the GIL and waits for us, so it stays open meanwhile.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    match getsockopt(&borrowed, sockopt::SockType) {
        Ok(SockType::Stream) => {}
        Ok(other) => return Err(refuse(fd, &format!("is a {other:?} socket, not a TCP (stream) one"))),
        Err(_) => return Err(refuse(fd, "is not a socket")),
    }
    let addr: SockaddrStorage = getsockname(fd).map_err(|err| refuse(fd, &format!("has no address: {err}")))?;
    match addr.family() {
        Some(AddressFamily::Inet) | Some(AddressFamily::Inet6) => {}
        _ => return Err(refuse(fd, "is not an IPv4 or IPv6 socket")),
    }
    let port = addr.as_sockaddr_in().map(|a| a.port()).or_else(|| addr.as_sockaddr_in6().map(|a| a.port()));
    if port == Some(0) {
        return Err(refuse(fd, "is not bound to a port (bind it first)"));
    }
    // SAFETY: `fd` is an open socket (checked above) whose ownership the caller hands over, as
    // torch's TCPStore takes it: from now on only this OwnedFd (or the server it is given to)
    // closes it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
