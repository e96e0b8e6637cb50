//! The metrics endpoint: `GET /metrics` over HTTP/1.x, one response per connection. Small on
//! purpose (no web framework): a scraper sends one request and reads one reply. Every
//! connection is bounded in time and size; until its request is in it waits at a door (a few
//! per address, a few dozen in all, the oldest shed for a newer one, closed within
//! [`HEAD_DEADLINE`]), so silent or slow clients can neither hold the process's runtime nor
//! black out the scrapes, and failed accepts are said once a minute at most.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use super::{render, Exposes, CONTENT_TYPE, ENABLED};
use crate::address_log::Throttled;
use crate::auth::{Door, DoorLimits};

/// Longest request head read; a scraper's is a few hundred bytes.
const MAX_HEAD: usize = 8 * 1024;
/// Time a client gets to send its request and read the reply.
const CLIENT_DEADLINE: Duration = Duration::from_secs(10);
/// Time a client gets to send its request head: a scraper sends it at once.
const HEAD_DEADLINE: Duration = Duration::from_secs(2);
/// Connections waiting for their request head at once, and scrapes served at once.
const MAX_CLIENTS: usize = 32;
/// Connections waiting for their request head at once from one address.
const MAX_PER_ADDRESS: usize = 2;

/// The endpoint, served on the current tokio runtime until dropped.
pub struct MetricsServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl MetricsServer {
    /// Binds `host:port` (every IPv4 address when `host` is `None`; port 0 picks a free one) and
    /// serves. A port in use is an error here, before anything else starts. Must be called
    /// inside a tokio runtime.
    pub fn start(host: Option<&str>, port: u16, exposes: Exposes) -> io::Result<MetricsServer> {
        let host = host.unwrap_or("0.0.0.0");
        let listener = std::net::TcpListener::bind((host, port))
            .map_err(|err| io::Error::new(err.kind(), format!("cannot serve metrics on {host}:{port}: {err}")))?;
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        let addr = listener.local_addr()?;
        ENABLED.store(true, std::sync::atomic::Ordering::Relaxed);
        let task = tokio::spawn(accept_loop(listener, exposes));
        tracing::info!("serving metrics on http://{addr}/metrics");
        Ok(MetricsServer { addr, task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, exposes: Exposes) {
    // A connection waits at this door until its request head is in: two per address and 32 in
    // all at most, the oldest shed to make room for a newer one. A scraper sends its head at
    // once, so it is always among the newest: silent connections, from one address or many,
    // can slow a scrape by a connection's worth, never black them out.
    let door = Arc::new(Door::new(DoorLimits { per_source: MAX_PER_ADDRESS, total: MAX_CLIENTS }, HEAD_DEADLINE));
    let serving = Arc::new(Semaphore::new(MAX_CLIENTS));
    let accept_failures = Throttled::new();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                // out of descriptors, usually: a silent connection goes first, else wait a little
                let shed = matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) && door.shed_oldest();
                match accept_failures.note() {
                    Some(unsaid) => tracing::warn!(
                        "metrics endpoint: accept failed: {err} ({unsaid} more failed since this was last said; said \
                         at most once a minute)"
                    ),
                    None => tracing::debug!("metrics endpoint: accept failed again: {err}"),
                }
                if !shed {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                continue;
            }
        };
        let (door, serving) = (door.clone(), serving.clone());
        tokio::spawn(async move {
            let mut stream = stream;
            let head = match door.hold(peer.ip().to_canonical(), read_head(&mut stream)).await {
                Ok(Ok(head)) => head,
                Ok(Err(err)) => return tracing::debug!(%peer, "metrics endpoint: {err}"),
                Err(turned) => return tracing::debug!(%peer, "metrics endpoint: {turned}"),
            };
            let served = async {
                let _permit = serving.acquire_owned().await;
                respond(stream, &head, exposes).await
            };
            match tokio::time::timeout(CLIENT_DEADLINE, served).await {
                Ok(Err(err)) => tracing::debug!(%peer, "metrics endpoint: {err}"),
                Err(_) => tracing::debug!(%peer, "metrics endpoint: client too slow; closed"),
                Ok(Ok(())) => {}
            }
        });
    }
}

