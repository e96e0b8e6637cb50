//! `--storm`: N clients start at once, as the ranks of a large job do: each connects, sends
//! VALIDATE then PING (torch's client handshake), ADDs itself to one counter and WAITs for a
//! key that the client whose ADD returns N sets (with its WAIT, in the same write). Phases
//! are timed from the first connect to the last client done with each: connected, validated
//! (PING echoed), added, released (WAIT answered). Every reply is checked.
//!
//! Threads split the clients; each connects its share with blocking connects (completed by
//! the kernel's backlog, not by the server's accept), then drives them from one epoll loop.
//! With `sources` > 1 (a server on loopback), client i connects from 127.0.0.(2 + i % sources):
//! a real storm comes from many hosts, and one source address's ephemeral ports make each
//! connect scan for a free port ever longer as they fill (16,000 from one address spend about
//! 2 s in connect alone), which would time the generator instead of the server.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::poller::{empty_events, token, Poller};
use crate::wire;

/// Bound on the whole storm: a server that never releases everyone fails the run.
const STORM_TIMEOUT: Duration = Duration::from_secs(300);

/// When the slowest client finished each phase, from the start.
#[derive(Clone, Copy, Default)]
pub struct Phases {
    pub connected: Duration,
    pub validated: Duration,
    pub added: Duration,
    pub released: Duration,
}

impl Phases {
    fn latest(self, other: Phases) -> Phases {
        Phases {
            connected: self.connected.max(other.connected),
            validated: self.validated.max(other.validated),
            added: self.added.max(other.added),
            released: self.released.max(other.released),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Expect {
    Echo,
    Count,
    Released,
    Done,
}

struct Client {
    stream: TcpStream,
    expect: Expect,
    reply: [u8; 8],
    got: usize,
}

/// The storm's connections, still open (to measure what the server holds per idle client).
pub struct Held(Vec<TcpStream>);

impl Drop for Held {
    /// Closes with a reset (SO_LINGER 0): no TIME_WAIT left behind, whose ports the next
    /// storm's connects would collide with (PAWS drops their SYNs, a second lost each).
    fn drop(&mut self) {
        let linger = libc::linger { l_onoff: 1, l_linger: 0 };
        for stream in &self.0 {
            // SAFETY: setsockopt reads `linger`, valid for the call, on a descriptor we own.
            unsafe {
                libc::setsockopt(
                    stream.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&linger as *const libc::linger).cast(),
                    std::mem::size_of::<libc::linger>() as libc::socklen_t,
                );
            }
        }
    }
}

/// Runs a storm of `clients` against `addr` over `threads` threads.
pub fn run(
    addr: SocketAddr,
    tag: &str,
    clients: usize,
    threads: usize,
    sources: usize,
) -> Result<(Phases, Held), String> {
    if sources > 1 && !addr.ip().is_loopback() {
        return Err("--sources spreads clients over 127.0.0.x: the server must listen on loopback".into());
    }
    let start = Instant::now();
    let keys = Arc::new((format!("/storm/{tag}/count"), format!("/storm/{tag}/go")));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let share = clients / threads + usize::from(t < clients % threads);
            let keys = keys.clone();
            let first = t * (clients / threads) + t.min(clients % threads);
            let from = move |i: usize| source(first + i, sources);
            std::thread::spawn(move || drive(addr, share, from, clients as i64, &keys.0, &keys.1, start))
        })
        .collect();
    let (mut phases, mut held) = (Phases::default(), Vec::with_capacity(clients));
    for worker in workers {
        let (done, streams) = worker.join().map_err(|_| "a storm thread panicked".to_string())??;
        phases = phases.latest(done);
        held.extend(streams);
    }
    Ok((phases, Held(held)))
}

fn drive(
    addr: SocketAddr,
    share: usize,
    from: impl Fn(usize) -> Option<Ipv4Addr>,
    total: i64,
    count: &str,
    go: &str,
    start: Instant,
) -> Result<(Phases, Vec<TcpStream>), String> {
    let requests = Requests::new(count, go);
    let mut clients = connect_share(addr, share, from)?;
    let mut phases = Phases { connected: start.elapsed(), ..Phases::default() };
    let poller = Poller::new().map_err(|e| format!("epoll: {e}"))?;
    for (index, client) in clients.iter().enumerate() {
        poller.add(client.stream.as_raw_fd(), index).map_err(|e| format!("epoll_ctl: {e}"))?;
    }
    let mut events = empty_events(clients.len().min(4096));
    let mut left = [share; 3]; // echoes, counts and releases still to come
    let deadline = start + STORM_TIMEOUT;
    while left[2] > 0 {
        if Instant::now() > deadline {
            return Err(format!("{} of {share} clients not released after {STORM_TIMEOUT:?}", left[2]));
        }
        let ready = poller.wait(&mut events, 100).map_err(|e| format!("epoll_wait: {e}"))?;
        for event in &events[..ready] {
            let index = token(event);
            if !read_reply(&mut clients[index], index)? {
                continue;
            }
            let stage = answer(&mut clients[index], index, &requests, total)?;
            left[stage] -= 1;
            match stage {
                0 if left[0] == 0 => phases.validated = start.elapsed(),
                1 if left[1] == 0 => phases.added = start.elapsed(),
                _ => {}
            }
        }
    }
    phases.released = start.elapsed();
    Ok((phases, clients.into_iter().map(|client| client.stream).collect()))
}

