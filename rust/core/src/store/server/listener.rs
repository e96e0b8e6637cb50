//! Creating the listening socket: dual-stack by default, the host's full accept backlog, and
//! port 0 resolved by the kernel (the caller reads the real port back: no probe-then-bind race).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

/// TCP keepalive for every store connection, both ends: a peer that vanished without a FIN
/// (power loss, a cut link) is noticed after about 2 minutes instead of never.
fn keepalive() -> socket2::TcpKeepalive {
    socket2::TcpKeepalive::new()
        .with_time(std::time::Duration::from_secs(60))
        .with_interval(std::time::Duration::from_secs(10))
        .with_retries(6)
}

/// [`keepalive`] on a client's connection.
pub fn set_keepalive(stream: &tokio::net::TcpStream) -> io::Result<()> {
    socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive())
}

/// Keepalive and TCP_NODELAY on the listening socket: Linux copies both to every connection
/// it accepts, so a storm of clients costs no setsockopt per connection.
fn set_accepted_options(socket: &Socket) -> io::Result<()> {
    socket.set_tcp_nodelay(true)?;
    socket.set_tcp_keepalive(&keepalive())
}

/// The soft limit on open files (RLIMIT_NOFILE), if it can be read.
pub fn open_file_limit() -> Option<u64> {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).ok().map(|(soft, _)| soft)
}

/// Raises the soft open-file limit to the hard one (a server's connections are descriptors);
/// returns the limit now in force.
pub fn raise_open_file_limit() -> io::Result<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
        tracing::debug!("raised the open-file limit from {soft} to {hard}");
    }
    Ok(soft.max(hard))
}

/// Backlog used when the host's `somaxconn` cannot be read (Linux's default since 5.4).
const FALLBACK_BACKLOG: i32 = 4096;

/// The accept backlog: the host's `net.core.somaxconn`, as torch's servers use.
pub fn host_backlog() -> i32 {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .filter(|backlog: &i32| *backlog > 0)
        .unwrap_or(FALLBACK_BACKLOG)
}

/// Whether `host` names this machine's loopback only (a store for it then listens there alone).
pub fn is_loopback_name(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost") || host.parse::<IpAddr>().is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// Binds and listens. Without a host, `[::]` with IPv4-mapped addresses accepted, falling back
/// to `0.0.0.0` where IPv6 is unavailable; with a host, each of its addresses in turn. The
/// error names every address tried and why each failed.
pub fn bind(host: Option<&str>, port: u16) -> io::Result<TcpListener> {
    let candidates: Vec<SocketAddr> = match host {
        None | Some("") => {
            vec![SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)), SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))]
        }
        Some(host) => (host, port)
            .to_socket_addrs()
            .map_err(|err| io::Error::new(err.kind(), format!("cannot resolve listen host {host:?}: {err}")))?
            .collect(),
    };
    let mut failures = Vec::new();
    let mut last_kind = io::ErrorKind::AddrNotAvailable;
    for addr in &candidates {
        match bind_one(*addr) {
            Ok(listener) => return Ok(listener),
            Err(err) => {
                last_kind = err.kind();
                failures.push(format!("{addr}: {err}"));
            }
        }
    }
    // a port in use is no mystery: say who holds it, where this process can tell
    let holder = (last_kind == io::ErrorKind::AddrInUse && port != 0)
        .then(|| super::port_holder::describe_holder(port))
        .flatten()
        .map(|holder| format!("; it is held by {holder}"))
        .unwrap_or_default();
    Err(io::Error::new(
        last_kind,
        format!(
            // torch's wording, which users' code may match on
            "The server socket has failed to listen on any local network address (port {port}; tried {}){holder}",
            failures.join("; ")
        ),
    ))
}

fn bind_one(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    // Lets a restarted server take its port back from connections in TIME_WAIT; it does not
    // let two live servers share a port (that would need SO_REUSEPORT).
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        socket.set_only_v6(false)?;
    }
    socket.bind(&SockAddr::from(addr))?;
    set_accepted_options(&socket)?;
    socket.listen(host_backlog())?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// A descriptor of our own for the socket behind `fd` (torch's `master_listen_fd`, a bare