async fn respond(mut stream: TcpStream, head: &[u8], exposes: Exposes) -> io::Result<()> {
    let (status, content_type, body) = match parse_request_line(head) {
        Some(("GET" | "HEAD", "/metrics")) => ("200 OK", CONTENT_TYPE, render(exposes)),
        Some(("GET" | "HEAD", _)) => ("404 Not Found", "text/plain", "try /metrics\n".to_owned()),
        Some(_) => ("405 Method Not Allowed", "text/plain", "only GET\n".to_owned()),
        None => ("400 Bad Request", "text/plain", "not an HTTP request\n".to_owned()),
    };
    let head_only = head.starts_with(b"HEAD ");
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(reply.as_bytes()).await?;
    if !head_only {
        stream.write_all(body.as_bytes()).await?;
    }
    stream.shutdown().await
}

/// Reads up to the blank line that ends the request head.
async fn read_head(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        if head.len() >= MAX_HEAD {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "request head too long"));
        }
        let read = stream.read(&mut chunk).await?;
        if read == 0 {
            break;
        }
        head.extend_from_slice(&chunk[..read]);
    }
    Ok(head)
}

/// `(method, path)` of an HTTP/1.x request line; the query string is ignored.
fn parse_request_line(head: &[u8]) -> Option<(&str, &str)> {
    let line = head.split(|&b| b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
    let mut parts = line.split(' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    if !version.starts_with("HTTP/1.") || parts.next().is_some() {
        return None;
    }
    Some((method, target.split('?').next().unwrap_or(target)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_are_parsed_strictly() {
        assert_eq!(parse_request_line(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), Some(("GET", "/metrics")));
        assert_eq!(parse_request_line(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"), Some(("GET", "/metrics")));
        assert_eq!(parse_request_line(b"\x16\x03\x01 garbage"), None);
        assert_eq!(parse_request_line(b"GET /metrics\r\n\r\n"), None);
    }

    async fn get(addr: SocketAddr, request: &str) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        reply
    }

    #[tokio::test]
    async fn serves_the_exposition_and_refuses_a_port_in_use() {
        let server = MetricsServer::start(Some("127.0.0.1"), 0, Exposes::Store).unwrap();
        let reply = get(server.local_addr(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
        assert!(reply.contains("text/plain; version=0.0.4") && reply.contains("elastix_store_connections"), "{reply}");
        let reply = get(server.local_addr(), "GET / HTTP/1.1\r\n\r\n").await;
        assert!(reply.starts_with("HTTP/1.1 404"), "{reply}");
        let reply = get(server.local_addr(), "POST /metrics HTTP/1.1\r\n\r\n").await;
        assert!(reply.starts_with("HTTP/1.1 405"), "{reply}");

        let err = MetricsServer::start(Some("127.0.0.1"), server.port(), Exposes::Store).err().unwrap();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        assert!(err.to_string().contains(&format!("cannot serve metrics on 127.0.0.1:{}", server.port())), "{err}");
    }

    #[tokio::test]
    async fn silent_connections_from_many_addresses_do_not_black_out_the_scrapes() {
        let server = MetricsServer::start(Some("127.0.0.1"), 0, Exposes::Store).unwrap();
        let addr = server.local_addr();
        // 16 addresses, 4 silent connections each: more than the door holds, per address and in all
        let mut silent = Vec::new();
        for source in 2..18u8 {
            for _ in 0..4 {
                let socket = tokio::net::TcpSocket::new_v4().unwrap();
                socket.bind(SocketAddr::from(([127, 0, 0, source], 0))).unwrap();
                silent.push(socket.connect(addr).await.unwrap());
            }
        }
        for scrape in 0..30 {
            let reply = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
            assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "scrape {scrape}: {reply:?}");
            // the flood goes on: one more silent connection from each address between scrapes
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(SocketAddr::from(([127, 0, 0, 2 + (scrape % 16) as u8], 0))).unwrap();
            silent.push(socket.connect(addr).await.unwrap());
        }
    }
}