/// What every client sends, encoded once: its arrival (ADD), its wait, and the last
/// arrival's release (SET, then its own wait).
struct Requests {
    add: Vec<u8>,
    wait: Vec<u8>,
    release: Vec<u8>,
}

impl Requests {
    fn new(count: &str, go: &str) -> Requests {
        let mut add = Vec::new();
        wire::add(&mut add, count.as_bytes(), 1);
        let mut wait = Vec::new();
        wire::wait(&mut wait, go.as_bytes());
        let mut release = Vec::new();
        wire::set(&mut release, go.as_bytes(), b"1");
        release.extend_from_slice(&wait);
        Requests { add, wait, release }
    }
}

/// `share` clients connected, validated and pinged, non-blocking.
fn connect_share(
    addr: SocketAddr,
    share: usize,
    from: impl Fn(usize) -> Option<Ipv4Addr>,
) -> Result<Vec<Client>, String> {
    let mut clients = Vec::with_capacity(share);
    for id in 0..share {
        let fail = |what: &str, e: io::Error| format!("client {id}: {what}: {e}");
        let stream = connect(addr, from(id)).map_err(|e| fail("connect", e))?;
        stream.set_nodelay(true).map_err(|e| fail("TCP_NODELAY", e))?;
        (&stream).write_all(&wire::VALIDATE).map_err(|e| fail("VALIDATE", e))?;
        (&stream).write_all(&wire::ping(id as u32)).map_err(|e| fail("PING", e))?;
        stream.set_nonblocking(true).map_err(|e| fail("non-blocking", e))?;
        clients.push(Client { stream, expect: Expect::Echo, reply: [0; 8], got: 0 });
    }
    Ok(clients)
}

/// Reads what is there of the reply client `index` expects; true once it is whole.
fn read_reply(client: &mut Client, index: usize) -> Result<bool, String> {
    let want = match client.expect {
        Expect::Echo => 4,
        Expect::Count => 8,
        Expect::Released => 1,
        Expect::Done => return Err(format!("client {index}: bytes after its release")),
    };
    match client.stream.read(&mut client.reply[client.got..want]) {
        Ok(0) => Err(format!("client {index}: the server closed the connection")),
        Ok(n) => {
            client.got += n;
            let whole = client.got == want;
            if whole {
                client.got = 0;
            }
            Ok(whole)
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
        Err(e) => Err(format!("client {index}: read: {e}")),
    }
}

/// Checks client `index`'s whole reply and sends its next request; returns the stage it
/// finished (0: echoed, 1: counted, 2: released).
fn answer(client: &mut Client, index: usize, requests: &Requests, total: i64) -> Result<usize, String> {
    let fail = |e: io::Error| format!("client {index}: write: {e}");
    match client.expect {
        Expect::Echo => {
            if client.reply[..4] != (index as u32).to_le_bytes() {
                return Err(format!("client {index}: PING echoed {:02x?}", &client.reply[..4]));
            }
            write_all(&client.stream, &requests.add).map_err(fail)?;
            client.expect = Expect::Count;
            Ok(0)
        }
        Expect::Count => {
            let value = i64::from_le_bytes(client.reply);
            if !(1..=total).contains(&value) {
                return Err(format!("client {index}: ADD returned {value}, outside 1..={total}"));
            }
            let next = if value == total { &requests.release } else { &requests.wait };
            write_all(&client.stream, next).map_err(fail)?;
            client.expect = Expect::Released;
            Ok(1)
        }
        Expect::Released => {
            if client.reply[0] != 0 {
                return Err(format!("client {index}: WAIT answered {:#04x}, not STOP_WAITING", client.reply[0]));
            }
            client.expect = Expect::Done;
            Ok(2)
        }
        Expect::Done => unreachable!("refused by read_reply"),
    }
}

/// The source address of client `i` among `sources` (`None`: the kernel's choice).
fn source(i: usize, sources: usize) -> Option<Ipv4Addr> {
    (sources > 1).then(|| Ipv4Addr::new(127, 0, 0, 2 + (i % sources.min(250)) as u8))
}

/// A blocking connect to `addr`, from `source` if given (its port picked at connect time:
/// IP_BIND_ADDRESS_NO_PORT, so binding does not reserve a port per address up front).
fn connect(addr: SocketAddr, source: Option<Ipv4Addr>) -> io::Result<TcpStream> {
    let (Some(source), SocketAddr::V4(target)) = (source, addr) else { return TcpStream::connect(addr) };
    let os = |rc: libc::c_int| if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc) };
    let sockaddr = |at: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: at.port().to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(*at.ip()).to_be() },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain syscalls; the descriptor is owned by the TcpStream made at once, so it is
    // closed on every path, and every pointer passed is valid for its call.
    unsafe {
        let stream =
            TcpStream::from_raw_fd(os(libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0))?);
        let fd = stream.as_raw_fd();
        let on: libc::c_int = 1;
        let size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        os(libc::setsockopt(
            fd,
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&on as *const libc::c_int).cast(),
            size,
        ))?;
        let local = sockaddr(SocketAddrV4::new(source, 0));
        os(libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len))?;
        let remote = sockaddr(target);
        os(libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len))?;
        Ok(stream)
    }
}

/// Writes all of `bytes` to a non-blocking socket (a few dozen bytes: the kernel takes them
/// at once unless the server stopped reading, which the storm's deadline then reports).
fn write_all(mut stream: &TcpStream, mut bytes: &[u8]) -> io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !bytes.is_empty() {
        match stream.write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => std::thread::yield_now(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
