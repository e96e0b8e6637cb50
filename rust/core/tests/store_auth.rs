//! A store server holding the job secret: clients that prove it are served; a client with
//! another secret, without one, or sending a truncated, garbage, replayed or silent handshake
//! is refused with a clear error, and only its own connection is closed. A stranger learns
//! nothing from the server to test guesses against, and a flood of silent strangers neither
//! keeps a member out nor makes a client give up.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use elastix_core::auth::{PlainClients, Secret};
use elastix_core::store::server::uring::UringServer;
use elastix_core::store::{BackgroundServer, Client, ConnectOptions, ServerConfig, StoreError};

fn secret(text: &str) -> Secret {
    Secret::from_bytes(text).unwrap()
}

fn server(plain: PlainClients) -> BackgroundServer {
    let config = ServerConfig { auth: Some((secret("the job's"), plain)), ..ServerConfig::default() };
    BackgroundServer::start(&config, 1).unwrap()
}

fn options(server: &BackgroundServer, secret: Option<Secret>) -> ConnectOptions {
    ConnectOptions { secret, ..ConnectOptions::new("127.0.0.1", server.port(), Some(Duration::from_secs(10))) }
}

/// Waits (bounded) for the server to have counted `expected` refusals: it counts a refusal
/// once the client's side is over, which the client may see first.
async fn refused_in_the_end(server: &BackgroundServer, expected: u64) {
    for _ in 0..500 {
        if server.server().refused_unauthenticated() >= expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(server.server().refused_unauthenticated(), expected);
}

fn refusal(connected: Result<Client, StoreError>) -> StoreError {
    match connected {
        Ok(_) => panic!("the client was served"),
        Err(err) => err,
    }
}

/// A torch client's opening (VALIDATE, then PING 7): whether the echo comes back.
fn plain_ping(port: u16) -> bool {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    stream.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c, 0x0d, 7, 0, 0, 0]).unwrap();
    let mut echo = [0u8; 4];
    stream.read_exact(&mut echo).is_ok() && echo == [7, 0, 0, 0]
}