/// number from Python): a close-on-exec duplicate, so whoever owns `fd` may close it at any
/// time and no descriptor is ever closed twice. A number that is not an open socket is an
/// error, never undefined behaviour.
pub fn duplicate_socket_fd(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: fcntl on an arbitrary number touches no memory; a closed one fails with EBADF.
    let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if copy < 0 {
        let err = io::Error::last_os_error();
        return Err(io::Error::new(err.kind(), format!("listen fd {fd} is not an open descriptor: {err}")));
    }
    // SAFETY: `copy` was just returned by fcntl; nothing else owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(copy) };
    let socket = Socket::from(owned);
    let invalid = |why: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("listen fd {fd} {why}"));
    match socket.r#type() {
        Ok(kind) if kind == Type::STREAM => {}
        Ok(_) => return Err(invalid("is not a stream socket")),
        Err(err) => return Err(invalid(&format!("is not a socket: {err}"))),
    }
    match socket.local_addr()?.as_socket() {
        None => Err(invalid("is not an IP socket")),
        Some(addr) if addr.port() == 0 => Err(invalid("is not bound to a port (bind it first)")),
        Some(_) => Ok(socket.into()),
    }
}

/// Takes over a socket the caller already bound (torch's `master_listen_fd`) and listens on
/// it. Its bound port must be `expected_port` unless that is 0.
pub fn adopt(fd: OwnedFd, expected_port: u16) -> io::Result<TcpListener> {
    let socket = Socket::from(fd);
    let bound = socket
        .local_addr()?
        .as_socket()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "listen fd is not an IP socket"))?;
    if expected_port != 0 && bound.port() != expected_port {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("listen fd is bound to port {} but port {expected_port} was given", bound.port()),
        ));
    }
    set_accepted_options(&socket)?;
    socket.listen(host_backlog())?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted_connections_inherit_nodelay_and_keepalive_from_the_listener() {
        let listener = bind(Some("127.0.0.1"), 0).unwrap();
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        listener.set_nonblocking(false).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let socket = socket2::SockRef::from(&accepted);
        assert!(socket.tcp_nodelay().unwrap());
        assert!(socket.keepalive().unwrap());
        assert_eq!(socket.tcp_keepalive_time().unwrap(), std::time::Duration::from_secs(60));
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), 6);
    }

    #[test]
    fn port_zero_binds_a_real_port_on_both_families() {
        let listener = bind(None, 0).unwrap();
        let port = listener.local_addr().unwrap().port();
        assert_ne!(port, 0);
        // dual-stack: an IPv4 client reaches the [::] listener
        std::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).unwrap();
    }

    #[test]
    fn a_taken_port_is_a_clear_error() {
        let first = bind(None, 0).unwrap();
        let port = first.local_addr().unwrap().port();
        let err = bind(None, port).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        assert!(err.to_string().contains(&port.to_string()), "{err}");
    }

    #[test]
    fn a_named_host_binds_that_address() {
        let listener = bind(Some("127.0.0.1"), 0).unwrap();
        assert_eq!(listener.local_addr().unwrap().ip(), Ipv4Addr::LOCALHOST);
    }

    #[test]
    fn adopting_a_socket_checks_its_port() {
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        socket.bind(&SockAddr::from(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))).unwrap();
        let port = socket.local_addr().unwrap().as_socket().unwrap().port();
        let fd = duplicate_socket_fd(std::os::fd::AsRawFd::as_raw_fd(&socket)).unwrap();
        drop(socket); // the original may go: the listener has a descriptor of its own
        let listener = adopt(fd, port).unwrap();
        assert_eq!(listener.local_addr().unwrap().port(), port);
        let wrong = duplicate_socket_fd(std::os::fd::AsRawFd::as_raw_fd(&listener)).unwrap();
        assert!(adopt(wrong, port.wrapping_add(1).max(1)).unwrap_err().to_string().contains("bound to port"));
    }

    #[test]
    fn a_bad_listen_fd_is_an_error() {
        assert!(duplicate_socket_fd(-1).unwrap_err().to_string().contains("not an open descriptor"));
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let err = duplicate_socket_fd(std::os::fd::AsRawFd::as_raw_fd(&file)).unwrap_err();
        assert!(err.to_string().contains("not a socket"), "{err}");
        let udp = Socket::new(Domain::IPV4, Type::DGRAM, None).unwrap();
        let err = duplicate_socket_fd(std::os::fd::AsRawFd::as_raw_fd(&udp)).unwrap_err();
        assert!(err.to_string().contains("not a stream socket"), "{err}");
    }
}