/// Sends `bytes` and reports whether the server then closed the connection.
fn closed_after(port: u16, bytes: &[u8]) -> bool {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let _ = stream.write_all(bytes);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut rest = Vec::new();
    // the server answers a hello with its challenge (a nonce), then closes
    match stream.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(err) => matches!(err.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_proves_the_secret_is_served_and_others_are_refused_with_the_reason() {
    let server = server(PlainClients::Refuse);
    let mut good = Client::connect(&options(&server, Some(secret("the job's")))).await.unwrap();
    good.set(b"k", b"v").await.unwrap();

    let err = refusal(Client::connect(&options(&server, Some(secret("another")))).await);
    assert!(matches!(&err, StoreError::Auth { .. }), "{err}");
    assert!(err.to_string().contains("does not hold this job's secret"), "{err}");
    assert!(!err.is_unreachable(), "a wrong secret is final, not retried");

    let err = refusal(Client::connect(&options(&server, None)).await);
    assert!(err.to_string().contains("requires the job's secret"), "{err}");

    assert!(!plain_ping(server.port()), "a plain (torch) client is refused by a store that admits none");
    refused_in_the_end(&server, 3).await;
    assert_eq!(&good.get(b"k", None).await.unwrap()[..], b"v", "the good client was not disturbed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_store_admits_plain_clients_from_loopback() {
    let server = server(PlainClients::LoopbackAndAuthenticated);
    assert!(plain_ping(server.port()), "a torch worker on this machine connects without the secret");
    let mut good = Client::connect(&options(&server, Some(secret("the job's")))).await.unwrap();
    good.set(b"k", b"v").await.unwrap();
    assert_eq!(server.server().refused_unauthenticated(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzed_handshakes_close_only_their_own_connection() {
    let server = server(PlainClients::Refuse);
    let mut good = Client::connect(&options(&server, Some(secret("the job's")))).await.unwrap();
    let port = server.port();
    let magic: &[u8] = b"\xe1elxauth";
    let oversized = [magic, &[3u8, 1], &vec![0x5a; 1 << 20]].concat();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated magic", magic[..3].to_vec()),
        ("truncated nonce", [magic, &[3u8, 1], &[7u8; 10]].concat()),
        ("garbage after the first byte", b"\xe1GET / HTTP/1.1\r\n\r\n".to_vec()),
        ("an unknown version", [magic, &[9u8, 1], &[7u8; 32]].concat()),
        ("an unknown session mode", [magic, &[3u8, 9], &[7u8; 32]].concat()),
        ("oversized: a megabyte where the proof goes", oversized),
        ("a replayed proof", [magic, &[3u8, 1], &[7u8; 32], &[3u8; 32]].concat()),
    ];
    for (what, bytes) in &cases {
        let closed = tokio::task::spawn_blocking({
            let bytes = bytes.clone();
            move || closed_after(port, &bytes)
        })
        .await
        .unwrap();
        assert!(closed, "{what}: the connection must be closed");
        good.set(b"after", what.as_bytes()).await.unwrap();
    }
    // a client that connects and says nothing is closed after the handshake timeout
    let silent = tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut byte = [0u8; 1];
        matches!(stream.read(&mut byte), Ok(0))
    });
    assert!(silent.await.unwrap(), "a silent client is closed, not served forever");
    refused_in_the_end(&server, cases.len() as u64 + 1).await;
    assert_eq!(&good.get(b"after", None).await.unwrap()[..], cases.last().unwrap().0.as_bytes());
}

/// A hello as a stranger sends it: the store's magic, version 3, the authenticated mode, a nonce.
fn stranger_hello() -> Vec<u8> {
    [&b"\xe1elxauth"[..], &[3u8, 1], &[7u8; 32]].concat()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_gets_nothing_derived_from_the_secret() {
    let server = server(PlainClients::Refuse);
    let port = server.port();
    let (challenge, early, verdict) = tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        stream.write_all(&stranger_hello()).unwrap();
        let mut challenge = [0u8; 34];
        stream.read_exact(&mut challenge).unwrap();
        // nothing more comes before this side proves the secret
        stream.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let mut early = [0u8; 64];
        let early = stream.read(&mut early).map_or(0, |n| n);
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        stream.write_all(&[0u8; 32]).unwrap(); // a guess
        let mut verdict = Vec::new();
        let _ = stream.read_to_end(&mut verdict);
        (challenge, early, verdict)
    })
    .await
    .unwrap();
    assert_eq!(challenge[0], 1, "a challenge: go on, and a nonce");
    assert_eq!(early, 0, "the server said more before the client's proof");
    assert_eq!(verdict, [0u8; 33], "a refusal carries no proof");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_a_secret_learns_at_once_that_the_server_has_none() {
    let server = BackgroundServer::start(&ServerConfig { auth: None, ..ServerConfig::default() }, 1).unwrap();
    let err = refusal(Client::connect(&options(&server, Some(secret("the job's")))).await);
    assert!(err.to_string().contains("runs without a job secret"), "{err}");
    assert!(!err.is_unreachable(), "final, not retried until the deadline");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_a_secret_learns_at_once_that_the_io_uring_server_has_none() {
    let server = UringServer::start(&ServerConfig::default()).expect("the io_uring server");
    let options =
        ConnectOptions { secret: Some(secret("the job's")), ..ConnectOptions::new("127.0.0.1", server.port(), None) };
    let err = refusal(Client::connect(&options).await);
    assert!(err.to_string().contains("runs without a job secret"), "{err}");
    assert!(!err.is_unreachable(), "final, not retried until the deadline");
    assert_eq!(server.closed_on_errors(), 1);
}

/// Opens `count` connections from `source` to `port` that say nothing.
fn silent_connections(source: &str, port: u16, count: usize) -> Vec<socket2::Socket> {
    (0..count)
        .filter_map(|_| {
            let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
            socket.bind(&format!("{source}:0").parse::<std::net::SocketAddr>().unwrap().into()).ok()?;
            socket.connect(&format!("127.0.0.1:{port}").parse::<std::net::SocketAddr>().unwrap().into()).ok()?;
            Some(socket)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_strangers_never_take_a_members_place() {
    let config = ServerConfig {
        auth: Some((secret("the job's"), PlainClients::Refuse)),
        max_connections: 4,
        ..ServerConfig::default()
    };
    let server = BackgroundServer::start(&config, 1).unwrap();
    let port = server.port();
    let flood = tokio::task::spawn_blocking(move || silent_connections("127.0.0.2", port, 300)).await.unwrap();
    assert!(flood.len() > 100, "the flood could not connect");
    // more members than the cap, while the flood holds its connections open
    let mut members = Vec::new();
    for _ in 0..8 {
        members.push(Client::connect(&options(&server, Some(secret("the job's")))).await.unwrap());
    }
    for (i, member) in members.iter_mut().enumerate() {
        member.set(format!("k{i}").as_bytes(), b"v").await.unwrap();
    }
    assert!(server.server().connections() >= 8, "every member is served past the cap");
    drop(flood);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_tries_again_when_the_server_closes_during_authentication() {
    // a relay to the real server that drops the first connection it gets, as a server shedding
    // connections under a flood does
    let server = server(PlainClients::Refuse);
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_port = relay.local_addr().unwrap().port();
    let target = server.port();
    tokio::spawn(async move {
        let (first, _) = relay.accept().await.unwrap();
        drop(first);
        loop {
            let (mut inbound, _) = relay.accept().await.unwrap();
            tokio::spawn(async move {
                let mut outbound = tokio::net::TcpStream::connect(("127.0.0.1", target)).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    });
    let options = ConnectOptions {
        secret: Some(secret("the job's")),
        ..ConnectOptions::new("127.0.0.1", relay_port, Some(Duration::from_secs(10)))
    };
    let mut client = Client::connect(&options).await.unwrap();
    client.set(b"k", b"v").await.unwrap();
}

/// A relay a member dials (a spoofed name, an on-path host): it passes the handshake through
/// both ways, then drops the member and sends requests of its own on the proven connection.
/// The server answers none of them: after the handshake every byte must come sealed in the
/// session only the member and the server hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_passed_the_handshake_through_cannot_send_its_own_requests() {
    use elastix_core::auth::pair::{CHALLENGE_LEN, PROOF_LEN, STORE, VERDICT_LEN};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let server = server(PlainClients::Refuse);
    let mut good = Client::connect(&options(&server, Some(secret("the job's")))).await.unwrap();
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_port = relay.local_addr().unwrap().port();
    let server_port = server.port();
    let relaying = tokio::spawn(async move {
        let (mut member, _) = relay.accept().await.unwrap();
        let mut upstream = tokio::net::TcpStream::connect(("127.0.0.1", server_port)).await.unwrap();
        let pass = |len: usize| vec![0u8; len];
        let mut hello = pass(STORE.hello_len());
        member.read_exact(&mut hello).await.unwrap();
        upstream.write_all(&hello).await.unwrap();
        let mut challenge = pass(CHALLENGE_LEN);
        upstream.read_exact(&mut challenge).await.unwrap();
        member.write_all(&challenge).await.unwrap();
        let mut proof = pass(PROOF_LEN);
        member.read_exact(&mut proof).await.unwrap();
        upstream.write_all(&proof).await.unwrap();
        let mut verdict = pass(VERDICT_LEN);
        upstream.read_exact(&mut verdict).await.unwrap();
        assert_eq!(verdict[0], 1, "the server took the member's proof");
        drop(member);
        // its own requests, in the clear (VALIDATE, then SET "stolen"), and as a sealed record
        // it cannot make: a record head and junk where the tag goes
        let mut own = vec![0x00, 0xce, 0xf7, 0x85, 0x3c];
        own.extend([0x01, 6, 0, 0, 0, 0, 0, 0, 0]);
        own.extend(b"stolen");
        own.extend([1, 0, 0, 0, 0, 0, 0, 0, b'x']);
        upstream.write_all(&own).await.unwrap();
        let mut answer = Vec::new();
        let _ = upstream.read_to_end(&mut answer).await;
        answer
    });
    // the member dials the relay: its connection fails (the relay dropped it), as it should
    let member = Client::connect(&ConnectOptions {
        secret: Some(secret("the job's")),
        ..ConnectOptions::new("127.0.0.1", relay_port, Some(Duration::from_secs(3)))
    })
    .await;
    assert!(member.is_err());
    let answer = relaying.await.unwrap();
    assert!(answer.is_empty(), "the server closed the relay's connection without a word: {answer:?}");
    assert!(!good.check(&[b"stolen"]).await.unwrap(), "the relay's SET was never served");
    good.set(b"k", b"v").await.unwrap();
    assert_eq!(good.session_mode(), Some(elastix_core::auth::session::Mode::Authenticated));
}
